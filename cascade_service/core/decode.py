"""The decode loop: ask the target's system for blocks until EOS or the token budget."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from .stats import absorb
from .tier import Tier
from .types import Context

if TYPE_CHECKING:
    from .cascade import RequestState


def decode(system: Tier, prompt: Sequence[int], max_new_tokens: int, state: RequestState) -> Iterator[list[int]]:
    """Yield the newly committed tokens after each target round; each round's cost goes into `state.stats`.

    Output stops after the first EOS (which is emitted, as `generate()` does) or at max_new_tokens.
    """
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    start = time.perf_counter()
    stats, eos_ids = state.stats, state.eos_ids
    tokens = list(prompt)
    produced = 0
    while produced < max_new_tokens:
        remaining = max_new_tokens - produced
        reply = system.draft(state.request(Context(tokens, len(tokens)), remaining, remaining))
        absorb(stats, reply.usage)
        new = reply.draft.tokens[:remaining]
        eos_at = next((i for i, t in enumerate(new) if t in eos_ids), None)
        if eos_at is not None:
            new = new[: eos_at + 1]
        tokens = tokens + new  # a new list: scorers may still hold the old one
        produced += len(new)
        del stats.logprobs[produced:]  # a round's logprobs past the budget or an EOS (when asked for)
        stats.generated = produced
        stats.wall_s = time.perf_counter() - start
        yield new
        if eos_at is not None:
            break
