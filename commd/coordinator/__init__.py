"""commd.coordinator"""
