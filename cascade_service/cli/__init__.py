"""The `cascade-service` command: `main` parses and runs one subcommand (cli.main); `serve` (cli.serve)
and the argument parser (cli.parser) are its parts."""

from .main import build_parser, main
from .parser import UsageError

__all__ = ["UsageError", "build_parser", "main"]
