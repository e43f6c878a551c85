"""A model's side of a batched pass: how one forward pass reads several requests' KV caches (in place
over their pool blocks, or packed from their own caches). Which requests make a batch, and when, is
the engine's (engine.scheduler, engine.loop), which imports this module and is never imported by it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from cascade_service.models.chain import chain_eagerly, chained
from cascade_service.models.kvpool import KVCache, PagedCache
from cascade_service.models.packed import forward_packed
from cascade_service.models.poolpass import forward_rows
from cascade_service.models.staticpass import static_rows

T = TypeVar("T")

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


class PassQueue(Protocol):
    """Where a model's passes wait for the engine's next batched step (engine.scheduler.ModelQueue is
    one; engine.core.join_loop gives a model its queue). The model hands a pass over and gets its rows back;
    which rows make a batch, and when, is the engine's. Declared here, on the runner's side, so the
    dependency points one way: the engine imports models, never the reverse."""

    def forward(
        self, tokens: Sequence[int], cache: Any, keep: int, with_hidden: bool = False, chain: int = 1
    ) -> Any: ...

    def call(self, fn: Callable[[], T]) -> T: ...

    def wait(self, future: Future) -> Any: ...

    def close(self) -> None: ...


class PassModel(Protocol):
    """What the batcher needs of a model (`models.hf.HFModel` is one). The batcher depends on this,
    never on `models.hf`, so the dependency points one way: hf -> batching."""

    name: str
    device: torch.device
    module: Any

    def forward_now(
        self, tokens: Sequence[int], cache: KVCache | None, keep: int, with_hidden: bool = False
    ) -> Any: ...

    def sync(self) -> None: ...


def default_prefill_chunk(device: torch.device) -> int:
    return PREFILL_CHUNK_CUDA if device.type == "cuda" else PREFILL_CHUNK


def forward_batch(model: PassModel, batch: list[Pass]) -> list[object]:
    """One forward pass for several requests' passes: in place over their pool blocks (models.poolpass),
    or packed from their own caches (models.packed); a lone pass is the model's own `forward_now`.
    Where the model runs fixed-shape passes (models.staticpass: CUDA graphs on cuda) and the batch fits
    a bucket, that pass instead; a batch with a chained draft (Pass.chain) runs as models.chain has it."""
    if any(item.chain > 1 for item in batch):
        done = chained(model, batch)
        return done if done is not None else chain_eagerly(model, batch, forward_batch)
    fixed = static_rows(model, batch)
    if fixed is not None:
        return fixed
    if len(batch) == 1 or getattr(model, "encoder_decoder", False):  # encoder-decoder: one row a pass
        return [model.forward_now(one.fed, one.cache, one.keep, with_hidden=one.with_hidden) for one in batch]
    if isinstance(batch[0].cache, PagedCache):
        return forward_rows(model, batch)
    return forward_packed(model, batch)


def executor(model: PassModel):
    """`model`'s batched passes as the engine runs them (engine.scheduler.ModelQueue, given this by
    engine.core.join_loop)."""

    def execute(batch: list[Pass]) -> list[Any]:
        with torch.inference_mode():
            results = forward_batch(model, batch)
        model.sync()
        return results

    return execute
