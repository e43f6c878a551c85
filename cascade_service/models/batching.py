"""A model's side of a batched pass: how one forward pass reads several requests' KV caches (in place
over their pool blocks, or packed from their own caches). Which requests make a batch, and when, is
the engine's (engine.scheduler, engine.loop), which imports this module and is never imported by it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

import torch

from cascade_service.core.passes import PREFILL_CHUNK, PREFILL_CHUNK_CUDA, Pass
from cascade_service.models.chain import chain_eagerly, chained
from cascade_service.models.kvpool import KVCache, PagedCache
from cascade_service.models.packed import forward_packed
from cascade_service.models.poolpass import forward_rows
from cascade_service.models.staticpass import static_rows

T = TypeVar("T")


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
