"""The engine core: one per process that serves models, and the only place a model is loaded.

It owns what a process's requests share: the engine loop (engine.loop) where every request's work
and every model's batched passes run, the models (each loaded once, on the loop's thread, batching
from the start; their KV pools are theirs, models.kvpool), the acceptance heads, the statistical
drafters' tables. Every wiring asks it for tiers: the in-process `InProcess` and the standalone server
(inprocess.py, standalone.py), a tier server's `TierGroup` (tierhost.group), the Ray app's coordinator
and tier replicas (serving/). Each of those processes builds one (`EngineCore(...)`); nothing of it is
a process-wide global, so a test may hold several, each with its own loop.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from ..config import ModelTierConfig, StatisticalConfig
from ..core.proposers.mag import BigramTable
from ..metrics import default_metrics
from ..models.acceptance_head import HeadCache
from ..models.batching import default_prefill_chunk, executor
from ..models.graphs import start_graphs
from ..models.hf import HFModel
from ..models.poolpass import ragged
from .leaves import Encode, Leaves
from .loop import TaskLoop
from .scheduler import ModelQueue

T = TypeVar("T")
# A tier's fields that say which weights, how they run and where their KV caches live: one model per value.
MODEL_FIELDS = ("path", "dtype", "device", "name", "backend", "kv", "kv_budget_mb", "graphs")
DEFAULT_MAX_BATCH = 64  # rows of one batched forward pass


class EngineCore:
    """A process's engine (see the module's docstring).

    max_batch: the most requests one batched pass of a model holds; prefill_chunk: the most tokens one
    pass of a long prompt feeds while others decode (None: the device's default, models.batching).
    """

    def __init__(self, max_batch: int = DEFAULT_MAX_BATCH, prefill_chunk: int | None = None, name: str | None = None):
        self.loop = TaskLoop(name)
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self._models: dict[tuple, HFModel] = {}
        self._heads: dict[str, HeadCache] = {}
        self._tables: dict[str, BigramTable] = {}
        self._leaves: Leaves | None = None  # the first wiring's: later ones share its tables (`leaves`)
        self._lock = threading.Lock()
        self._loading: dict[tuple, Future] = {}  # models being loaded now, by key (`model`)
        self.loads = 0  # models loaded from disk by this core (a test counts them per wiring)

    def model(self, tier: ModelTierConfig, **overrides: Any) -> HFModel:
        """The model a config's tier names (with `overrides` of its fields: a benchmark's other KV
        storage or backend), loaded the first time it is asked for, on the loop's thread: torch's CPU
        kernels run on an OpenMP team per calling thread, and a second team halves every pass on a
        small machine (engine.loop.on_loop_thread). Its passes batch in this core's loop."""
        fields = {key: getattr(tier, key) for key in MODEL_FIELDS} | overrides
        key = tuple(sorted(fields.items()))
        # The load runs outside the lock: it waits for the loop, and a loop task that meanwhile asks
        # for heads(), bigram() or leaves() takes the lock (held across the load, that was a deadlock).
        # A second caller of the same model waits for the first one's load instead of loading again.
        with self._lock:
            model = self._models.get(key)
            if model is not None:
                return model
            loading = self._loading.get(key)
            mine = loading is None
            if loading is None:
                loading = self._loading[key] = Future()
        if not mine:
            return loading.result()
        try:
            # Loaded and joined to the loop on the loop's thread: on cuda joining captures the first
            # graphs, which must be the thread (and stream) that replays them.
            model = self.loop.run(self._load, fields)
        except BaseException as exc:
            with self._lock:
                del self._loading[key]
            loading.set_exception(exc)
            raise
        with self._lock:
            self._models[key] = model
            self.loads += 1
            del self._loading[key]
        loading.set_result(model)
        return model

    def _load(self, fields: dict[str, Any]) -> HFModel:
        """On the loop's thread: the model read from disk and its passes joined to this core's loop."""
        model = HFModel.load(**fields)
        join_loop(model, self.loop, self.max_batch, self.prefill_chunk)
        return model

    def models(self) -> list[HFModel]:
        """Every model loaded here, in the order they were."""
        with self._lock:
            return list(self._models.values())

    def heads(self, device: str | torch.device = "cpu") -> HeadCache:
        """The acceptance heads on `device` (SpecDec++), each loaded once and shared by requests."""
        with self._lock:
            return self._heads.setdefault(str(device), HeadCache(device))

    def bigram(self, path: str) -> BigramTable:
        """MaG's bigram table at `path`, read once."""
        with self._lock:
            table = self._tables.get(path)
            if table is None:
                table = self._tables[path] = BigramTable.load(path)
            return table

    def leaves(self, drafters: Sequence[object], vocab_size: int, encode: Encode | None = None) -> Leaves:
        """A wiring's statistical drafters (engine.leaves): their tables loaded once per core, shared
        by every wiring (and an engine's variants) that names the same; their requests their own."""
        with self._lock:
            like = self._leaves
        leaves = Leaves([d for d in drafters if isinstance(d, StatisticalConfig)], vocab_size, encode, like=like)
        with self._lock:
            self._leaves = self._leaves or leaves
        return leaves

    def thread_settings(self) -> str:
        """torch's threads where this core's passes run: intra-op and inter-op, and OMP_NUM_THREADS.
        Read on the loop's thread, because OpenMP's team size is a per-thread setting (a thread takes
        torch's at its first parallel op) and Ray sets OMP_NUM_THREADS for its workers."""
        return self.loop.run(_thread_settings)

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) as a task of this core's loop, waited for."""
        return self.loop.run(fn, *args)

    def close(self) -> None:
        """The process is done serving: every model leaves the loop, and the loop stops."""
        for model in self.models():
            if model.batcher is not None:
                model.batcher.close()
        self.loop.close()


