"""`cascade-service bench`: our engine and transformers' decoders, measured side by side in one process."""

from __future__ import annotations

import argparse
import json
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

DEFAULT_SD_KS = "1,2,3,4,5,6,7,8"


def add_bench_command(subparsers: argparse._SubParsersAction, parser_class: type[argparse.ArgumentParser]) -> None:
    """Register `bench` on the CLI's subparsers.

    parser_class is the CLI's parser class, for nested subcommands (bench has none; `subparsers`
    already builds parsers of that class).
    """
    del parser_class
    p = subparsers.add_parser(
        "bench",
        help="benchmark methods side by side in one process (greedy, exact); "
        "--lossy: cost-quality curves of the final-verifier rules",
    )
    p.add_argument(
        "--config",
        help="YAML config naming the target and drafter tiers (with --load: start the "
        "cascade and plain decoding standalone and compare them)",
    )
    p.add_argument("--prompts", help='JSON lines, one {"prompt": "..."} per line (--load: optional)')
    p.add_argument(
        "--methods",
        help="comma-separated: hf-ar, ar, default, off, hf-assisted:<tier>, hf-prompt-lookup, sd:<tier>, "
        "csd:<tier>+<tier>... (hf-ar, the reference, and ar, plain decoding through our engine, always run; "
        "default: the config's cascade under the floor, as generate and serve run it); not with --lossy",
    )
    p.add_argument(
        "--lossy",
        action="store_true",
        help="sweep every final-verifier rule over its knob with the config's cascade (writes "
        "lossy.json and lossy_curves.png)",
    )
    p.add_argument(
        "--rules", help="with --lossy: comma-separated rules (default: all; 'lossy-tuned' is lossy with beta tuned)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="the methods table's sampling temperature (default 0: greedy, every output compared with hf-ar's); "
        "with --lossy: sampling temperature (default 1.0); with --load: the requests' temperature "
        "(default: the server's)",
    )
    p.add_argument("--seeds", default="0,1", help="with --lossy: sampling seeds per prompt")
    p.add_argument(
        "--load",
        action="store_true",
        help="concurrent clients against a running service (--target; reports server memory too) or "
        "against the cascade and plain decoding started from --config: latency, throughput, "
        "errors (writes load.json)",
    )
    p.add_argument(
        "--idle",
        action="store_true",
        help="idle calls (headers, never a body) against a running service (--target) or the config's "
        "cascade served standalone (--config): latency of normal requests and health checks beside "
        "each --levels count of them (writes idle.json)",
    )
    p.add_argument("--levels", default="80,320,800", help="with --idle: comma-separated idle call counts")
    p.add_argument("--requests", type=int, default=10, help="with --idle: timed requests per level")
    p.add_argument("--workers", type=int, default=8, help="with --idle --config: calls the server runs at once")
    p.add_argument("--target", help="with --load or --idle: HOST:PORT of a running service on this machine")
    p.add_argument(
        "--protocols",
        help="with --load --config: 'grpc,http' drives one server through gRPC and through the OpenAI-compatible "
        "HTTP API side by side, with TTFT and ITL percentiles",
    )
    p.add_argument("--concurrency", default="1,4,16", help="with --load: comma-separated client counts")
    p.add_argument("--duration", type=float, default=20.0, help="with --load: seconds per concurrency level")
    p.add_argument("--api-key", help="with --load: the API key to send")
    p.add_argument(
        "--blocks",
        type=int,
        default=1,
        help="with --load --config: run the sweep this many times; ratios are medians of paired blocks",
    )
    p.add_argument(
        "--modes",
        default="default,plain",
        help="with --load --config: what to serve and compare, each against plain at the same load: default "
        "(what serve runs: the floor over load adaptation), cascade (the K-matrix as configured), "
        "cascade-adaptive (load adaptation without the floor), off (the default server, every request with "
        "speculation off), plain (the target alone)",
    )
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="SpecDec++ and confidence stopping against fixed draft lengths at one drafter, alone or "
        "reviewing --reviews (writes adaptive.json)",
    )
    p.add_argument("--drafter", help="with --adaptive: the drafter tier (default: the config's last model drafter)")
    p.add_argument(
        "--reviews",
        metavar="TIER",
        help="with --adaptive: the drafter reviews this smaller tier (SpecDec++ at a reviewing tier)",
    )
    p.add_argument(
        "--under",
        metavar="TIER",
        help="with --adaptive: the drafter drafts under this bigger tier, which reviews it "
        "(SpecDec++ at a tier drafting under a reviewer)",
    )
    p.add_argument(
        "--other-k",
        type=int,
        default=2,
        help="with --reviews: tokens the reviewed tier drafts a round; with --under: tokens the "
        "reviewer adds to the target's block",
    )
    p.add_argument("--head", help="with --adaptive: acceptance head directory (`cascade-service train-head`)")
    p.add_argument("--max-k", type=int, default=16, help="with --adaptive: the cap on adaptive blocks")
    p.add_argument("--thresholds", default="0.3,0.5,0.7,0.8,0.9", help="with --adaptive: SpecDec++ h values")
    p.add_argument(
        "--confidence",
        default="0.2,0.4,0.6,0.8",
        help="with --adaptive: confidence h values (not with --reviews: a reviewing tier has no proposal "
        "distribution to read)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed passes over all prompts; tokens/s is their median")
    p.add_argument("--sd-k-sweep", default=DEFAULT_SD_KS, help="k values tried for each sd: method")
    p.add_argument(
        "--tuned",
        action="append",
        default=[],
        metavar="CONFIG",
        help="a config (e.g. from `tune`) whose K-matrix and leniency a csd: method with exactly "
        "its drafters uses; repeatable",
    )
    p.add_argument("--out", required=True, help="output directory for results.json, results.md and plots")
    p.set_defaults(run=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    if sum(map(bool, (args.lossy, args.adaptive, args.load, args.idle))) > 1:
        raise ValueError("--lossy, --adaptive, --load and --idle are separate benchmarks: pick one")
    if args.load:
        return run_load(args)
    if args.idle:
        return run_idle(args)
    if not args.config or not args.prompts:
        raise ValueError("--config and --prompts are required (except with --load)")
    if args.lossy:
        return run_lossy(args)
    if args.adaptive:
        return run_adaptive(args)
    if not args.methods:
        raise ValueError("--methods is required (or --lossy, or --adaptive)")
    # Heavy imports (torch, transformers, matplotlib) only once the command actually runs.
    from ..config import load_config
    from .harness import run_bench, summarize
    from .methods import parse_methods

    require("matplotlib", "bench (its plots)")
    from ..prompts import read_prompts
    from ..runtime.core import EngineCore
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
    # loop's, where our passes run (models.hf.on_loop_thread says why one thread).
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
