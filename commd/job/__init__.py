"""commd.job"""
