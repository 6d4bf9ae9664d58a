"""commd.testing"""
