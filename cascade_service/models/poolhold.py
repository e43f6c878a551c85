"""A fixed-shape pass's hold on a model's KV pool (models.staticpass, models.chain): the blocks it takes
for its rows before it runs, every layer's tensors holding them, and the caches as they were if it fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from .kvpool import PagedCache
from .kvsize import kv_shape

T = TypeVar("T")


class CaptureFailed(RuntimeError):
    """A pass could not be captured or replayed: the model runs every pass eagerly from then on."""


@contextlib.contextmanager
def holding(model: Any, caches: Sequence[PagedCache], more: Sequence[int]) -> Iterator[list[int]]:
    """A fixed-shape pass's hold on the pool (its lock): blocks taken for `more[i]` new positions of
    each cache (`take_blocks`), their lengths before yielded; after the pass each cache holds exactly
    its new positions, after a failure what it held before."""
    pool = model.kv_pool
    with pool.lock:
        starts = take_blocks(model, caches, more)
        try:
            yield starts
        except BaseException:
            for cache, start in zip(caches, starts):
                pool.truncate(cache, start)
            raise
        for cache, start, n in zip(caches, starts, more):
            cache.length = start + n
            pool.truncate(cache, cache.length)


def replayed(run: Callable[..., T], *args: Any) -> T:
    """`run(*args)`, a runner's pass: whatever it raises is a CaptureFailed (the model then drops its
    runner: `drop_runner`)."""
    try:
        return run(*args)
    except Exception as exc:
        raise CaptureFailed(str(exc)) from exc


def take_blocks(model: Any, caches: Sequence[PagedCache], more: Sequence[int]) -> list[int]:
    """Under the pool's lock, before a fixed-shape pass: each cache given blocks for `more[i]` positions
    past its length (a shared last block made its own first), marked used now, and every layer's
    tensors holding them. Returns the lengths before, which a failed pass cuts the caches back to."""
    pool = model.kv_pool
    starts = [cache.length for cache in caches]
    now = next(pool.clock)
    try:
        for cache, n in zip(caches, more):
            pool.own_tail(cache, caches)
            pool.extend(cache, cache.length + n, caches)
            cache.used = now
        reserve_layers(model)
    except BaseException:
        for cache, start in zip(caches, starts):
            pool.truncate(cache, start)
        raise
    return starts


def reserve_layers(model: Any) -> None:
    """Every layer of `model`'s pool has its tensors, holding every block handed out (a capture needs
    their addresses, a pass their room)."""
    layers, kv_heads, head_dim = kv_shape(model.config)  # models.kvsize's reading of the config
    like = torch.empty(1, kv_heads, 1, head_dim, dtype=model.dtype, device=model.device)
    for layer in range(layers):
        model.kv_pool.reserve(layer, like)
