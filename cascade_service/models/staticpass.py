"""A model's batched pass over the KV pool in fixed shapes, and those passes captured as CUDA graphs.

On a GPU a small model's step is kernel launches and Python, not arithmetic (the shipped family's
target: 9.15 ms a row on an H200, where its arithmetic is microseconds). Capturing a pass as a CUDA
graph and replaying it removes both, but a graph replays fixed shapes and fixed addresses: nothing in
the pass may depend on the rows' lengths or read a value back to the host. This module is that pass:

- shapes come from buckets: rows B (ROW_BUCKETS), new tokens per row S (TOKEN_BUCKETS: the block sizes
  a schedule uses, k + 1) and context width W (a multiple of WIDTH_STEP); a pass outside them runs as
  before (models.poolpass), and so does a pass that asks for hidden states;
- every index the pass needs is a tensor of those shapes (`StaticInputs`), filled on the host before the
  pass: the ids, their positions, the pool slots the new keys go to and the slots each row reads (its
  blocks in position order, then the NULL block). Key column c of a row is its position c, so the mask
  is made on the device from the positions (no [B, S, W] host tensor to copy). Padding rows and
  tokens write to the NULL block (block 0, which no request owns and every read masks) and read it;
- the model (the target's transformers forward or a lean drafter's: both take a 4D mask, explicit
  positions and a cache object) runs over `FixedSlots`, a cache whose `update` writes with
  `index_copy_` and reads with `index_select` over the pool's flat slots: the same kernels for any rows
  of the same bucket.

How a model runs it is models.graphs `GRAPH_MODES` (config: a model tier's `graphs:`): captured as CUDA
graphs on cuda (models.graphs `CapturedPasses`), eager in the same shapes (`EagerPasses`, what the CPU
tests drive), or not at all.
torch.cuda.CUDAGraph directly rather than torch.compile's reduce-overhead mode: the pass mutates the
pool in place and the pool's tensors are reallocated when it grows, which reduce-overhead treats as
new inputs (copies or re-records), and compiling at startup takes minutes on a 2-core CI machine.
Neither has been measured against the other on a GPU yet (issue 49): docs/devices.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from ..metrics import default_metrics
from .cachearg import cache_kwargs
from .kvpool import BLOCK, NULL, KVPool, PagedCache
from .poolhold import CaptureFailed, holding, replayed

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (1, 2, 4, 8, 16)
WIDTH_STEP = 256  # context widths in steps of this many positions (16 blocks)
WARM_ROWS = 4  # row buckets captured before serving (models.graphs.CapturedPasses.warm); larger ones at first use


def bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds n, or None past the largest."""
    return next((b for b in buckets if b >= n), None)


@dataclass
class StaticInputs:
    """A pass's indices in a bucket's shapes (B rows, S new tokens each, W positions read)."""

    ids: torch.Tensor  # [B, S] long: the new tokens (0 where padding)
    positions: torch.Tensor  # [B, S] long: their positions (0 where padding)
    write: torch.Tensor  # [B * S] long: the flat pool slot each new token's keys go to (NULL's where padding)
    read: torch.Tensor  # [B * W] long: the flat slots each row reads, its positions in order, then NULL's

    @property
    def key(self) -> tuple[int, int, int]:
        """The bucket (B, S, W)."""
        rows, steps = self.ids.shape
        return rows, steps, self.read.shape[0] // rows

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.ids, self.positions, self.write, self.read


def padding_inputs(rows: int, steps: int, width: int, device: torch.device) -> StaticInputs:
    """A pass of padding only, in one bucket: it writes and reads nothing but the NULL block (how a
    bucket is captured before any request needs it)."""
    zeros = torch.zeros((rows, steps), dtype=torch.long, device=device)
    return StaticInputs(
        zeros,
        zeros.clone(),
        torch.full((rows * steps,), NULL * BLOCK, dtype=torch.long, device=device),
        torch.full((rows * width,), NULL * BLOCK, dtype=torch.long, device=device),
    )


