"""One request's forward pass as the engine hands it to a model runner (engine.scheduler queues it,
models.batching runs a batch of them), and how long a prompt's chunks are.

Here, below both, because the engine's loop and scheduler must stay light: they are imported by every
front end (the edge, Ray's proxy, a tier server's gRPC side), which must not load torch and
transformers for them (the `models` package does, on import).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Tokens per pass of a long prompt's prefill while other requests decode (engine.scheduler.ModelQueue):
# between two chunks they get a pass, so a chunk's pass must cost well under theirs. Measured with
# bench.long_request on the demo zoo's large model (CPU, 16 short requests beside a 3,500-token
# prompt, docs/benchmarks.md): with 16 the short ones took 1.5-1.6x their time alone during the
# prefill, with 32 1.8-2.1x, 64 2.6x, unchunked 3.7x.
PREFILL_CHUNK = 16
# On a GPU a pass of 16 tokens costs about what one of 256 does (its fixed part): larger chunks cost
# the others nothing more and the long prompt far less. Not measured: no GPU was available.
PREFILL_CHUNK_CUDA = 256


@dataclass
class Pass:
    """One request's forward pass: the tokens it feeds, its cache, how many rows of logits it keeps,
    whether it wants the hidden states too; `task`: the engine loop's task waiting for it (engine.loop).
    `chain` > 1: a greedy draft of that many tokens chained on the device after `fed` (models.chain),
    whose result is (tokens, their probabilities) instead of logits."""

    fed: list[int]
    cache: Any  # a KV cache (Cache)
    keep: int
    with_hidden: bool
    task: Any = None
    chain: int = 1
