"""`cascade-service bench ...` in this process."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from cascade_service.bench.cli import add_bench_command
from cascade_service.cli.parser import Parser

PROMPTS = [
    "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\n",  # repeats: lookups match
    "import os\n",
]


def bench_parser() -> Parser:
    """`cascade-service` with `bench` alone: the CLI's parser class, whose hooks bench uses."""
    parser = Parser(prog="cascade-service")
    add_bench_command(parser.add_subparsers(dest="command", required=True, parser_class=Parser), Parser)
    return parser


def run_bench(*argv: str) -> int:
    """`cascade-service bench ARGV`: a subcommand (`methods`, `load`, ...) first, or the old flags."""
    args = bench_parser().parse_args(["bench", *argv])
    return args.run(args)


def bench_inputs(root: Path, family: dict) -> Path:
    """A config over the tiny family (close on the lean forward, mid, MaG) and PROMPTS, written in `root`."""
    config = {
        "tiers": {
            "target": {"name": "target", "path": str(family["target"])},
            "drafters": [
                {"name": "close", "path": str(family["close"]), "backend": "lean"},
                {"name": "mid", "path": str(family["mid"])},
                {"kind": "mag"},
            ],
        },
        "schedule": {"k_matrix": [[4, 2, 0], [0, 2, 6], [0, 0, 6]], "leniency": 1.5},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root
