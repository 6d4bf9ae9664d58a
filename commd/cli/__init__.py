"""The `commd` command line: one module per subcommand, assembled by ``commd.cli.main``."""
