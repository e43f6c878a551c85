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

How a model runs it is `GRAPH_MODES` (config: a model tier's `graphs:`): captured as CUDA graphs on cuda
(`CapturedPasses`), eager in the same shapes (`EagerPasses`, what the CPU tests drive), or not at all.
torch.cuda.CUDAGraph directly rather than torch.compile's reduce-overhead mode: the pass mutates the
pool in place and the pool's tensors are reallocated when it grows, which reduce-overhead treats as
new inputs (copies or re-records), and compiling at startup takes minutes on a 2-core CI machine.
Neither has been measured against the other on a GPU yet (issue 49): docs/devices.md.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from ..metrics import default_metrics
from .cachearg import cache_kwargs
from .kvpool import BLOCK, NULL, KVPool, PagedCache
from .poolhold import CaptureFailed, holding, replayed, reserve_layers, serving_blocks

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (1, 2, 4, 8, 16)
WIDTH_STEP = 256  # context widths in steps of this many positions (16 blocks)
WARM_ROWS = 4  # row buckets captured before serving (CapturedPasses.warm); larger ones at first use


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


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: StaticInputs  # the buffers the graph reads: each replay copies a pass's inputs into them
    logits: torch.Tensor  # the buffer it writes
    storage: tuple[int, ...]  # the pool it was captured over (pool_identity)


Bucket = tuple[int, int, int]  # (B, S, W): StaticInputs.key
MAX_GRAPHS = 48  # graphs a model keeps: each holds a [B, S, V] logits buffer (268 MB at B*S = 512, V = 128k)
GRAPH_RETRIES = 2  # a bucket whose capture or replay failed more often than this runs eagerly for good


class GraphTable:
    """A runner's captured graphs by bucket: at most `limit`, the least recently replayed dropped first
    (captured again if it comes back); a graph whose pool has moved since its capture captured again;
    a bucket that failed more than `retries` times refused (its passes run eagerly), the others kept."""

    def __init__(
        self,
        capture: Callable[[StaticInputs, tuple[int, ...]], _Graph],
        limit: int = MAX_GRAPHS,
        retries: int = GRAPH_RETRIES,
    ):
        self.capture, self.limit, self.retries = capture, limit, retries
        self.graphs: OrderedDict[Bucket, _Graph] = OrderedDict()
        self.failures: Counter[Bucket] = Counter()
        self.evictions = 0

    def get(self, inputs: StaticInputs, storage: tuple[int, ...]) -> _Graph:
        key = inputs.key
        entry = self.graphs.get(key)
        if entry is None or entry.storage != storage:
            self.graphs.pop(key, None)  # a stale graph's memory goes before the new capture takes more
            entry = self.graphs[key] = self.capture(inputs, storage)
        self.graphs.move_to_end(key)
        while len(self.graphs) > self.limit:
            self.graphs.popitem(last=False)
            self.evictions += 1
        return entry

    def refused(self, key: Bucket) -> bool:
        return self.failures[key] > self.retries

    def failed(self, key: Bucket) -> None:
        """The bucket's capture or replay raised: its graph is dropped (the next pass captures it again,
        unless it is now refused)."""
        self.graphs.pop(key, None)
        self.failures[key] += 1


class CapturedPasses:
    """`static_forward` of one model on cuda as CUDA graphs, one per bucket (B, S, W): the first width's
    captured at startup (`warm`, on the engine loop's thread, which replays them), others at first use,
    and again once the pool's tensors have moved (a graph holds their addresses; the pool is sized
    before the warm capture so that this is rare: `start_graphs`). The graphs share one memory pool:
    they replay one at a time on one stream, and each replay's logits are copied out before the next.
    A failure (a transient out-of-memory included) drops that bucket's graph, not the others
    (`GraphTable`)."""

    def __init__(self, module: Any, pool: KVPool, dtype: torch.dtype):
        self.module, self.pool, self.dtype = module, pool, dtype
        self.table = GraphTable(self._capture)
        self.captures = self.runs = 0
        self._memory = torch.cuda.graph_pool_handle()

    @property
    def graphs(self) -> OrderedDict[Bucket, _Graph]:
        return self.table.graphs

    def run(self, inputs: StaticInputs, feed: Feed | None = None) -> torch.Tensor:
        """[B, S, V] logits of the pass over `inputs` (a copy: the graph's buffer is reused)."""
        key = inputs.key
        if self.table.refused(key):
            raise CaptureFailed(f"bucket {key} refused after {self.table.failures[key]} failures", key, fresh=False)
        try:
            entry = self.table.get(inputs, pool_identity(self.pool))
            for mine, given in zip(entry.inputs.tensors(), inputs.tensors()):
                mine.copy_(given, non_blocking=True)
            if feed is not None:  # on the device, after the copy: no host read of the fed ids
                entry.inputs.ids.copy_(fed_ids(entry.inputs.ids, feed))
            entry.graph.replay()
            logits = entry.logits.clone()
        except Exception as exc:
            self.table.failed(key)
            raise CaptureFailed(f"bucket {key}: {exc}", key) from exc
        self.runs += 1
        return logits

    def warm(self, max_rows: int) -> None:
        """Capture the row buckets up to WARM_ROWS by every token bucket at the first width: a pass of
        padding each, which writes only the NULL block. Largest first, so later captures reuse the
        shared pool's memory. Bigger batches are captured at their first use: they come under load,
        where one capture's milliseconds are shared by many requests."""
        device = self.pool.keys[0].device
        for rows in sorted((b for b in ROW_BUCKETS if b <= min(max(1, max_rows), WARM_ROWS)), reverse=True):
            for steps in sorted(TOKEN_BUCKETS, reverse=True):
                self._graph(padding_inputs(rows, steps, WIDTH_STEP, device))

    def _graph(self, inputs: StaticInputs) -> _Graph:
        return self.table.get(inputs, pool_identity(self.pool))

    def _capture(self, inputs: StaticInputs, storage: tuple[int, ...]) -> _Graph:
        # torch's recipe: a warm-up pass on a side stream first (lazy inits and workspaces happen
        # outside the capture). The captured buffers then get each pass's inputs copied in by `run`.
        static = StaticInputs(*(t.clone() for t in inputs.tensors()))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            static_forward(self.module, self.pool, static, self.dtype)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._memory):
            logits = static_forward(self.module, self.pool, static, self.dtype)
        self.captures += 1
        return _Graph(graph, static, logits, storage)


