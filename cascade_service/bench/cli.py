"""`cascade-service bench`: one subcommand per benchmark.

- `bench methods`, what `bench` with no subcommand runs: our engine and transformers' decoders,
  measured side by side in one process (`run_methods` here);
- the harness's other modes, `lossy`, `adaptive`, `load` and `idle` (bench/runs.py);
- the benchmark tools, a module of this package each (bench/tools.py).

Each subcommand takes only its own flags. The modes were once flags of one command (`bench --load
...`): `shorthand` still reads that form as the subcommand it now is, and says so on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..extras import require
from .runs import (
    check_range,
    check_temperature_arg,
    command_line,
    config_summary,
    int_list,
    machine,
    run_adaptive,
    run_idle,
    run_load,
    run_lossy,
)
from .tools import TOOLS, add_tools

DEFAULT_SD_KS = "1,2,3,4,5,6,7,8"
# The modes of the methods table's harness, each with its one line; `methods` first, the default.
MODES = {
    "methods": "our cascade and transformers' decoders side by side on the same prompts (the default)",
    "lossy": "cost-quality curves of the final-verifier rules, each swept over its knob",
    "adaptive": "SpecDec++ and confidence stopping against fixed draft lengths at one drafter",
    "load": "concurrent clients against a running service, or servers it starts: latency, throughput",
    "idle": "idle calls (headers, never a body): what they cost normal requests and health checks",
}
SUBCOMMANDS = (*MODES, *(tool.name for tool in TOOLS))
OLD_FLAGS = {f"--{mode}": mode for mode in MODES if mode != "methods"}  # `bench --load ...` before the subcommands


def add_bench_command(subparsers: argparse._SubParsersAction, parser_class: type[argparse.ArgumentParser]) -> None:
    """Register `bench` and its subcommands on the CLI's subparsers.

    parser_class is the CLI's parser class (cli.parser.Parser), for bench's own subcommands; bench uses
    its two hooks, `shorthand` (the old mode flags) and `arguments` (a tool's flags, added when it runs).
    """
    p = subparsers.add_parser(
        "bench",
        help="measure: methods side by side (bench methods, the default) and the other benchmarks, one "
        "subcommand each (bench --help)",
        description="Benchmarks, one subcommand each: the methods table and its other modes (methods, lossy, "
        "adaptive, load, idle), then measurements of the service's parts. `cascade-service bench FLAGS` with "
        "no subcommand is `bench methods FLAGS`.",
        shorthand=shorthand,
    )
    sub = p.add_subparsers(
        dest="bench_command", metavar="SUBCOMMAND", required=True, parser_class=parser_class, title="subcommands"
    )
    adders = {"methods": _add_methods, "lossy": _add_lossy, "adaptive": _add_adaptive, "load": _add_load}
    for mode, line in MODES.items():
        (adders | {"idle": _add_idle})[mode](sub.add_parser(mode, help=line, description=line))
    add_tools(sub)


def shorthand(argv: list[str]) -> list[str]:
    """`bench FLAGS` as it ran before the subcommands: `bench methods FLAGS`, or with one old mode flag
    (`--load`) that mode's subcommand with the other flags (`bench load FLAGS`)."""
    if not argv or not argv[0].startswith("-") or argv[0] in ("-h", "--help"):
        return argv  # a subcommand (or a wrong word, which argparse names), or bench's own help
    old = list(dict.fromkeys(arg for arg in argv if arg in OLD_FLAGS))
    if len(old) > 1:
        runs = " or ".join(f"`cascade-service bench {OLD_FLAGS[flag]}`" for flag in old)
        raise ValueError(f"{' and '.join(old)} are separate benchmarks, now subcommands: run {runs}")
    if not old:
        return ["methods", *argv]
    mode = OLD_FLAGS[old[0]]
    print(f"cascade-service bench: {old[0]} is now `cascade-service bench {mode}`; running that", file=sys.stderr)
    return [mode, *(arg for arg in argv if arg != old[0])]


def _config_prompts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config naming the target and drafter tiers")
    p.add_argument("--prompts", required=True, help='JSON lines, one {"prompt": "..."} per line')


def _max_new_tokens(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per request (default 128)")


def _out(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--out", required=True, help=f"output directory for {what}")


def _add_methods(p: argparse.ArgumentParser) -> None:
    _config_prompts(p)
    p.add_argument(
        "--methods",
        required=True,
        help="comma-separated: hf-ar, ar, default, off, hf-assisted:<tier>, hf-prompt-lookup, suffix, sd:<tier>, "
        "csd:<tier>+<tier>... (hf-ar, the reference, and ar, plain decoding through our engine, always run; "
        "default: the config's cascade under the floor, as generate and serve run it)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature (default 0: greedy, every output compared with hf-ar's)",
    )
    _max_new_tokens(p)
    p.add_argument("--repeats", type=int, default=3, help="timed passes over all prompts; tokens/s is their median")
    p.add_argument("--sd-k-sweep", default=DEFAULT_SD_KS, help="k values tried for each sd: method")
    p.add_argument(
        "--tuned",
        action="append",
        default=[],
        metavar="CONFIG",
        help="a config (e.g. from `tune`) whose K-matrix, leniency and lookup a csd: method with exactly "
        "its drafters uses, before the config's own; repeatable",
    )
    _out(p, "results.json, results.md and plots")
    p.set_defaults(run=run_methods)


def _add_lossy(p: argparse.ArgumentParser) -> None:
    _config_prompts(p)
    p.add_argument("--rules", help="comma-separated rules (default: all; 'lossy-tuned' is lossy with beta tuned)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1.0)")
    p.add_argument("--seeds", default="0,1", help="sampling seeds per prompt")
    _max_new_tokens(p)
    _out(p, "lossy.json and lossy_curves.png")
    p.set_defaults(run=run_lossy)


def _add_adaptive(p: argparse.ArgumentParser) -> None:
    _config_prompts(p)
    p.add_argument("--drafter", help="the drafter tier (default: the config's last model drafter)")
    p.add_argument(
        "--reviews", metavar="TIER", help="the drafter reviews this smaller tier (SpecDec++ at a reviewing tier)"
    )
    p.add_argument(
        "--under",
        metavar="TIER",
        help="the drafter drafts under this bigger tier, which reviews it (SpecDec++ at a tier drafting under a "
        "reviewer)",
    )
    p.add_argument(
        "--other-k",
        type=int,
        default=2,
        help="with --reviews: tokens the reviewed tier drafts a round; with --under: tokens the "
        "reviewer adds to the target's block",
    )
    p.add_argument("--head", help="acceptance head directory (`cascade-service train-head`)")
    p.add_argument("--max-k", type=int, default=16, help="the cap on adaptive blocks")
    p.add_argument("--sd-k-sweep", default=DEFAULT_SD_KS, help="the fixed draft lengths compared")
    p.add_argument("--thresholds", default="0.3,0.5,0.7,0.8,0.9", help="SpecDec++ h values")
    p.add_argument(
        "--confidence",
        default="0.2,0.4,0.6,0.8",
        help="confidence h values (not with --reviews: a reviewing tier has no proposal distribution to read)",
    )
    _max_new_tokens(p)
    p.add_argument("--repeats", type=int, default=3, help="timed passes over all prompts; tokens/s is their median")
    _out(p, "adaptive.json")
    p.set_defaults(run=run_adaptive)


def _service(p: argparse.ArgumentParser, config: str) -> None:
    p.add_argument("--target", help="HOST:PORT of a running service on this machine")
    p.add_argument("--config", help=f"or a YAML config: {config}")
    p.add_argument("--api-key", help="with --target: the API key to send")


def _add_load(p: argparse.ArgumentParser) -> None:
    _service(p, "start the cascade and plain decoding standalone and compare them")
    p.add_argument("--prompts", help='JSON lines, one {"prompt": "..."} per line (default: a built-in set)')
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per concurrency level")
    p.add_argument("--temperature", type=float, default=None, help="the requests' temperature (default: the server's)")
    _max_new_tokens(p)
    p.add_argument(
        "--modes",
        default="default,plain",
        help="with --config: what to serve and compare, each against plain at the same load: default "
        "(what serve runs: the floor over load adaptation), cascade (the K-matrix as configured), "
        "cascade-adaptive (load adaptation without the floor), off (the default server, every request with "
        "speculation off), plain (the target alone), twin (a second plain server: the control, what the bench "
        "reads between two identical servers)",
    )
    p.add_argument(
        "--blocks",
        type=int,
        default=1,
        help="with --config: run the sweep this many times, each on fresh server processes; ratios are medians "
        "of paired blocks",
    )
    p.add_argument(
        "--from-start",
        action="store_true",
        help="count each level from its clients' start, their first requests' burst of prefills included "
        "(by default its window opens once every client has finished a request: steady load)",
    )
    p.add_argument(
        "--protocols",
        help="with --config: 'grpc,http' drives one server through gRPC and through the OpenAI-compatible "
        "HTTP API side by side, with TTFT and ITL percentiles",
    )
    _out(p, "load.json")
    p.set_defaults(run=run_load)


def _add_idle(p: argparse.ArgumentParser) -> None:
    _service(p, "serve its cascade standalone")
    p.add_argument("--workers", type=int, default=8, help="with --config: calls the server runs at once")
    p.add_argument("--levels", default="80,320,800", help="comma-separated idle call counts")
    p.add_argument("--requests", type=int, default=10, help="timed requests per level")
    _max_new_tokens(p)
    _out(p, "idle.json")
    p.set_defaults(run=run_idle)


def run_methods(args: argparse.Namespace) -> int:
    # Heavy imports (torch, transformers, matplotlib) only once the command actually runs.
    from ..config import load_config
    from .harness import run_bench, summarize
    from .methods import parse_methods

    require("matplotlib", "bench (its plots)")
    from ..engine.core import EngineCore
    from ..prompts import read_prompts
    from .report import markdown, plot_acceptance, plot_speedup
    from .zoo import Zoo

    check_range(args.max_new_tokens, "--max-new-tokens", 1, 1_000_000)
    check_range(args.repeats, "--repeats", 1, 1000)
    sd_ks = int_list(args.sd_k_sweep, "--sd-k-sweep")
    config = load_config(args.config)
    texts = read_prompts(args.prompts)
    tuned = [load_config(path).cascade for path in args.tuned]
    temperature = 0.0 if args.temperature is None else args.temperature
    check_temperature_arg(temperature)
    # bad names fail before any model loads
    methods = parse_methods(args.methods, config.cascade, sd_ks, tuned, greedy=temperature == 0.0)

    core = EngineCore()

    def measure() -> tuple:
        zoo = Zoo(config.cascade, core)
        prompts = [zoo.encode(t) for t in texts]
        for i, ids in enumerate(prompts):
            if not ids:
                raise ValueError(f"--prompts: prompt {i + 1} encodes to no tokens")
        logs = run_bench(zoo, methods, prompts, args.max_new_tokens, args.repeats, temperature)
        # step times measured after the runs, on warm models
        return prompts, logs, zoo.swi_costs(), zoo.tier_costs()

    # Every method, ours and transformers' baselines, and every timing on one thread: the engine
    # loop's, where our passes run (engine.loop.on_loop_thread says why one thread).
    prompts, logs, costs, tiers = core.run(measure)
    results = {
        "command": command_line(args),
        "config": config_summary(args.config, config.cascade),
        "machine": machine(),
        "max_new_tokens": args.max_new_tokens,
        "temperature": temperature,
        "repeats": args.repeats,
        "sd_k_sweep": sd_ks,
        "prompts": [{"prompt": t, "num_tokens": len(ids)} for t, ids in zip(texts, prompts)],
        "swi_costs": costs,
        "tier_costs": tiers,
        "methods": summarize(methods, logs, costs, greedy=temperature == 0.0),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(results)
    (out / "results.md").write_text(table)
    plot_acceptance(results, out / "acceptance_by_position.png")
    plot_speedup(results, out / "speedup.png")
    print(table, end="")
    return 0
