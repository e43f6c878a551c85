"""`cascade-service tier`: one tier (a model, MaG, or a model with its sub-cascade) as a gRPC server."""

from __future__ import annotations

import argparse
import threading

from ..config import MAG, SUFFIX, Config, ConfigError, MaGConfig, ModelTierConfig, ServingConfig, load_config
from .parser import UsageError
from .serve import exit_now, stop_on_signals, stopping, wait_for_stop


def add_tier_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tier",
        help="serve tiers of a config as a gRPC tier server (cascade.tier.v1.Tier) that a coordinator reaches "
        "by address",
    )
    p.add_argument("--config", required=True, help="the cascade's config; the served tiers' path (weights) is read")
    p.add_argument(
        "--tier",
        action="append",
        required=True,
        metavar="NAME",
        help="a tier to serve (repeat: a model with the tiers below it, which then runs its sub-cascade in "
        "one call; 'mag' for the Max-Gram drafter)",
    )
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT", help="default: loopback, a free port")
    p.add_argument("--api-keys", default=None, metavar="FILE", help="require one of these keys (as `serve`)")
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="serve TLS with this PEM certificate chain")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="the PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca",
        default=None,
        metavar="FILE",
        help="also require each coordinator's certificate, signed by this CA (mutual TLS)",
    )
    p.add_argument("--workers", type=int, default=64, help="calls at work at once (their passes batch)")
    p.add_argument("--max-queued", type=int, default=256, help="calls waiting beyond them; more: RESOURCE_EXHAUSTED")
    p.add_argument("--max-batch", type=int, default=64, help="rows of one batched forward pass")
    p.set_defaults(run=_run_tier)


def _run_tier(args: argparse.Namespace) -> int:
    from ..core.limits import unpaired
    from ..rpc.auth import TlsFiles, is_loopback, load_api_keys
    from ..tierhost.server import start_tier_server

    host, _, port_text = args.listen.rpartition(":")
    if not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise UsageError(f"--listen must be HOST:PORT with a port in [0, 65535], got {args.listen!r}")
    if error := unpaired(("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        raise UsageError(error)
    if args.tls_client_ca and not args.tls_cert:
        raise UsageError("--tls-client-ca needs --tls-cert and --tls-key")
    if not is_loopback(host) and (args.api_keys is None or args.tls_cert is None):
        raise UsageError(
            f"--listen {args.listen}: a non-loopback address is served only with --api-keys and --tls-cert/--tls-key"
        )
    for flag, value, lo in (("--workers", args.workers, 1), ("--max-queued", args.max_queued, 0)):
        if not lo <= value <= 4096:
            raise UsageError(f"{flag} must be in [{lo}, 4096], got {value}")
    config = load_config(args.config)
    if config.serving.torch_threads:
        import torch

        torch.set_num_threads(config.serving.torch_threads)
    group = tier_group(config, args.tier, max_batch=args.max_batch)
    tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    keys = load_api_keys(args.api_keys) if args.api_keys else None
    stop = threading.Event()
    stop_on_signals(stop)
    server = start_tier_server(group, host, int(port_text), keys, tls, args.workers, args.max_queued)
    if config.serving.freeze_heap:
        from ..engine.heap import freeze_startup_heap

        freeze_startup_heap("tier")
    try:
        hosted = ", ".join(
            f"{n}{' (sub-cascade)' if n in group.systems else ''}" for n in (t.name for t in group.info().tiers)
        )
        print(f"serving cascade.tier.v1.Tier [{hosted}] on {host}:{server.port} (Ctrl-C stops)", flush=True)
        wait_for_stop(stop)
    finally:
        stopping(config.serving.shutdown_grace_s)
        server.stop(config.serving.shutdown_grace_s)
    exit_now(0)  # as `serve` does: not through the interpreter's teardown of torch's and gRPC's objects


def tier_group(config: Config, names: list[str], max_batch: int = 64):  # -> tierhost.group.TierGroup (late: torch)
    """The TierGroup serving `names` of the config: their weights from their `path`, loaded by this
    process's engine core (max_batch rows a pass); a member whose whole sub-cascade is among them runs
    it in one call; MaG with its bigram table where named or needed."""
    from ..engine.core import EngineCore
    from ..models.hf import config_vocab_size

    def models_of(cascade):  # type: ignore[no-untyped-def]
        return [t for t in cascade.tiers if isinstance(t, ModelTierConfig)]

    from ..tierhost.group import TierGroup
    from ..tierhost.subcascade import system_heads

    cascade = config.cascade
    by_name = {t.name: t for t in cascade.tiers}
    unknown = [n for n in names if n not in by_name]
    if unknown or len(set(names)) != len(names):
        raise UsageError(f"--tier: {unknown[0] if unknown else 'a repeated name'}; the config has {', '.join(by_name)}")
    models = [t for n in names if isinstance(t := by_name[n], ModelTierConfig)]
    for tier in models:
        if not tier.path:
            raise ConfigError(f"{tier.name}.path: a tier server loads its weights from a local directory")
    if SUFFIX in names:
        raise ConfigError(f"--tier {SUFFIX}: suffix decoding runs where the coordinator runs, not on a tier server")
    mag = next((d for d in cascade.drafters if d.name == MAG and isinstance(d, MaGConfig)), None)
    model_names = tuple(t.name for t in models)
    # A member runs its sub-cascade here only when every tier of it is named (MaG included): `--tier small`
    # serves small alone, `--tier small --tier mag` small reviewing MaG in one call.
    heads = system_heads(cascade, ServingConfig(groups=(model_names,))) if model_names else {}
    systems = {name: sub for name, sub in heads.items() if set(sub.tiers) <= set(names)}
    serves_mag = any(isinstance(by_name[n], MaGConfig) for n in names)
    mag_vocab = None
    if serves_mag and not models:  # MaG alone: its vocabulary (for checking calls) from any model tier's files
        mag_vocab = next((v for t in models_of(cascade) if t.path and (v := config_vocab_size(t.path))), None)
        if mag_vocab is None:
            raise ConfigError(f"--tier {MAG}: no tier of the config has a local path to read the vocabulary from")
    return TierGroup(
        models,
        mag.bigram if mag else None,
        mag.max_ngram if mag else 16,
        systems=systems,
        mag=serves_mag,
        mag_vocab=mag_vocab,
        core=EngineCore(max_batch, name="tier"),
    )
