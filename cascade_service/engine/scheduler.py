"""One model's place in the engine loop: its waiting passes, which of them make the next batched pass,
whose turn it is, and how a long prompt is cut into chunks; and between models, which go first
(`turns`). The loop (engine.loop) runs the batches; the model's side of a pass (how a batch reads the
requests' caches: models.batching) is handed in as `execute`, so this package never imports a model.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from ..core.passes import Pass
from .clock import ROW_POSITIONS, PassTimer, pads_within

T = TypeVar("T")
PASS_SMOOTHING = 0.1  # EWMA of a model's pass seconds (ModelQueue.pass_s)


class Cache(Protocol):
    """What the batcher reads of a request's KV cache (models.kvpool's caches are ones)."""

    def get_seq_length(self) -> int: ...

    def crop(self, max_length: int) -> None: ...


class Parking(Protocol):
    """What the batcher needs of the engine loop (engine.loop.TaskLoop): a task parks there on a
    pass until the loop has run it."""

    name: str

    def in_task(self) -> bool: ...

    def run(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    def park(self, why: tuple) -> Any: ...

    def wait(self, future: Future) -> Any: ...

    def leave(self, batcher: ModelQueue) -> None: ...


def chunk_end(n: int, start: int, keep: int, size: int) -> int:
    """Where the pass that feeds tokens[start:n] in chunks of at most `size` (0: one pass) stops.

    n for the last pass, which holds every one of the `keep` rows whose logits are asked for: it is
    longer than `size` where those are more, and the pass before it shorter.
    """
    if size <= 0 or n - start <= max(size, keep):
        return n
    return min(start + size, n - keep)


def take_batch(pending: list[Pass], max_batch: int, ragged: bool = False) -> list[Pass]:
    """The next batch: the first waiting pass (whose turn it is) and those most like it in new tokens
    and cached length.

    A pass pads every row twice. Its new tokens to the most any row feeds: a padded query costs a whole
    position's compute, so a 100-token prefill beside fifteen one-token draft steps would process 1,600
    queries for 115 real ones. Its cache to the longest cache: a padded key is copied into the packed
    cache and attended to, so one 4,000-token conversation beside 16 short ones made every row copy and
    attend over 4,000 keys (on the demo zoo's large model, CPU: a 2 s pass instead of 35 ms, +1 GB).
    So a batch is grown from the first waiting pass with the passes closest to it while both stay
    within PAD_WASTE of the real work (engine.clock.pads_within): queries rows x S against sum s_i; keys
    rows x (L + S + ROW_POSITIONS) against sum (L_i + s_i + ROW_POSITIONS), where ROW_POSITIONS is what
    a row costs whatever its cache. The others wait for the next pass, which starts as soon as this one
    ends; the first waiting pass is always in this one.

    ragged: the model's passes take rows of any new-token count unpadded (models.poolpass's ragged
    pass), so only the keys bound a batch: a k + 1-token verification joins one-token decode steps.
    """
    shapes = [(item, _past(item), len(item.fed)) for item in pending]  # (pass, L_i, s_i)
    first, past0, new0 = shapes[0]
    batch = [first]
    steps, width, queries, keys = new0, past0, new0, past0 + new0 + ROW_POSITIONS
    for item, past, new in sorted(shapes[1:], key=lambda shape: (abs(shape[2] - new0), abs(shape[1] - past0))):
        if len(batch) == max_batch:
            break
        rows, s, w, k = len(batch) + 1, max(steps, new), max(width, past), past + new + ROW_POSITIONS
        if (ragged or pads_within(rows, s, queries + new)) and pads_within(rows, w + s + ROW_POSITIONS, keys + k):
            batch.append(item)
            steps, width, queries, keys = s, w, queries + new, keys + k
    return batch


def _past(item: Pass) -> int:
    return item.cache.get_seq_length()


class ModelQueue:
    """One model's place in the engine loop: its waiting passes, how they are batched, and what its
    passes were (`batch_sizes`, `timer`: a pass's cost fitted from recent ones, which load
    adaptation reads).

    prefill_chunk: the most tokens one pass of a long prompt feeds while other requests use the model
    (0: a prompt in one pass), so their passes run between its chunks; LONE_CHUNK while none does.
    FAIR: the waiting pass of the request with the least model time goes first (else the oldest).
    """

    LONE_CHUNK = 256
    FAIR = True

    def __init__(
        self,
        loop: Parking,
        name: str,
        execute: Callable[[list[Pass]], list[Any]],
        max_batch: int = 64,
        prefill_chunk: int = 16,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0: unchunked), got {prefill_chunk}")
        self.loop, self.name, self._execute = loop, name, execute
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.batch_sizes: dict[int, int] = {}
        self.timer = PassTimer()
        self.on_pass: Callable[[int, float], None] | None = None  # (rows, seconds) after each pass: metrics
        self.pending: list[Pass] = []
        # What a pass of this model takes (EWMA, None before its first), and how long its waiting passes
        # have waited for cheaper models' passes since its last (`turns`; the loop adds to it).
        self.pass_s: float | None = None
        self.deferred_s = 0.0
        self.closed = False  # close() ran: no pass of this model runs again
        # Fair turns: the model seconds each request (its cache) has had, and the least of those when
        # the last batch was chosen, where a request that arrives (or comes back) starts.
        self._used: weakref.WeakKeyDictionary[Cache, float] = weakref.WeakKeyDictionary()
        self._clock = 0.0
        # The caches (one per request) of the last two passes, held weakly: a request that has ended is
        # no longer one to make room for (a session's next turn chunked its prefill for the last one's).
        self._recent: tuple[weakref.ref[Cache], ...] = ()  # the caches of its last two passes
        self._last: tuple[weakref.ref[Cache], ...] = ()

    @property
    def ragged(self) -> bool:
        """Whether the model's passes take rows of any new-token count unpadded (models.hf sets it from
        models.poolpass.ragged): batches then mix decode steps, verifications and prefill chunks. Kept
        by the pass timer, which prices a row by it."""
        return self.timer.ragged

    @ragged.setter
    def ragged(self, value: bool) -> None:
        self.timer.ragged = value

    def forward(self, tokens: Sequence[int], cache: Cache, keep: int, with_hidden: bool = False, chain: int = 1) -> Any:
        """Like the model's `forward_now(tokens, cache, keep, with_hidden)`, as part of the loop's batched
        passes. A long prompt is fed in chunks, each a pass of its own; only the last one's logits come
        back (with `chain` > 1, the last one drafts: Pass.chain). On failure the cache is cut back to
        what it held before. From outside the loop's tasks (another thread) the call is handed to the
        loop and waited for."""
        if self.closed:
            raise RuntimeError(f"the model {self.name} has left the engine loop {self.loop.name} (closed)")
        if not self.loop.in_task():
            return self.loop.run(self.forward, tokens, cache, keep, with_hidden, chain)
        tokens = list(tokens)
        n, start, cached = len(tokens), 0, cache.get_seq_length()
        try:
            while (end := chunk_end(n, start, keep, self._chunk(cache, n - start))) < n:
                # keep=1, not 0: HF's logits_to_keep=0 means every row. The one row is dropped.
                self.loop.park(("pass", self, Pass(tokens[start:end], cache, 1, False)))
                start = end
            return self.loop.park(("pass", self, Pass(tokens[start:], cache, keep, with_hidden, chain=chain)))
        except BaseException:
            if cache.get_seq_length() > cached:
                cache.crop(cached - cache.get_seq_length())  # negative: positions to drop (4.x and 5.x)
            raise

    def call(self, fn: Callable[[], T]) -> T:
        """fn() on the loop's thread, waited for (inside one of its tasks, simply called)."""
        return self.loop.run(fn)

    def wait(self, future: Future) -> Any:
        """future's result, waited for as the loop waits (TaskLoop.wait: a task of it parks)."""
        return self.loop.wait(future)

    def close(self) -> None:
        """The model leaves the loop: the loop runs no more of its passes, a pass waiting for its turn
        fails (RuntimeError) in its task, and a later `forward` fails at once (passes already run are
        unaffected). Idempotent."""
        if not self.closed:
            self.closed = True
            try:
                self.loop.run(self.loop.leave, self)
            except RuntimeError:  # the loop itself has closed: it runs no pass again anyway
                pass

    def _chunk(self, cache: Cache, rest: int) -> int:
        if self.prefill_chunk == 0 or rest <= self.prefill_chunk:
            return 0
        others = bool(self.pending) or any((other := ref()) is not None and other is not cache for ref in self._recent)
        return self.prefill_chunk if others else max(self.prefill_chunk, self.LONE_CHUNK)

    def take(self) -> list[Pass]:
        """The next batch off the waiting passes: grown (take_batch) from the pass whose request has had
        the least model time (the oldest of those on a tie), so a request whose passes are dear (a long
        prompt, a long cache) has the model as long as each of the others, not every other pass."""
        pending = self.pending
        if self.FAIR:
            first = min(pending, key=lambda item: self._used.get(item.cache, 0.0))
        else:
            first = pending[0]
        self._clock = max(self._clock, self._used.get(first.cache, 0.0))
        batch = take_batch([first] + [item for item in pending if item is not first], self.max_batch, self.ragged)
        taken = {id(item) for item in batch}
        self.pending = [item for item in pending if id(item) not in taken]
        return batch

    def _record(self, batch: list[Pass], seconds: float) -> None:
        """The timer's view of a pass: a chained one (Pass.chain) as its steps, each an equal share of
        the time, so the fitted cost stays that of one pass."""
        steps = max(item.chain for item in batch)
        for step in range(steps):
            fed = [len(item.fed) if step == 0 else 1 for item in batch if step < item.chain]
            self.timer.record(len(fed), sum(fed), seconds / steps, max(fed))

    def run(self, batch: list[Pass]) -> list[tuple[Pass, Any, BaseException | None, float]]:
        """One batched pass: (pass, result, error, its share of the seconds) per row."""
        self.batch_sizes[len(batch)] = self.batch_sizes.get(len(batch), 0) + 1
        self.deferred_s = 0.0  # its turn came
        for item in batch:  # not below the clock: time spent elsewhere is no credit to jump the queue
            self._used[item.cache] = max(self._used.get(item.cache, 0.0), self._clock)
        began = time.perf_counter()
        try:
            results = self._execute(batch)
        except BaseException as exc:
            return [(item, None, exc, 0.0) for item in batch]
        seconds = time.perf_counter() - began
        self.pass_s = seconds if self.pass_s is None else self.pass_s + PASS_SMOOTHING * (seconds - self.pass_s)
        tokens = [len(item.fed) + item.chain - 1 for item in batch]
        self._record(batch, seconds)
        if self.on_pass is not None:
            self.on_pass(len(batch), seconds)
        shares = self.timer.shares(tokens, seconds)
        for item, share in zip(batch, shares):
            self._used[item.cache] = self._used.get(item.cache, 0.0) + share
        # The caches of its last two passes, held weakly (a request that ended is no other request); as
        # plain references, not WeakSets, whose building and union cost ~10 us a pass.
        rows = tuple(weakref.ref(item.cache) for item in batch)
        self._recent, self._last = rows + self._last, rows
        return [(item, result, None, share) for item, result, share in zip(batch, results, shares)]


