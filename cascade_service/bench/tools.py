"""The benchmarks that are not modes of the methods table: `cascade-service bench <name>`, one each.

Each lives in a module of this package with `add_arguments(parser)` (its flags) and `run(args)` (the
run; bad input raises ValueError). The command line imports that module only when its subcommand runs
or its --help is asked for: their imports (torch, transformers, Ray) are heavy. Each module's own
`python -m cascade_service.bench.<module>` still works, through `main` here: the same flags, the same
run.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial


@dataclass(frozen=True)
class Tool:
    name: str  # the subcommand, `cascade-service bench <name>`
    help: str  # one line: what it is for

    @property
    def module(self) -> str:  # cascade_service.bench.<module>
        return self.name.replace("-", "_")


TOOLS = (
    Tool("sessions", "sessions and shared prefixes through the standalone server, with and without the prefix cache"),
    Tool(
        "long-request", "short requests beside one long one: what a long prompt and a long stream cost everybody else"
    ),
    Tool("choices", "several choices of one prompt: do they decode together, or one after another?"),
    Tool(
        "prediction", "predicted outputs: how much faster a request decodes when the client sends the output it expects"
    ),
    Tool("structured", "structured output: does every output follow its JSON schema, and what does the grammar cost?"),
    Tool("grammar-engines", "grammar engines side by side: llguidance (the one we use), xgrammar and outlines-core"),
    Tool(
        "service-overhead",
        "where the service's time goes: per-tier time in-process against through the service, per hop",
    ),
    Tool("transport", "tier transports side by side on the demo config: in-process, Ray handles, gRPC between tiers"),
    Tool("floor-settings", "the floor under other settings (FloorSettings) beside ar and the K-matrix every round"),
    Tool("kv", "what a batched pass costs with each KV storage: a pool read in place against caches packed per pass"),
    Tool(
        "schedule-acceptance",
        "what the engine accepts under a config's schedule, beside the proxy distill and zoo acceptance report",
    ),
    Tool("steps", "what one pass of each model tier costs under each `graphs` mode, side by side"),
    Tool("mixedpass", "how much a verification row adds to a shared pass: one model's pool passes timed side by side"),
    Tool(
        "coupling",
        "what keyed draws cost in acceptance: the Gumbel coupling against speculative sampling's maximal one",
    ),
    Tool("prompt-sets", "rebuild the shipped prompt set where drafts disagree (bench/prompts/disagree.jsonl)"),
)
BY_MODULE = {tool.module: tool for tool in TOOLS}


def add_tools(subparsers: argparse._SubParsersAction) -> None:
    """One subcommand per tool on bench's subparsers, each module imported when its subcommand parses
    (the CLI's parser class's `arguments` hook: cli/parser.py)."""
    for tool in TOOLS:
        subparsers.add_parser(tool.name, help=tool.help, description=tool.help, arguments=partial(_arguments, tool))


def _arguments(tool: Tool, parser: argparse.ArgumentParser) -> None:
    module = importlib.import_module(f"{__package__}.{tool.module}")
    module.add_arguments(parser)
    parser.set_defaults(run=module.run)


def main(
    module: str,
    argv: Sequence[str] | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> int:
    """`python -m cascade_service.bench.<module>`: `cascade-service bench <name>` by its old name (either
    name here), with the module's own `add_arguments` and `run` (run as `__main__`, it is not imported
    again). Bad input: argparse's usage and exit status 2, as before."""
    tool = BY_MODULE[module.replace("-", "_")]
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}.{tool.module}", description=tool.help)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        parser.error(str(exc))