# graphs: how a model tier runs its fixed-shape passes (config: a model tier's `graphs:`), by device
# type. Each entry: (module, pool, dtype, device) -> a runner, or None (every pass as before).
GRAPH_MODES: dict[str, Callable[[Any, KVPool, torch.dtype, torch.device], StaticRunner | None]] = {
    # CUDA graphs on cuda; elsewhere none: on a CPU the padded shapes cost more than launches do.
    "auto": lambda module, pool, dtype, device: CapturedPasses(module, pool, dtype) if device.type == "cuda" else None,
    "off": lambda module, pool, dtype, device: None,
    # The fixed-shape pass without capture, on any device: what the graphs replay, to compare against.
    "eager": lambda module, pool, dtype, device: EagerPasses(module, pool, dtype),
}


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
    a captured bucket's failure dropped that bucket's graph only (`GraphTable`), anything else turns
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


def start_graphs(model: Any, max_batch: int) -> None:
    """Before `model` serves (on the engine loop's thread: runtime.core): its pool's tensors made for
    every layer, and its runner's first buckets captured (CUDA graphs: a capture takes milliseconds a
    bucket, not to be paid by a request). Under captured graphs the pool is made first at what
    `max_batch` requests at the model's longest context hold, within its KV budget (a share of the
    device's memory unless the config sets `kv_budget_mb`: models.kvsize), and grows by doubling up to
    that budget: each growth moves its tensors, and every graph is then captured again at its next use,
    so a pool sized up front seldom or never grows."""
    runner = getattr(model, "static", None)
    if runner is None:
        return
    pool = model.kv_pool
    with pool.lock:
        captured = isinstance(runner, CapturedPasses)
        reserve_layers(model, serving_blocks(model, max_batch) if captured else 0)
        if captured:
            pool.growth = max(pool.growth, 2.0)
            log.info(
                "%s: KV pool made at %d blocks (%.0f MB) before the first capture",
                model.name,
                pool.capacity,
                pool.nbytes / 2**20,
            )
        try:
            runner.warm(max_batch)
        except Exception as exc:
            log.warning("%s: fixed-shape passes off, every pass eager: capture failed: %s", model.name, exc)
            model.static = None
