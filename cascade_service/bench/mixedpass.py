"""How much a verification row adds to a shared pass: one model's pool passes timed side by side.

    cascade-service bench mixedpass MODEL_DIR [--context 500] [--rows 16] [--verifying 1] [--k 6] [--repeats 5]

Four ways to run `rows` requests' next step when `verifying` of them verify k drafts each (k + 1 tokens)
and the others decode one token each, over caches of `context` positions: `plain` (every row one
token: the pass without the verifications), `ragged-mixed` (one pass, the model's ragged pass:
models.poolpass), `padded-mixed` (one pass, every row padded to k + 1 tokens) and `split` (the
one-token rows, then the verifications). Prints the median seconds of each (the first repeat is a
warm-up)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from ..config import ModelTierConfig
from ..engine.core import EngineCore
from ..models.batching import Pass, forward_batch
from ..models.hf import HFModel
from ..models.kvpool import PagedCache
from ..models.poolpass import forward_rows
from . import tools

WAYS = ("plain", "ragged-mixed", "padded-mixed", "split")


def measure(model: HFModel, context: int, rows: int, k: int, repeats: int, verifying: int = 1) -> dict[str, float]:
    """Median seconds of each way (WAYS) over `repeats` runs after one warm-up."""
    caches = [model.new_cache() for _ in range(rows)]
    assert all(isinstance(cache, PagedCache) for cache in caches), "a pool model (kv: pool)"
    paged: list[PagedCache] = caches  # type: ignore[assignment]  # checked just above
    with torch.inference_mode():
        for i, cache in enumerate(caches):
            prompt = [(i * 7 + j * 13) % (model.vocab_size - 10) + 10 for j in range(context)]
            for start in range(0, context, 256):
                forward_batch(model, [Pass(prompt[start : start + 256], cache, 1, False)])

    def batches(way: str) -> list[list[Pass]]:
        ones = [Pass([5], cache, 1, False) for cache in caches[verifying:]]
        verify = [Pass(list(range(11, 12 + k)), cache, k + 1, False) for cache in caches[:verifying]]
        return {
            "plain": [[Pass([5], cache, 1, False) for cache in caches]],
            "ragged-mixed": [[*verify, *ones]],
            "padded-mixed": [[*verify, *ones]],
            "split": [ones, verify] if ones else [verify],
        }[way]

    def timed(way: str) -> float:
        lengths = [cache.length for cache in paged]
        try:
            began = time.perf_counter()
            with torch.inference_mode():
                for batch in batches(way):
                    if way == "padded-mixed":
                        forward_rows(model, batch, allow_ragged=False)
                    else:
                        forward_batch(model, batch)
            return time.perf_counter() - began
        finally:
            for cache, length in zip(paged, lengths):
                model.kv_pool.truncate(cache, length)

    return {way: statistics.median([timed(way) for _ in range(repeats + 1)][1:]) for way in WAYS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model folder (from_pretrained), e.g. a fetched family's 1.5b")
    parser.add_argument("--context", type=int, default=500, help="cached positions per row")
    parser.add_argument("--rows", type=int, default=16, help="rows in the pass, the verifying one included")
    parser.add_argument("--verifying", type=int, default=1, help="rows that verify (the rest decode one token)")
    parser.add_argument("--k", type=int, default=6, help="drafts each verifying row checks (k + 1 tokens)")
    parser.add_argument("--repeats", type=int, default=5)


def run(args: argparse.Namespace) -> int:
    # Loaded by an engine core and timed on its loop's thread, as a server runs its passes (the
    # loop's OpenMP team; another thread's would be a second team on the same cores).
    core = EngineCore()
    try:
        model = core.model(ModelTierConfig("model", args.model, kv="pool", graphs="off"))
        if not 1 <= args.verifying <= args.rows:
            raise ValueError(f"--verifying must be 1 to --rows ({args.rows}), got {args.verifying}")
        got = core.loop.run(measure, model, args.context, args.rows, args.k, args.repeats, args.verifying)
    finally:
        core.close()
    print(
        f"{args.model}: context {args.context}, {args.rows} rows, {args.verifying} verifying {args.k + 1} tokens: "
        + ", ".join(f"{way} {seconds * 1e3:.1f} ms" for way, seconds in got.items())
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.bench.mixedpass`: the same as `cascade-service bench mixedpass`."""
    return tools.main("mixedpass", argv, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
