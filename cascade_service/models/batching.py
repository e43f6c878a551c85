"""Continuous batching of one model's forward passes across concurrent requests (issue 7).

Each request keeps its own KV cache (an `HFScorer`'s slot of its model's pool, models.kvpool). A
request thread that needs a forward pass hands it to the model's `ForwardBatcher` and waits; one worker
thread runs what is pending as one batched pass, so a request joins or leaves between passes without
waiting for the others, and the batch is what arrived while the previous pass ran (no timer). An idle
model runs a lone request's pass at once, in the request's own thread. How a pass over several rows
reads their caches is `forward_batch`'s: in place over pool slots (models.kvpool), or packed from
per-request `DynamicCache`s (models.packed, `kv: dynamic`).

Passes share a batch when they are alike in new tokens and in cached length (`take_batch`), so that
neither padding outgrows the real work; a long prompt is fed in chunks (`ForwardBatcher.forward`), so
other requests' passes run between them. Passes that cannot share take turns by the model time each
request has had (`ForwardBatcher._take`), so a request whose passes are dear (a long prompt, a long
cache) has the model as long as each of the others, not every other pass.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from cascade_service.models.kvpool import KVCache, SlotCache, forward_rows
from cascade_service.models.packed import forward_packed
from cascade_service.scheduling.passes import ROW_POSITIONS, PassTimer, charge, pads_within


class PassModel(Protocol):
    """What the batcher needs of a model (`models.hf.HFModel` is one). The batcher depends on this,
    never on `models.hf`, so the dependency points one way: hf -> batching."""

    name: str
    device: torch.device
    module: Any

    def _forward(self, tokens: Sequence[int], cache: KVCache | None, keep: int, with_hidden: bool = False) -> Any: ...

    def _sync(self) -> None: ...


# Tokens per pass of a long prompt's prefill while other requests decode (ForwardBatcher.forward):
# between two chunks they get a pass, so a chunk's pass must cost well under theirs. Measured with
# bench.long_request on the demo zoo's large model (CPU, 16 short requests beside a 3,500-token
# prompt, docs/benchmarks.md): with 16 the short ones took 1.5-1.6x their time alone during the
# prefill, with 32 1.8-2.1x, 64 2.6x, unchunked 3.7x.
PREFILL_CHUNK = 16
# On a GPU a pass of 16 tokens costs about what one of 256 does (its fixed part): larger chunks cost
# the others nothing more and the long prompt far less. Not measured: no GPU was available.
PREFILL_CHUNK_CUDA = 256


def default_prefill_chunk(device: torch.device) -> int:
    return PREFILL_CHUNK_CUDA if device.type == "cuda" else PREFILL_CHUNK


@dataclass
class _Pass:
    """One request's forward pass waiting for a batch."""

    fed: list[int]
    cache: KVCache
    keep: int
    with_hidden: bool
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None
    charged: float = 0.0  # this row's share of the pass's seconds (scheduling.passes.charge)


