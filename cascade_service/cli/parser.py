"""The command line's parser class and its error, shared by the `cascade-service` command modules.

Kept apart from `cli/main.py`: each command module imports UsageError from here, so there is one class
for `main` to catch, whichever module runs as `__main__`.
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
