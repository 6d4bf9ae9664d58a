"""commd.daemon"""
