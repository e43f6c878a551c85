"""CUDA graphs of a model's fixed-shape passes (models.staticpass): captured per bucket, kept in a bounded
table, recaptured when the pool's tensors move, dropped one bucket at a time on a failure; how a model
tier's `graphs:` setting picks its runner (`GRAPH_MODES`), and its first captures before it serves
(`start_graphs`).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .kvpool import KVPool
from .poolhold import CaptureFailed, reserve_layers, serving_blocks
from .staticpass import (
    ROW_BUCKETS,
    TOKEN_BUCKETS,
    WARM_ROWS,
    WIDTH_STEP,
    EagerPasses,
    Feed,
    StaticInputs,
    StaticRunner,
    fed_ids,
    padding_inputs,
    pool_identity,
    static_forward,
)

log = logging.getLogger(__name__)


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
            entry = self._graph(inputs)
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


def start_graphs(model: Any, max_batch: int) -> None:
    """Before `model` serves (on the engine loop's thread: engine.core): its pool's tensors made for
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