class ForwardBatcher:
    """Runs concurrent `HFModel` forward passes as batched passes on one worker thread.

    max_batch: at most this many requests in one pass (the rest wait for the next one).
    `batch_sizes` counts the passes run at each batch size (what a load test reads); `timer` holds the
    recent passes' sizes and times, from which load-adaptive speculation (scheduling.load) fits a pass's cost.
    """

    GATHER = 0.25  # at most this share of a pass's time is spent waiting for its requests to come back
    # Tokens per prefill pass while no other request is about: each chunk pays a pass's fixed part, so
    # small chunks would only slow a lone prompt; a request that arrives waits for one chunk at most.
    LONE_CHUNK = 256
    # Turns by model time had (_take); False: the oldest waiting pass first (bench.long_request --turns).
    FAIR = True

    def __init__(self, model: PassModel, max_batch: int = 64, prefill_chunk: int = PREFILL_CHUNK):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0: unchunked), got {prefill_chunk}")
        self.model = model
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.batch_sizes: dict[int, int] = {}
        self.timer = PassTimer()
        # Called after each pass with (rows, seconds): the metrics of the tier (metrics.Metrics.forward_pass).
        self.on_pass: Callable[[int, float], None] | None = None
        self._pending: list[_Pass] = []
        self._cond = threading.Condition()
        self._busy = False  # a pass is running (on the worker, or inline in a lone caller's thread)
        self._closed = False
        # Requests come back from a pass one by one (each samples, reviews, commits in its own thread
        # first); the next pass waits for those of the last two passes until _gather_until (_ready).
        self._expected = 1
        self._gather_until = 0.0
        self._last_rows: set[int] = set()  # the caches (one per request) of the last pass
        self._recent_rows: set[int] = set()  # ... of the last two passes
        # Fair turns (_take): the model seconds each request (its cache) has had, and the least of
        # those when the last batch was chosen, where a request that arrives (or comes back) starts.
        self._used: weakref.WeakKeyDictionary[KVCache, float] = weakref.WeakKeyDictionary()
        self._clock = 0.0
        self._worker = threading.Thread(target=self._run, name=f"batcher-{model.name}", daemon=True)
        self._worker.start()

    def forward(self, tokens: Sequence[int], cache: KVCache, keep: int, with_hidden: bool = False):
        """Like `HFModel._forward(tokens, cache, keep, with_hidden)`, batched with concurrent callers.

        Many tokens (a long prompt's prefill) are fed as passes of at most `prefill_chunk` tokens while
        other requests decode, LONE_CHUNK while none does, one after another: the others' passes run
        between them instead of waiting for the whole prompt. Only the last pass's logits are
        returned. On failure the cache is cut back to what it held before, as if nothing was fed.
        """
        tokens = list(tokens)
        n, start, cached = len(tokens), 0, cache.get_seq_length()
        try:
            while (end := chunk_end(n, start, keep, self._chunk(cache, n - start))) < n:
                # keep=1, not 0: HF's logits_to_keep=0 means every row. The one row is dropped.
                self._submit(tokens[start:end], cache, 1, False)
                start = end
            return self._submit(tokens[start:], cache, keep, with_hidden)
        except BaseException:
            if cache.get_seq_length() > cached:
                cache.crop(cached - cache.get_seq_length())  # negative: positions to drop (4.x and 5.x)
            raise

    def _chunk(self, cache: KVCache, rest: int) -> int:
        """The most tokens the next pass of the request owning `cache` may feed, of `rest` (0: all)."""
        if self.prefill_chunk == 0 or rest <= self.prefill_chunk:
            return 0  # nothing to cut: a decode step does not take the lock for it
        with self._cond:
            others = bool(self._pending) or bool(self._recent_rows - {id(cache)})
        return self.prefill_chunk if others else max(self.prefill_chunk, self.LONE_CHUNK)

    def _submit(self, tokens: list[int], cache: KVCache, keep: int, with_hidden: bool):
        """One pass, batched with concurrent callers' passes.

        When the model is idle and nothing waits, the caller runs its pass itself: a lone request pays
        no handoff to the worker thread (two context switches per pass, measurable at batch 1).
        """
        item = _Pass(tokens, cache, keep, with_hidden)
        with self._cond:
            if self._closed:
                raise RuntimeError(f"the batcher of {self.model.name} is closed")
            # Not below the clock: time a request spent elsewhere (new, or between two calls of a
            # session) is no credit to jump ahead of those that kept the model busy meanwhile.
            self._used[cache] = max(self._used.get(cache, 0.0), self._clock)
            alone = (
                not self._busy
                and not self._pending
                and (self._expected <= 1 or time.perf_counter() >= self._gather_until)
            )
            if alone:
                self._busy = True
                # As if chosen by _take: time a request had while alone is no debt to those who come.
                self._clock = max(self._clock, self._used[cache])
            else:
                self._pending.append(item)
                self._cond.notify_all()
        inline_cpu = 0.0
        if alone:
            cpu = time.thread_time()
            self._execute([item])
            inline_cpu = time.thread_time() - cpu
        item.done.wait()
        charge(item.charged, inline_cpu)
        if item.error is not None:
            raise item.error
        return item.result

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    wait = self._ready()
                    if wait == 0.0:
                        break
                    self._cond.wait(wait)
                if self._closed and not self._pending:
                    return
                batch = self._take()
                self._busy = True
            self._execute(batch)

    def _take(self) -> list[_Pass]:
        """Take the next batch off the pending passes (the caller holds the lock).

        It is grown (take_batch) from the waiting pass whose request has had the least model time, the
        oldest of those on a tie. Oldest-first would give one long request every other pass, since its
        chunks and its steps over a long cache share no pass with short rows: 16 short requests beside a
        3,500-token prompt took 1.4-1.9x their time alone (bench.long_request). Equal time makes the
        dear request wait while the others catch up, and nothing starves: a waiting request's time
        stands still while the others' grows.
        """
        first = min(self._pending, key=lambda item: self._used.get(item.cache, 0.0)) if self.FAIR else self._pending[0]
        self._clock = max(self._clock, self._used.get(first.cache, 0.0))
        batch = take_batch([first] + [item for item in self._pending if item is not first], self.max_batch)
        self._pending = [item for item in self._pending if all(item is not b for b in batch)]
        return batch

    def _ready(self) -> float | None:
        """0 when the worker should take a batch now, else how long to wait (None: until notified).

        Without the gather, the first request back from a pass would find the model idle and run
        alone while the others were still on their way: at 16 streams, plain decoding alternated
        passes of 1 and 15 rows, and the lone pass cost a third of a full one. So a pass waits for as
        many requests as the last two passes had between them (two: requests split over two passes
        are brought back together; one that left is waited for once), for at most GATHER of the last
        pass's time.
        """
        if self._busy or not self._pending:
            return None
        if len(self._pending) >= min(self._expected, self.max_batch):
            return 0.0
        return max(0.0, self._gather_until - time.perf_counter())

    def _execute(self, batch: list[_Pass]) -> None:
        """Run one pass (the caller holds `_busy`), hand out the results, then free the model."""
        self.batch_sizes[len(batch)] = self.batch_sizes.get(len(batch), 0) + 1
        try:
            began = time.perf_counter()
            with torch.inference_mode():
                results = forward_batch(self.model, batch)
            self.model._sync()
            seconds = time.perf_counter() - began
            tokens = [len(item.fed) for item in batch]
            self.timer.record(len(batch), sum(tokens), seconds, max(tokens))
            if self.on_pass is not None:
                self.on_pass(len(batch), seconds)
            for item, result, share in zip(batch, results, self.timer.shares(tokens, seconds)):
                item.result, item.charged = result, share
        except BaseException as exc:
            for item in batch:
                item.error = exc
        finally:
            with self._cond:
                self._busy = False
                for item in batch:
                    self._used[item.cache] = self._used.get(item.cache, 0.0) + item.charged
                rows = {id(item.cache) for item in batch}
                self._recent_rows, self._last_rows = rows | self._last_rows, rows
                self._expected = len(self._recent_rows)
                now = time.perf_counter()
                self._gather_until = now + self.GATHER * (now - began)
                self._cond.notify_all()  # the worker takes what arrived meanwhile
            for item in batch:
                item.done.set()