# A model's waiting passes wait for those of models whose passes take less than 1 / DEARER of its own,
# at most DEFER of its own pass's seconds (`turns`).
DEARER = 2.0
DEFER = 1.0


def turns(models: list[ModelQueue]) -> list[ModelQueue]:
    """The models whose next batch runs this step: every model with passes waiting, except that a dear
    one (a target) lets cheaper ones (its drafters) go first while they have passes waiting.

    A request drafting with a model parks on it once per draft step. Stepped with the target, each of
    those steps would wait for a whole target pass of the other requests: at 8 streams on the real family
    a round drafting six tokens with the 0.5B spanned seven target passes (4.9 s against 0.56 s for a
    plain round), a drafter reading a prompt in 16-token chunks twenty-five. Cheaper models first, the
    round's drafts are ready for the target's next pass, as a batch's proposer runs before its verifier in
    vLLM; the others wait for the drafter's work once, which is what it costs them. So that a drafter's
    long read cannot hold the target, a model waits at most DEFER of its own pass's time for the others'.
    """
    waiting = [model for model in models if model.pending]
    if len(waiting) < 2:
        return waiting
    cheapest = min(model.pass_s or 0.0 for model in waiting)
    return [
        model
        for model in waiting
        if (model.pass_s or 0.0) <= DEARER * cheapest or model.deferred_s >= DEFER * (model.pass_s or 0.0)
    ]