def join_loop(
    model: HFModel, loop: TaskLoop, max_batch: int = DEFAULT_MAX_BATCH, prefill_chunk: int | None = None
) -> None:
    """From now on `model`'s forward passes wait in `loop` (its engine core's) for the loop's batched
    step, beside concurrent requests' (engine.scheduler.ModelQueue: the model sees only its side,
    models.batching.PassQueue). Joining the same loop again changes the settings (a test, a benchmark's
    variant: the last ones win); another loop is refused.

    prefill_chunk: the most tokens one pass of a prompt feeds while other requests decode (0: a prompt
    in one pass; None: the device's default, models.batching.default_prefill_chunk).
    """
    chunk = default_prefill_chunk(model.device) if prefill_chunk is None else prefill_chunk
    queue = model.batcher
    if queue is None:
        queue = model.batcher = loop.batcher(model.name, executor(model), max_batch, chunk)
        metrics = default_metrics()
        queue.on_pass = lambda rows, seconds: model.record_pass(metrics, rows, seconds)
        # Ragged passes where the pool's passes run as transformers' forward; fixed-shape passes (CUDA
        # graphs) pad to their buckets instead.
        queue.ragged = model.prefix_caching and ragged(model) and not model.static
    elif not isinstance(queue, ModelQueue) or queue.loop is not loop:
        where = queue.loop.name if isinstance(queue, ModelQueue) else "another engine"
        raise ValueError(f"{model.name}: its passes already run in the engine loop {where}")
    else:
        queue.max_batch, queue.prefill_chunk = max_batch, chunk
    start_graphs(model, max_batch)  # on cuda the graphs are captured now, not on a request's time


def queue_of(model: HFModel) -> ModelQueue:
    """The engine's queue `model` joined (join_loop): its batch sizes and pass timer, for a caller of the
    engine (load adaptation, a tier server's figures, a benchmark)."""
    queue = model.batcher
    if not isinstance(queue, ModelQueue):
        raise ValueError(f"{model.name}: its passes do not run in an engine loop here")
    return queue


def _thread_settings() -> str:
    return (
        f"intra-op {torch.get_num_threads()}, inter-op {torch.get_num_interop_threads()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )
