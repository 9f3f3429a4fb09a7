"""`harness bench` subcommands, one file each."""