def static_inputs(
    caches: Sequence[PagedCache], news: Sequence[Sequence[int]], device: torch.device
) -> StaticInputs | None:
    """The inputs of a pass feeding `news[i]` to `caches[i]` (whose tables already hold blocks for
    them), in bucket shapes; None where the pass fits no bucket."""
    rows = bucket(len(caches), ROW_BUCKETS)
    steps = bucket(max(len(n) for n in news), TOKEN_BUCKETS)
    if rows is None or steps is None:
        return None
    longest = max(c.length + len(n) for c, n in zip(caches, news))
    width = -(-longest // WIDTH_STEP) * WIDTH_STEP
    inputs = padding_inputs(rows, steps, width, torch.device("cpu"))
    write, read = inputs.write.view(rows, steps), inputs.read.view(rows, width)
    offsets = torch.arange(BLOCK)
    for i, (cache, new) in enumerate(zip(caches, news)):
        start, n = cache.length, len(new)
        slots = (torch.tensor(cache.table, dtype=torch.long)[:, None] * BLOCK + offsets).view(-1)[: start + n]
        inputs.ids[i, :n] = torch.tensor(list(new), dtype=torch.long)
        inputs.positions[i, :n] = torch.arange(start, start + n)
        write[i, :n] = slots[start:]
        read[i, : start + n] = slots
    if device.type == "cpu":
        return inputs
    return StaticInputs(*(t.pin_memory().to(device, non_blocking=True) for t in inputs.tensors()))


def static_mask(positions: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [B, 1, S, W]: the query at position p sees key columns 0..p (a row's columns
    are its positions in order). A padding query (position 0) sees column 0 only, so its softmax has a
    key to normalise over: no NaN."""
    hidden = torch.arange(width, device=positions.device)[None, None, :] > positions[:, :, None]
    return torch.zeros(hidden.shape, dtype=dtype, device=positions.device).masked_fill_(hidden, torch.finfo(dtype).min)[
        :, None
    ]


class FixedSlots:
    """The cache a model sees during a fixed-shape pass (duck-typed as transformers' `Cache`, as
    models.poolpass.PoolPass is): `update` stores the new keys at `write` and returns the keys at `read`,
    [B, kv_heads, W, head_dim], whatever the rows' lengths."""

    is_compileable = False  # read by transformers' masking; the 4D mask it is given is used as it is

    def __init__(self, pool: KVPool, inputs: StaticInputs):
        self.pool, self.inputs = pool, inputs
        self.rows, self.steps, self.width = inputs.key

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        heads, dim = key_states.shape[1], key_states.shape[3]
        got = []
        for store, new in ((self.pool.keys, key_states), (self.pool.values, value_states)):
            flat = store[layer_idx].view(-1, heads, dim)
            flat.index_copy_(0, self.inputs.write, new.transpose(1, 2).reshape(-1, heads, dim))
            got.append(flat.index_select(0, self.inputs.read).view(self.rows, self.width, heads, dim).transpose(1, 2))
        return got[0], got[1]

    # Positions and the mask are given explicitly: what transformers would make from these is unused.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: Any, layer_idx: int = 0) -> tuple[int, int]:
        return self.width, 0


@torch.inference_mode()
def static_forward(module: Any, pool: KVPool, inputs: StaticInputs, dtype: torch.dtype) -> torch.Tensor:
    """`module`'s forward over `inputs` (every shape fixed by its bucket): [B, S, V] logits, the new
    keys and values written to the pool. No host read and no shape that depends on the rows' lengths."""
    mask = static_mask(inputs.positions, inputs.key[2], dtype)
    out = module(
        input_ids=inputs.ids,
        attention_mask=mask,
        position_ids=inputs.positions,
        use_cache=True,
        **cache_kwargs(module, FixedSlots(pool, inputs)),
    )
    return out.logits


Feed = tuple[torch.Tensor, torch.Tensor]  # (ids [B], use [B] bool) on the device: StaticRunner.run


def pool_identity(pool: KVPool) -> tuple[int, ...]:
    """What a captured graph's pool must still be for a replay: the same tensors, told apart by the
    pool's generation (bumped at every growth) and capacity as well as their addresses, which a new
    tensor can reuse after `empty_cache()`."""
    return (pool.generation, pool.capacity, *(t.data_ptr() for t in pool.keys + pool.values))


def fed_ids(ids: torch.Tensor, feed: Feed) -> torch.Tensor:
    """`ids` [B, S] with each row's first token replaced by feed's where feed's `use` holds."""
    tokens, use = feed
    first = torch.where(use, tokens, ids[:, 0])
    return torch.cat([first[:, None], ids[:, 1:]], dim=1)


class StaticRunner(Protocol):
    """How a model's fixed-shape passes run: `run` gives a pass's [B, S, V] logits (a tensor the next
    pass does not overwrite). `feed`, where given, is (ids [B], use [B] bool) on the device: rows where
    `use` holds take that id as their first token instead of the one in `inputs` (a chained draft's
    step: models.chain). `runs`: passes run so far; `captures`: graphs captured so far."""

    runs: int
    captures: int

    def run(self, inputs: StaticInputs, feed: Feed | None = None) -> torch.Tensor: ...

    def warm(self, max_rows: int) -> None: ...


class EagerPasses:
    """The fixed-shape pass run eagerly: the same kernels a captured graph replays, on any device."""

    captures = 0

    def __init__(self, module: Any, pool: KVPool, dtype: torch.dtype):
        self.module, self.pool, self.dtype = module, pool, dtype
        self.runs = 0

    def run(self, inputs: StaticInputs, feed: Feed | None = None) -> torch.Tensor:
        self.runs += 1
        if feed is not None:
            inputs = replace(inputs, ids=fed_ids(inputs.ids, feed))
        return static_forward(self.module, self.pool, inputs, self.dtype)

    def warm(self, max_rows: int) -> None:
        pass


def forward_static_rows(model: Any, fed: Sequence[Sequence[int]], caches: Sequence[PagedCache]) -> list[Any] | None:
    """Each row's [len(fed[i]), V] float32 logits from one fixed-shape pass of `model` (an HFModel with
    a `static` runner and a pool), the caches then holding the new tokens; None (nothing done) where
    the pass fits no bucket. A failure leaves the caches as they were."""
    if bucket(len(caches), ROW_BUCKETS) is None or bucket(max(map(len, fed)), TOKEN_BUCKETS) is None:
        return None  # before any block is taken: the eager pass takes them
    with holding(model, caches, [len(new) for new in fed]):
        inputs = static_inputs(caches, fed, model.device)
        assert inputs is not None  # the buckets held it, checked above
        logits = replayed(model.static.run, inputs)
    return [logits[i, : len(new)].float() for i, new in enumerate(fed)]


def fits(model: Any, batch: Sequence[Any]) -> bool:
    """Whether a batcher's passes can run as one fixed-shape pass of `model`: it has a runner, no pass
    asks for hidden states, every cache is a pool's, and the rows and tokens fit the buckets."""
    if getattr(model, "static", None) is None or any(item.with_hidden for item in batch):
        return False
    if not all(isinstance(item.cache, PagedCache) for item in batch):
        return False
    return (
        bucket(len(batch), ROW_BUCKETS) is not None
        and bucket(max(len(i.fed) for i in batch), TOKEN_BUCKETS) is not None
    )


def static_rows(model: Any, batch: Sequence[Any]) -> list[Any] | None:
    """A batcher's passes (fed, cache, keep, with_hidden) as one fixed-shape pass of `model` where it
    has a runner and they fit a bucket: each row's last `keep` [keep, V] float32 logits. None where
    they do not (nothing done): a pass asking for hidden states, caches outside a pool, a shape past
    the buckets. A runner that fails is dropped with a warning and the pass left to the eager path."""
    if not fits(model, batch):
        return None
    try:
        rows = forward_static_rows(model, [item.fed for item in batch], [item.cache for item in batch])
    except CaptureFailed as exc:
        drop_runner(model, exc)
        return None
    if rows is None:
        return None
    return [logits[len(item.fed) - item.keep :] for item, logits in zip(batch, rows)]


def drop_runner(model: Any, failure: CaptureFailed) -> None:
    """After a fixed-shape pass failed (the caches already as they were; the pass then runs eagerly):
    a captured bucket's failure dropped that bucket's graph only (models.graphs.GraphTable), anything else turns
    the model's fixed-shape passes off. Each new failure is logged and counted
    (`cascade_cuda_graph_failures_total`)."""
    if failure.key is None:
        log.warning("%s: fixed-shape passes off, every pass eager from now on: %s", model.name, failure.__cause__)
        model.static = None
    elif failure.fresh:
        log.warning(
            "%s: the graph of bucket %s dropped, this pass eager: %s", model.name, failure.key, failure.__cause__
        )
    if failure.fresh:
        default_metrics().graph_failure(model.name)
