"""commd: a per-node gradient communication daemon for synchronous data-parallel training."""

__version__ = "0.1.0"
