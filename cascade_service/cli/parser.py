"""The command line's parser class and its error, shared by the `cascade-service` command modules.

Kept apart from `cli/main.py`: each command module imports UsageError from here, so there is one class
for `main` to catch, whichever module runs as `__main__`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""

    def __init__(self, message: str, prog: str = "cascade-service"):
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """argparse that reports bad input as a UsageError (one line, exit 2) instead of exiting.

    Two hooks, which `add_parser` passes on to a subcommand's parser:
    - `arguments`: called with the parser just before it first parses, to add its flags then. A
      subcommand whose module is heavy to import (a benchmark's torch and transformers) costs nothing
      until it runs, or until its --help is asked for; the help line the parent lists is given up front.
    - `shorthand`: rewrites the parser's arguments before they are parsed (`bench --load ...` is
      `bench load ...`: bench/cli.py); a ValueError it raises is a usage error.
    """

    def __init__(
        self,
        *args: Any,
        arguments: Callable[[argparse.ArgumentParser], None] | None = None,
        shorthand: Callable[[list[str]], list[str]] | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self._arguments = arguments
        self._shorthand = shorthand

    def parse_known_args(  # type: ignore[override]  # typeshed overloads it on the namespace's type
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._arguments is not None:
            add, self._arguments = self._arguments, None
            add(self)
        if self._shorthand is not None:
            try:
                args = self._shorthand(list(sys.argv[1:] if args is None else args))
            except ValueError as exc:
                self.error(str(exc))
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage dump
        raise UsageError(message, self.prog)
