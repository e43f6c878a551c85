"""A fixed-shape pass's hold on a model's KV pool (models.staticpass, models.chain): the blocks it takes
for its rows before it runs, every layer's tensors holding them, and the caches as they were if it fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from .kvpool import BLOCK, PagedCache
from .kvsize import kv_shape

T = TypeVar("T")


class CaptureFailed(RuntimeError):
    """A fixed-shape pass could not be captured or replayed (models.staticpass.drop_runner): `key`, the
    bucket whose graph failed (None: the runner as a whole); `fresh`, False where the bucket had
    already been refused and nothing new went wrong."""

    def __init__(self, message: str, key: tuple[int, ...] | None = None, fresh: bool = True):
        super().__init__(message)
        self.key, self.fresh = key, fresh


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
    except CaptureFailed:
        raise
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


def reserve_layers(model: Any, at_least: int = 0) -> None:
    """Every layer of `model`'s pool has its tensors, holding every block handed out and `at_least`
    blocks (capped by the pool's budget): a capture needs their addresses, a pass their room."""
    layers, kv_heads, head_dim = kv_shape(model.config)  # models.kvsize's reading of the config
    like = torch.empty(1, kv_heads, 1, head_dim, dtype=model.dtype, device=model.device)
    for layer in range(layers):
        model.kv_pool.reserve(layer, like, at_least)


def serving_blocks(model: Any, rows: int) -> int:
    """The blocks `rows` requests at the model's longest context hold (NULL included): what a pool under
    captured graphs is made with before the first capture (models.graphs.start_graphs), so that
    its tensors, whose addresses the graphs hold, seldom move."""
    positions = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    return rows * -(-positions // BLOCK) + 1