def chunk_end(n: int, start: int, keep: int, size: int) -> int:
    """Where the pass that feeds tokens[start:n] in chunks of at most `size` (0: one pass) stops.

    n for the last pass, which holds every one of the `keep` rows whose logits are asked for: it is
    longer than `size` where those are more, and the pass before it shorter.
    """
    if size <= 0 or n - start <= max(size, keep):
        return n
    return min(start + size, n - keep)


def take_batch(pending: list[_Pass], max_batch: int) -> list[_Pass]:
    """The next batch: the first waiting pass (whose turn it is) and those most like it in new tokens
    and cached length.

    A pass pads every row twice. Its new tokens to the most any row feeds: a padded query costs a whole
    position's compute, so a 100-token prefill beside fifteen one-token draft steps would process 1,600
    queries for 115 real ones. Its cache to the longest cache: a padded key is copied into the packed
    cache and attended to, so one 4,000-token conversation beside 16 short ones made every row copy and
    attend over 4,000 keys (on the demo zoo's large model, CPU: a 2 s pass instead of 35 ms, +1 GB).
    So a batch is grown from the first waiting pass with the passes closest to it while both stay
    within PAD_WASTE of the real work (scheduling.passes.pads_within): queries rows x S against sum s_i; keys
    rows x (L + S + ROW_POSITIONS) against sum (L_i + s_i + ROW_POSITIONS), where ROW_POSITIONS is what
    a row costs whatever its cache. The others wait for the next pass, which starts as soon as this one
    ends; the first waiting pass is always in this one.
    """
    shapes = [(item, _past(item), len(item.fed)) for item in pending]  # (pass, L_i, s_i)
    first, past0, new0 = shapes[0]
    batch = [first]
    steps, width, queries, keys = new0, past0, new0, past0 + new0 + ROW_POSITIONS
    for item, past, new in sorted(shapes[1:], key=lambda shape: (abs(shape[2] - new0), abs(shape[1] - past0))):
        if len(batch) == max_batch:
            break
        rows, s, w, k = len(batch) + 1, max(steps, new), max(width, past), past + new + ROW_POSITIONS
        if pads_within(rows, s, queries + new) and pads_within(rows, w + s + ROW_POSITIONS, keys + k):
            batch.append(item)
            steps, width, queries, keys = s, w, queries + new, keys + k
    return batch


def _past(item: _Pass) -> int:
    return item.cache.get_seq_length()


def forward_batch(model: PassModel, batch: list[_Pass]) -> list[object]:
    """One forward pass for several requests' passes: in place over their pool slots (models.kvpool),
    or packed from their own caches (models.packed); a lone pass is the model's own `_forward`."""
    if len(batch) == 1 or getattr(model, "encoder_decoder", False):  # encoder-decoder: one row a pass
        return [model._forward(one.fed, one.cache, one.keep, with_hidden=one.with_hidden) for one in batch]
    if isinstance(batch[0].cache, SlotCache):
        return forward_rows(model, batch)
    return forward_packed(model, batch)
