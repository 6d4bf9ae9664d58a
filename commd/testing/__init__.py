"""commd.testing: local daemons (``daemons``) and subprocess helpers (``processes``) for the
tests, benchmarks and examples. Standard library only, besides commd itself."""
