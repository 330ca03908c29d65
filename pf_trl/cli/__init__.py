"""The `pf-trl` command line: one module per subcommand, each with ``main(argv)``."""
