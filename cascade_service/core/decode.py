"""The decode loop: ask the target's system for blocks until EOS or the token budget."""

from __future__ import annotations

import time
from typing import Iterator, Sequence

from .stats import CascadeStats
from .types import Context, Drafter


def decode(
    system: Drafter,
    prompt: Sequence[int],
    max_new_tokens: int,
    eos_ids: frozenset[int],
    stats: CascadeStats,
) -> Iterator[list[int]]:
    """Yield the newly committed tokens after each target round.

    Output stops after the first EOS (which is emitted, as `generate()` does) or at max_new_tokens.
    """
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    start = time.perf_counter()
    tokens = list(prompt)
    produced = 0
    while produced < max_new_tokens:
        remaining = max_new_tokens - produced
        new = system.draft(Context(tokens, len(tokens)), remaining, remaining).tokens[:remaining]
        eos_at = next((i for i, t in enumerate(new) if t in eos_ids), None)
        if eos_at is not None:
            new = new[: eos_at + 1]
        tokens = tokens + new  # a new list: scorers may still hold the old one
        produced += len(new)
        stats.generated = produced
        stats.wall_s = time.perf_counter() - start
        yield new
        if eos_at is not None:
            break
