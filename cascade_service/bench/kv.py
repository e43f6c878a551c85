"""What a batched pass costs with each KV storage: a pool read in place against caches packed per pass.

    cascade-service bench kv [--config configs/demo.yaml] [--rows 1,4,16,64] [--context 64,256]

For every model tier of the config, loads it once per storage (`kv: pool`, `kv: dynamic`,
models.kvpool) and prints the median seconds of one pass that feeds one token to each of R requests
with C cached positions (`models.hf.pass_time_s`), the two side by side with their ratio, and the
pool's size afterwards. Throughput under concurrent clients is `cascade-service bench load`, run once
per storage (docs/benchmarks.md "KV storage").
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..config import ModelTierConfig, load_config
from ..engine.core import EngineCore
from ..models.hf import pass_time_s
from . import tools


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--rows", default="1,4,16,64", help="requests per pass")
    parser.add_argument("--context", default="64,256", help="cached positions per request")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the demo's serving runs 1)")
    parser.add_argument("--tokens", type=int, default=1, help="new tokens per row (a prompt's or a turn's prefill)")


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    cascade = load_config(args.config).cascade
    rows, contexts = _ints(args.rows), _ints(args.context)
    core = EngineCore()
    print(f"ms per pass, {args.tokens} new token(s) per row (median of {args.repeats}); dynamic / pool = speedup")
    for tier in [t for t in cascade.tiers if isinstance(t, ModelTierConfig) and not t.remote]:
        models = {kv: core.model(tier, kv=kv) for kv in ("dynamic", "pool")}
        for context in contexts:
            times = {
                kv: [pass_time_s(m, r, context, args.repeats, args.tokens) for r in rows] for kv, m in models.items()
            }
            print(f"\n{tier.name} ({tier.backend}), {context} cached positions")
            print(f"{'rows':>6} {'dynamic':>10} {'pool':>10} {'speedup':>8} {'pool x1 row':>12}")
            for i, r in enumerate(rows):
                dyn, pool = times["dynamic"][i], times["pool"][i]
                alone = pool / times["pool"][0]
                print(f"{r:>6} {dyn * 1e3:>10.3f} {pool * 1e3:>10.3f} {dyn / pool:>7.2f}x {alone:>11.2f}x")
        print(f"pool of {tier.name}: {models['pool'].kv_pool.nbytes / 2**20:.1f} MiB after the largest pass")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.bench.kv`: the same as `cascade-service bench kv`."""
    return tools.main("kv", argv, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
