"""`cascade-service bench ...` in this process."""

from __future__ import annotations

import argparse

from cascade_service.bench.cli import add_bench_command


def run_bench(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="cascade-service")
    add_bench_command(parser.add_subparsers(dest="command", required=True), argparse.ArgumentParser)
    args = parser.parse_args(["bench", *argv])
    return args.run(args)
