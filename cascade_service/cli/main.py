"""`cascade-service` command line. Subcommands register themselves in `COMMANDS`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from functools import partial

from ..config import ConfigError
from ..extras import MissingExtra
from ..zoo.families import BUILDERS
from .client import add_client
from .generate import add_generate
from .models import add_models_command
from .parser import Parser, UsageError
from .serve import add_serve_command
from .tier import add_tier_command


def _add_zoo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("zoo", help="build, lengthen, measure and ship model families (offline)")
    zoo_sub = p.add_subparsers(dest="zoo_command", required=True, parser_class=Parser)
    build = zoo_sub.add_parser("build", help="build a model family into $CASCADE_SERVICE_HOME/zoo/<preset>")
    build.add_argument(
        "--preset",
        default="demo",
        choices=list(BUILDERS),
        help="; ".join(f"{name}: {line}" for name, (_, line) in BUILDERS.items()),
    )
    build.add_argument("--out", help="output directory (default: $CASCADE_SERVICE_HOME/zoo/<preset>)")
    build.set_defaults(run=_run_zoo_build)
    evaluate = zoo_sub.add_parser(
        "evaluate",
        help="measure a built family (step costs, agreement, loss per token and per character, loops) "
        "on code it never trained on",
    )
    evaluate.add_argument("dir", help="the zoo directory (holding large/, base/, small/)")
    evaluate.add_argument("--prompts", help="JSON lines of prompts (default: the zoo's own prompts.jsonl)")
    evaluate.add_argument("--out", help="also write the report here as JSON")
    evaluate.set_defaults(run=_run_zoo_evaluate)
    for name, (module, line) in ZOO_TOOLS.items():
        zoo_sub.add_parser(name, help=line, description=line, arguments=partial(_zoo_tool, module))


# zoo subcommands with a module of their own (add_arguments, run; `python -m cascade_service.zoo.<module>`
# runs it too): name -> (module, its HELP). Imported when the subcommand parses: they import torch.
ZOO_TOOLS = {
    "lengthen": (
        "lengthen",
        "lengthen a built family into a directory: large trained on longer windows, its drafters distilled again",
    ),
    "acceptance": (
        "acceptance",
        "how well a drafter agrees with its target on prompts of your choosing, as distill reports it, no training",
    ),
    "ship": ("shipped", "ship a built zoo with the package: copy it into zoo/families/<name> and write its manifest"),
}


def _zoo_tool(module: str, parser: argparse.ArgumentParser) -> None:
    tool = importlib.import_module(f"cascade_service.zoo.{module}")
    tool.add_arguments(parser)
    parser.set_defaults(run=tool.run)


def _run_zoo_evaluate(args: argparse.Namespace) -> int:
    from ..zoo.compare import main_evaluate

    return main_evaluate(args.dir, args.prompts, args.out)


def _run_zoo_build(args: argparse.Namespace) -> int:
    from ..paths import zoo_dir
    from ..zoo.families import build

    paths = build(args.preset, args.out or zoo_dir(args.preset))
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job: decode held-out prompts three ways, print speeds")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4, help="how many held-out prompts to decode")
    p.add_argument(
        "--preset",
        default="quality",
        choices=[p for p in BUILDERS if not p.startswith(("t5", "tiny"))],
        help="which family: quality (default) is shipped with the package; the others are made on first "
        "use (demo: the 8-minute training; grown: the cost-realistic target, minutes)",
    )
    p.add_argument(
        "--config",
        help="a config of your own instead of a zoo preset (e.g. configs/qwen2.5-coder.yaml after `cascade-service "
        "models fetch qwen2.5-coder`): its tiers and its serving layout, prompts from third-party code",
    )
    p.add_argument("--passes", type=int, default=3, help="timed passes over the prompts (after one warm-up)")
    p.add_argument(
        "--layout",
        default="colocated",
        choices=["colocated", "embedded", "separate"],
        help="colocated: every model tier in the coordinator's replica (one machine); embedded: large in the "
        "coordinator, base+small one deployment; separate: one deployment per tier",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show Ray's, Serve's, gRPC's, torch's and transformers' output on the terminal too (by default it "
        "goes to $CASCADE_SERVICE_HOME/logs/demo-<time>-<pid>.log, named at the end)",
    )
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo  # heavy imports only when needed

    if args.config and (args.preset != "quality" or args.layout != "colocated"):
        raise UsageError("demo: --config names the family and the layout; leave out --preset and --layout")
    if args.config:
        from ..config import load_config

        load_config(args.config)  # a bad config fails here, before Ray starts
    return run_demo(args.max_new_tokens, args.prompts, args.preset, args.layout, args.passes, args.verbose, args.config)


def _add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="choose the K-matrix and leniency from measured acceptance and cost")
    p.add_argument("--config", required=True)
    p.add_argument("--prompts", required=True, help='JSON lines {"prompt": "..."}')
    p.add_argument("--out", required=True, help="where to write the tuned config (YAML)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--objective", default="tokens_per_s", help="tokens_per_s, swi_params or swi_measured")
    p.set_defaults(run=_run_tune)


def _run_tune(args: argparse.Namespace) -> int:
    from ..tune import tune

    tune(args.config, args.prompts, args.out, args.max_new_tokens, args.objective)
    return 0


def _add_train_head(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-head", help="train a SpecDec++ acceptance head for a zoo drafter (offline)")
    from .train_head import add_arguments

    add_arguments(p)
    p.set_defaults(run=_run_train_head)


def _run_train_head(args: argparse.Namespace) -> int:
    from .train_head import run

    return run(args)


def _add_distill(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("distill", help="train a drafter to agree with a target, on the target's own outputs")
    from .distill import add_arguments

    add_arguments(p)
    p.set_defaults(run=_run_distill)


def _run_distill(args: argparse.Namespace) -> int:
    from .distill import run

    return run(args)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from ..bench.cli import add_bench_command

    add_bench_command(sub, Parser)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_generate,
    _add_zoo,
    _add_demo,
    _add_tune,
    _add_train_head,
    _add_distill,
    _add_bench,
    add_serve_command,
    add_tier_command,
    add_client,
    add_models_command,
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="cascade-service", description="Cascade Speculative Drafting service")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except (UsageError, ConfigError, FileNotFoundError, ValueError, MissingExtra) as exc:
        prog = getattr(exc, "prog", "cascade-service")
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
