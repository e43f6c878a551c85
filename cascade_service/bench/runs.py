"""`cascade-service bench` modes other than the methods table (`bench lossy`, `load`, `idle`, `adaptive`),
and the helpers every mode shares: argument lists, ranges, the command line and the machine it ran on."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
from importlib import metadata
from pathlib import Path

from ..core.request import check_temperature


def run_lossy(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..inprocess import InProcess
    from ..prompts import read_prompts
    from . import lossy

    check_range(args.max_new_tokens, "--max-new-tokens", 1, 1_000_000)
    args.temperature = 1.0 if args.temperature is None else args.temperature
    check_temperature_arg(args.temperature)
    rules = [r for r in (args.rules or ",".join(lossy.GRIDS)).split(",") if r]
    unknown = [r for r in rules if r not in lossy.GRIDS]
    if unknown:
        raise ValueError(f"--rules: unknown rule {unknown[0]!r} (known: {', '.join(lossy.GRIDS)})")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    engine = InProcess(load_config(args.config).cascade)
    prompts = [engine.encode(t) for t in read_prompts(args.prompts)]
    command = shlex.join(
        [
            "cascade-service",
            "bench",
            "lossy",
            "--config",
            args.config,
            "--prompts",
            args.prompts,
            "--rules",
            ",".join(rules),
            "--temperature",
            str(args.temperature),
            "--seeds",
            args.seeds,
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--out",
            args.out,
        ]
    )
    lossy.run(engine, prompts, rules, args.max_new_tokens, args.temperature, seeds, Path(args.out), command)
    return 0


def run_load(args: argparse.Namespace) -> int:
    from ..prompts import read_prompts
    from . import load

    if bool(args.target) == bool(args.config):
        raise ValueError(
            "bench load needs either --target HOST:PORT of a running service or --config PATH "
            "(then it starts the cascade and plain decoding itself and compares them)"
        )
    concurrencies = int_list(args.concurrency, "--concurrency")
    if not 0 < args.duration <= 3600:
        raise ValueError(f"--duration must be in (0, 3600] seconds, got {args.duration}")
    check_range(args.max_new_tokens, "--max-new-tokens", 1, 4096)
    check_range(args.blocks, "--blocks", 1, 100)
    if args.temperature is not None:
        check_temperature_arg(args.temperature)
    prompts = read_prompts(args.prompts) if args.prompts else list(load.DEFAULT_PROMPTS)
    source = ["--config", args.config] if args.config else ["--target", args.target]
    command = shlex.join(
        [
            "cascade-service",
            "bench",
            "load",
            *source,
            "--concurrency",
            args.concurrency,
            "--duration",
            str(args.duration),
            "--max-new-tokens",
            str(args.max_new_tokens),
            *(["--prompts", args.prompts] if args.prompts else []),
            *(["--temperature", str(args.temperature)] if args.temperature is not None else []),
            *(["--from-start"] if args.from_start else []),
            "--out",
            args.out,
        ]
    )
    if args.config and args.protocols:
        from .protocols import PROTOCOLS, run_protocols

        if sorted(args.protocols.split(",")) != sorted(PROTOCOLS):
            raise ValueError(f"--protocols: give {','.join(PROTOCOLS)} (both, side by side)")
        command += " --protocols " + args.protocols
        run_protocols(args.config, concurrencies, args.duration, prompts, args.max_new_tokens, Path(args.out), command)
        return 0
    if args.config:
        from ..config import load_config

        load_config(args.config)  # a bad config fails here, not in the server processes
        modes = [m for m in args.modes.split(",") if m]
        unknown = [m for m in modes if m not in load.MODES]
        if unknown or not modes:
            raise ValueError(f"--modes: expected some of {', '.join(load.MODES)}, got {args.modes!r}")
        load.run_modes(
            args.config,
            concurrencies,
            args.duration,
            prompts,
            args.max_new_tokens,
            Path(args.out),
            command
            + (f" --modes {args.modes}" if args.modes != "default,plain" else "")
            + (f" --blocks {args.blocks}" if args.blocks != 1 else ""),
            modes=modes,
            temperature=args.temperature,
            blocks=args.blocks,
            ramp=not args.from_start,
        )
        return 0
    if ":" not in args.target:
        raise ValueError("--target: expected HOST:PORT")
    host = args.target.rsplit(":", 1)[0].strip("[]")
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"--target: load tests run on loopback only, got {host!r}")
    load.run(
        args.target,
        concurrencies,
        args.duration,
        prompts,
        args.max_new_tokens,
        Path(args.out),
        command,
        api_key=args.api_key,
        temperature=args.temperature,
        ramp=not args.from_start,
    )
    return 0


def run_idle(args: argparse.Namespace) -> int:
    from . import idle, load

    if bool(args.target) == bool(args.config):
        raise ValueError("bench idle needs either --target HOST:PORT of a running service or --config PATH")
    levels = int_list(args.levels, "--levels", hi=10_000)
    check_range(args.requests, "--requests", 1, 10_000)
    check_range(args.workers, "--workers", 1, 1024)
    check_range(args.max_new_tokens, "--max-new-tokens", 1, 4096)
    prompt = load.DEFAULT_PROMPTS[0]
    source = ["--config", args.config, "--workers", str(args.workers)] if args.config else ["--target", args.target]
    command = shlex.join(
        [
            "cascade-service",
            "bench",
            "idle",
            *source,
            "--levels",
            args.levels,
            "--requests",
            str(args.requests),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--out",
            args.out,
        ]
    )
    if args.config:
        idle.run_standalone(
            args.config, levels, args.requests, prompt, args.max_new_tokens, Path(args.out), command, args.workers
        )
        return 0
    host = args.target.rsplit(":", 1)[0].strip("[]")
    if ":" not in args.target or host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"--target: expected a loopback HOST:PORT, got {args.target!r}")
    idle.run(
        args.target, levels, args.requests, prompt, args.max_new_tokens, Path(args.out), command, api_key=args.api_key
    )
    return 0


def run_adaptive(args: argparse.Namespace) -> int:
    from ..config import MaGConfig, load_config
    from ..inprocess import InProcess
    from ..prompts import read_prompts
    from . import adaptive

    check_range(args.max_new_tokens, "--max-new-tokens", 1, 1_000_000)
    check_range(args.repeats, "--repeats", 1, 1000)
    check_range(args.max_k, "--max-k", 1, 256)
    config = load_config(args.config)
    models = [d.name for d in config.cascade.drafters if not isinstance(d, MaGConfig)]
    drafter = args.drafter or (models[-1] if models else None)
    if drafter not in models:
        raise ValueError(f"--drafter must be one of the config's model drafters {models}, got {drafter!r}")
    names = [d.name for d in config.cascade.drafters]
    if args.reviews is not None and args.under is not None:
        raise ValueError("--reviews and --under are two settings: pick one")
    if args.reviews is not None and (args.reviews not in names or names.index(args.reviews) <= names.index(drafter)):
        raise ValueError(
            f"--reviews must be a drafter smaller than {drafter!r}: one of "
            f"{names[names.index(drafter) + 1 :]}, got {args.reviews!r}"
        )
    if args.under is not None and (args.under not in models or names.index(args.under) >= names.index(drafter)):
        raise ValueError(
            f"--under must be a model drafter bigger than {drafter!r}: one of "
            f"{[m for m in models if names.index(m) < names.index(drafter)]}, got {args.under!r}"
        )
    check_range(args.other_k, "--other-k", 1, 256)
    setting = adaptive.Setting(drafter, args.reviews, args.under, args.other_k)
    ks = int_list(args.sd_k_sweep, "--sd-k-sweep")
    specdec_hs = float_list(args.thresholds, "--thresholds")
    # The confidence rule reads the drafter's distribution, which a reviewing tier does not sample from.
    confidence_hs = [] if args.reviews else float_list(args.confidence, "--confidence")
    table = adaptive.methods(drafter, ks, args.max_k, args.head, specdec_hs, confidence_hs)
    engine = InProcess(config.cascade, tier_client=config.serving.tier_client)
    prompts = [engine.encode(t) for t in read_prompts(args.prompts)]
    command = shlex.join(
        [
            "cascade-service",
            "bench",
            "adaptive",
            "--config",
            args.config,
            "--prompts",
            args.prompts,
            "--drafter",
            drafter,
            *(["--reviews", args.reviews] if args.reviews else []),
            *(["--under", args.under] if args.under else []),
            *(["--other-k", str(args.other_k)] if args.reviews or args.under else []),
            *(["--head", args.head] if args.head else []),
            "--sd-k-sweep",
            args.sd_k_sweep,
            "--max-k",
            str(args.max_k),
            "--thresholds",
            args.thresholds,
            *([] if args.reviews else ["--confidence", args.confidence]),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--repeats",
            str(args.repeats),
            "--out",
            args.out,
        ]
    )
    adaptive.run(engine, setting, prompts, table, args.max_new_tokens, args.repeats, Path(args.out), command)
    return 0


def float_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if any(not 0 < v < 1 for v in values):
        raise ValueError(f"{flag}: every threshold must be in (0, 1), got {text!r}")
    return values


def int_list(text: str, flag: str, hi: int = 256) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag} is empty")
    for v in values:
        check_range(v, flag, 1, hi)
    return list(dict.fromkeys(values))


def check_range(value: int, flag: str, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{flag} must be in [{lo}, {hi}], got {value}")


def command_line(args: argparse.Namespace) -> str:
    argv = [
        "cascade-service",
        "bench",
        "methods",
        "--config",
        args.config,
        "--prompts",
        args.prompts,
        "--methods",
        args.methods,
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--repeats",
        str(args.repeats),
        "--sd-k-sweep",
        args.sd_k_sweep,
        *(flag for tuned in args.tuned for flag in ("--tuned", tuned)),
        *(["--temperature", str(args.temperature)] if args.temperature else []),
        "--out",
        args.out,
    ]
    return shlex.join(argv)


def config_summary(path: str, cascade) -> dict:
    return {
        "path": str(path),
        "target": {
            "name": cascade.target.name,
            "path": cascade.target.path,
            "dtype": cascade.target.dtype,
            "device": cascade.target.device,
        },
        "drafters": [{"name": d.name, "path": getattr(d, "path", None)} for d in cascade.drafters],
        "k_matrix": cascade.schedule.to_lists(),
        "leniency": cascade.leniency,
    }


def machine() -> dict:
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


def check_temperature_arg(value: float) -> None:
    try:
        check_temperature(value)  # the request's own rule (core.request)
    except ValueError as exc:
        raise ValueError(f"--{exc}") from None
