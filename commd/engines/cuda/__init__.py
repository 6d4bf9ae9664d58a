"""commd.engines.cuda"""
