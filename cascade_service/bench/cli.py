"""`cascade-service bench`: our engine and transformers' decoders, measured side by side in one process."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
from importlib import metadata
from pathlib import Path

from ..core.request import check_temperature
from ..extras import require

DEFAULT_SD_KS = "1,2,3,4,5,6,7,8"


def add_bench_command(subparsers: argparse._SubParsersAction, parser_class: type[argparse.ArgumentParser]) -> None:
    """Register `bench` on the CLI's subparsers.

    parser_class is the CLI's parser class, for nested subcommands (bench has none; `subparsers`
    already builds parsers of that class).
    """
    del parser_class
    p = subparsers.add_parser("bench", help="benchmark methods side by side in one process (greedy, exact); "
                                             "--lossy: cost-quality curves of the final-verifier rules")
    p.add_argument("--config", help="YAML config naming the target and drafter tiers (with --load: start the "
                                    "cascade and plain decoding standalone and compare them)")
    p.add_argument("--prompts", help='JSON lines, one {"prompt": "..."} per line (--load: optional)')
    p.add_argument("--methods",
                   help="comma-separated: hf-ar, ar, hf-assisted:<tier>, hf-prompt-lookup, sd:<tier>, "
                        "csd:<tier>+<tier>... (hf-ar, the reference, always runs); not with --lossy")
    p.add_argument("--lossy", action="store_true",
                   help="sweep every final-verifier rule over its knob with the config's cascade (writes "
                        "lossy.json and lossy_curves.png)")
    p.add_argument("--rules", help="with --lossy: comma-separated rules (default: all; 'lossy-tuned' is lossy "
                                   "with beta tuned)")
    p.add_argument("--temperature", type=float, default=None,
                   help="with --lossy: sampling temperature (default 1.0); with --load: the requests' temperature "
                        "(default: the server's)")
    p.add_argument("--seeds", default="0,1", help="with --lossy: sampling seeds per prompt")
    p.add_argument("--load", action="store_true",
                   help="concurrent clients against a running service (--target; reports server memory too) or "
                        "against the cascade and plain decoding started from --config: latency, throughput, "
                        "errors (writes load.json)")
    p.add_argument("--idle", action="store_true",
                   help="idle calls (headers, never a body) against a running service (--target) or the config's "
                        "cascade served standalone (--config): latency of normal requests and health checks beside "
                        "each --levels count of them (writes idle.json)")
    p.add_argument("--levels", default="80,320,800", help="with --idle: comma-separated idle call counts")
    p.add_argument("--requests", type=int, default=10, help="with --idle: timed requests per level")
    p.add_argument("--workers", type=int, default=8, help="with --idle --config: calls the server runs at once")
    p.add_argument("--target", help="with --load or --idle: HOST:PORT of a running service on this machine")
    p.add_argument("--concurrency", default="1,4,16", help="with --load: comma-separated client counts")
    p.add_argument("--duration", type=float, default=20.0, help="with --load: seconds per concurrency level")
    p.add_argument("--api-key", help="with --load: the API key to send")
    p.add_argument("--modes", default="cascade,plain",
                   help="with --load --config: what to serve and compare: cascade (the K-matrix as configured), "
                        "plain (the target alone), cascade-adaptive (draft budgets that follow acceptance and load)")
    p.add_argument("--adaptive", action="store_true",
                   help="SpecDec++ and confidence stopping against fixed draft lengths at one drafter, alone or "
                        "reviewing --reviews (writes adaptive.json)")
    p.add_argument("--drafter", help="with --adaptive: the drafter tier (default: the config's last model drafter)")
    p.add_argument("--reviews", metavar="TIER",
                   help="with --adaptive: the drafter reviews this smaller tier (SpecDec++ at a reviewing tier)")
    p.add_argument("--under", metavar="TIER",
                   help="with --adaptive: the drafter drafts under this bigger tier, which reviews it "
                        "(SpecDec++ at a tier drafting under a reviewer)")
    p.add_argument("--other-k", type=int, default=2,
                   help="with --reviews: tokens the reviewed tier drafts a round; with --under: tokens the "
                        "reviewer adds to the target's block")
    p.add_argument("--head", help="with --adaptive: acceptance head directory (`cascade-service train-head`)")
    p.add_argument("--max-k", type=int, default=16, help="with --adaptive: the cap on adaptive blocks")
    p.add_argument("--thresholds", default="0.3,0.5,0.7,0.8,0.9", help="with --adaptive: SpecDec++ h values")
    p.add_argument("--confidence", default="0.2,0.4,0.6,0.8",
                   help="with --adaptive: confidence h values (not with --reviews: a reviewing tier has no proposal "
                        "distribution to read)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed passes over all prompts; tokens/s is their median")
    p.add_argument("--sd-k-sweep", default=DEFAULT_SD_KS, help="k values tried for each sd: method")
    p.add_argument("--tuned", action="append", default=[], metavar="CONFIG",
                   help="a config (e.g. from `tune`) whose K-matrix and leniency a csd: method with exactly "
                        "its drafters uses; repeatable")
    p.add_argument("--out", required=True, help="output directory for results.json, results.md and plots")
    p.set_defaults(run=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    if sum(map(bool, (args.lossy, args.adaptive, args.load, args.idle))) > 1:
        raise ValueError("--lossy, --adaptive, --load and --idle are separate benchmarks: pick one")
    if args.load:
        return _run_load(args)
    if args.idle:
        return _run_idle(args)
    if not args.config or not args.prompts:
        raise ValueError("--config and --prompts are required (except with --load)")
    if args.lossy:
        return _run_lossy(args)
    if args.adaptive:
        return _run_adaptive(args)
    if not args.methods:
        raise ValueError("--methods is required (or --lossy, or --adaptive)")
    # Heavy imports (torch, transformers, matplotlib) only once the command actually runs.
    from ..config import load_config
    from .harness import run_bench, summarize
    from .methods import parse_methods

    require("matplotlib", "bench (its plots)")
    from .report import markdown, plot_acceptance, plot_speedup
    from .zoo import Zoo
    from ..prompts import read_prompts

    _check_range(args.max_new_tokens, "--max-new-tokens", 1, 1_000_000)
    _check_range(args.repeats, "--repeats", 1, 1000)
    sd_ks = _int_list(args.sd_k_sweep, "--sd-k-sweep")
    config = load_config(args.config)
    texts = read_prompts(args.prompts)
    tuned = [load_config(path).cascade for path in args.tuned]
    methods = parse_methods(args.methods, config.cascade, sd_ks, tuned)  # bad names fail before any model loads

    zoo = Zoo(config.cascade)
    prompts = [zoo.encode(t) for t in texts]
    for i, ids in enumerate(prompts):
        if not ids:
            raise ValueError(f"--prompts: prompt {i + 1} encodes to no tokens")
    logs = run_bench(zoo, methods, prompts, args.max_new_tokens, args.repeats)
    costs = zoo.swi_costs()  # step times measured after the runs, on warm models
    results = {
        "command": _command(args),
        "config": _config_summary(args.config, config.cascade),
        "machine": _machine(),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "sd_k_sweep": sd_ks,
        "prompts": [{"prompt": t, "num_tokens": len(ids)} for t, ids in zip(texts, prompts)],
        "swi_costs": costs,
        "methods": summarize(methods, logs, costs),
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


def _run_lossy(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..engine import Engine
    from ..prompts import read_prompts
    from . import lossy

    if args.methods:
        raise ValueError("--methods goes without --lossy")
    _check_range(args.max_new_tokens, "--max-new-tokens", 1, 1_000_000)
    args.temperature = 1.0 if args.temperature is None else args.temperature
    _check_temperature(args.temperature)
    rules = [r for r in (args.rules or ",".join(lossy.GRIDS)).split(",") if r]
    unknown = [r for r in rules if r not in lossy.GRIDS]
    if unknown:
        raise ValueError(f"--rules: unknown rule {unknown[0]!r} (known: {', '.join(lossy.GRIDS)})")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    engine = Engine(load_config(args.config).cascade)
    prompts = [engine.encode(t) for t in read_prompts(args.prompts)]
    command = shlex.join(["cascade-service", "bench", "--lossy", "--config", args.config, "--prompts", args.prompts,
                          "--rules", ",".join(rules), "--temperature", str(args.temperature), "--seeds", args.seeds,
                          "--max-new-tokens", str(args.max_new_tokens), "--out", args.out])
    lossy.run(engine, prompts, rules, args.max_new_tokens, args.temperature, seeds, Path(args.out), command)
    return 0


def _run_load(args: argparse.Namespace) -> int:
    from ..prompts import read_prompts
    from . import load

    if bool(args.target) == bool(args.config):
        raise ValueError("--load needs either --target HOST:PORT of a running service or --config PATH "
                         "(then it starts the cascade and plain decoding itself and compares them)")
    concurrencies = _int_list(args.concurrency, "--concurrency")
    if not 0 < args.duration <= 3600:
        raise ValueError(f"--duration must be in (0, 3600] seconds, got {args.duration}")
    _check_range(args.max_new_tokens, "--max-new-tokens", 1, 4096)
    if args.temperature is not None:
        _check_temperature(args.temperature)
    prompts = read_prompts(args.prompts) if args.prompts else list(load.DEFAULT_PROMPTS)
    source = ["--config", args.config] if args.config else ["--target", args.target]
    command = shlex.join(["cascade-service", "bench", "--load", *source, "--concurrency", args.concurrency,
                          "--duration", str(args.duration), "--max-new-tokens", str(args.max_new_tokens),
                          *(["--prompts", args.prompts] if args.prompts else []),
                          *(["--temperature", str(args.temperature)] if args.temperature is not None else []),
                          "--out", args.out])
    if args.config:
        from ..config import load_config

        load_config(args.config)  # a bad config fails here, not in the server processes
        modes = [m for m in args.modes.split(",") if m]
        unknown = [m for m in modes if m not in load.MODES]
        if unknown or not modes:
            raise ValueError(f"--modes: expected some of {', '.join(load.MODES)}, got {args.modes!r}")
        load.run_modes(args.config, concurrencies, args.duration, prompts, args.max_new_tokens, Path(args.out),
                       command + (f" --modes {args.modes}" if args.modes != "cascade,plain" else ""), modes=modes,
                       temperature=args.temperature)
        return 0
    if ":" not in args.target:
        raise ValueError("--target: expected HOST:PORT")
    host = args.target.rsplit(":", 1)[0].strip("[]")
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"--target: load tests run on loopback only, got {host!r}")
    load.run(args.target, concurrencies, args.duration, prompts, args.max_new_tokens, Path(args.out), command,
             api_key=args.api_key, temperature=args.temperature)
    return 0


def _run_idle(args: argparse.Namespace) -> int:
    from . import idle, load

    if bool(args.target) == bool(args.config):
        raise ValueError("--idle needs either --target HOST:PORT of a running service or --config PATH")
    levels = _int_list(args.levels, "--levels", hi=10_000)
    _check_range(args.requests, "--requests", 1, 10_000)
    _check_range(args.workers, "--workers", 1, 1024)
    _check_range(args.max_new_tokens, "--max-new-tokens", 1, 4096)
    prompt = load.DEFAULT_PROMPTS[0]
    source = ["--config", args.config, "--workers", str(args.workers)] if args.config else ["--target", args.target]
    command = shlex.join(["cascade-service", "bench", "--idle", *source, "--levels", args.levels, "--requests",
                          str(args.requests), "--max-new-tokens", str(args.max_new_tokens), "--out", args.out])
    if args.config:
        idle.run_standalone(args.config, levels, args.requests, prompt, args.max_new_tokens, Path(args.out), command,
                            args.workers)
        return 0
    host = args.target.rsplit(":", 1)[0].strip("[]")
    if ":" not in args.target or host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"--target: expected a loopback HOST:PORT, got {args.target!r}")
    idle.run(args.target, levels, args.requests, prompt, args.max_new_tokens, Path(args.out), command,
             api_key=args.api_key)
    return 0


def _run_adaptive(args: argparse.Namespace) -> int:
    from ..config import MaGConfig, load_config
    from ..engine import Engine
    from ..prompts import read_prompts
    from . import adaptive

    if args.methods:
        raise ValueError("--methods goes without --adaptive")
    _check_range(args.max_new_tokens, "--max-new-tokens", 1, 1_000_000)
    _check_range(args.repeats, "--repeats", 1, 1000)
    _check_range(args.max_k, "--max-k", 1, 256)
    config = load_config(args.config)
    models = [d.name for d in config.cascade.drafters if not isinstance(d, MaGConfig)]
    drafter = args.drafter or (models[-1] if models else None)
    if drafter not in models:
        raise ValueError(f"--drafter must be one of the config's model drafters {models}, got {drafter!r}")
    names = [d.name for d in config.cascade.drafters]
    if args.reviews is not None and args.under is not None:
        raise ValueError("--reviews and --under are two settings: pick one")
    if args.reviews is not None and (args.reviews not in names or names.index(args.reviews) <= names.index(drafter)):
        raise ValueError(f"--reviews must be a drafter smaller than {drafter!r}: one of "
                         f"{names[names.index(drafter) + 1:]}, got {args.reviews!r}")
    if args.under is not None and (args.under not in models or names.index(args.under) >= names.index(drafter)):
        raise ValueError(f"--under must be a model drafter bigger than {drafter!r}: one of "
                         f"{[m for m in models if names.index(m) < names.index(drafter)]}, got {args.under!r}")
    _check_range(args.other_k, "--other-k", 1, 256)
    setting = adaptive.Setting(drafter, args.reviews, args.under, args.other_k)
    ks = _int_list(args.sd_k_sweep, "--sd-k-sweep")
    specdec_hs = _float_list(args.thresholds, "--thresholds")
    # The confidence rule reads the drafter's distribution, which a reviewing tier does not sample from.
    confidence_hs = [] if args.reviews else _float_list(args.confidence, "--confidence")
    table = adaptive.methods(drafter, ks, args.max_k, args.head, specdec_hs, confidence_hs)
    engine = Engine(config.cascade)
    prompts = [engine.encode(t) for t in read_prompts(args.prompts)]
    command = shlex.join(["cascade-service", "bench", "--adaptive", "--config", args.config, "--prompts", args.prompts,
                          "--drafter", drafter, *(["--reviews", args.reviews] if args.reviews else []),
                          *(["--under", args.under] if args.under else []),
                          *(["--other-k", str(args.other_k)] if args.reviews or args.under else []),
                          *(["--head", args.head] if args.head else []),
                          "--sd-k-sweep", args.sd_k_sweep, "--max-k", str(args.max_k), "--thresholds",
                          args.thresholds, *([] if args.reviews else ["--confidence", args.confidence]),
                          "--max-new-tokens",
                          str(args.max_new_tokens), "--repeats", str(args.repeats), "--out", args.out])
    adaptive.run(engine, setting, prompts, table, args.max_new_tokens, args.repeats, Path(args.out), command)
    return 0


def _float_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if any(not 0 < v < 1 for v in values):
        raise ValueError(f"{flag}: every threshold must be in (0, 1), got {text!r}")
    return values


def _int_list(text: str, flag: str, hi: int = 256) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag} is empty")
    for v in values:
        _check_range(v, flag, 1, hi)
    return list(dict.fromkeys(values))


def _check_range(value: int, flag: str, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{flag} must be in [{lo}, {hi}], got {value}")


def _command(args: argparse.Namespace) -> str:
    argv = ["cascade-service", "bench", "--config", args.config, "--prompts", args.prompts,
            "--methods", args.methods, "--max-new-tokens", str(args.max_new_tokens),
            "--repeats", str(args.repeats), "--sd-k-sweep", args.sd_k_sweep,
            *(flag for tuned in args.tuned for flag in ("--tuned", tuned)), "--out", args.out]
    return shlex.join(argv)


def _config_summary(path: str, cascade) -> dict:
    return {
        "path": str(path),
        "target": {"name": cascade.target.name, "path": cascade.target.path, "dtype": cascade.target.dtype,
                   "device": cascade.target.device},
        "drafters": [{"name": d.name, "path": getattr(d, "path", None)} for d in cascade.drafters],
        "k_matrix": cascade.schedule.to_lists(),
        "leniency": cascade.leniency,
    }


def _machine() -> dict:
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": metadata.version("transformers"),
    }


def _check_temperature(value: float) -> None:
    try:
        check_temperature(value)  # the request's own rule (core.request)
    except ValueError as exc:
        raise ValueError(f"--{exc}") from None
