"""The command line's parser class and its error, shared by the `cascade-service` command modules.

Kept apart from `cli.py`: `python -m cascade_service.cli` runs that module as `__main__`, and a command
module importing UsageError from it would get a second class that `main` does not catch.
"""

from __future__ import annotations

import argparse
from typing import NoReturn


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""

    def __init__(self, message: str, prog: str = "cascade-service"):
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """argparse that reports bad input as a UsageError (one line, exit 2) instead of exiting."""

    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage dump
        raise UsageError(message, self.prog)
