"""The `kvindex` command line: one dispatcher (main), one module per subcommand, the TOML configuration and
process setup (open-files limit, GIL switch interval). Imports everything; nothing imports it."""
