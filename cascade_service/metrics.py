"""Prometheus metrics, named as vLLM names its own with the prefix `cascade:`.

One `Metrics` object per process (`default_metrics()`), fed at the edges: the coordinator reports each
finished request (`Metrics.request`: its cascade stats and timings), the front ends report admission
(running, waiting, queue time, refusals by status), the batchers report each forward pass. The core
knows nothing of it. Counters appear in the exposition with `_total` appended (as vLLM's do:
`cascade:spec_decode_num_drafts_total`), histograms as `_bucket`, `_sum` and `_count`.

Labels: `tier` is the reviewing tier (the target, or an inner reviewer: inner reviews show too),
`drafter` the tier whose tokens were reviewed, `position` the 0-based position in the block, `rule`
the final verifier's rule, `code` a gRPC status name (or HTTP status).

In a Ray Serve replica the same records also go to Ray's metrics system (`serving.ray_metrics`), which
each node's metrics agent exports for the cluster's Prometheus: Ray allows no `:` in a name and puts
`ray_` in front, so `cascade:tier_calls` is scraped there as `ray_cascade_tier_calls_total`
(docs/operations.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from .core.stats import CascadeStats

PREFIX = "cascade:"
RAY_PREFIX = "cascade_"  # Ray's exporter adds `ray_`; it refuses `:` in a name
CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds, from a fraction of a millisecond (a CPU draft pass) to minutes (a long request).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_POSITIONS = 64  # positions labelled per reviewer; blocks are shorter in practice


@dataclass(frozen=True)
class RequestTimes:
    """When a request's pieces happened, in seconds: queued (arrival to start of work), first token
    after arrival, the gaps between later chunks with their token counts, and the whole request."""

    queue_s: float
    first_token_s: float | None
    gaps: Sequence[tuple[float, int]]
    e2e_s: float


class Family:
    """One metric: recorded in this process's Prometheus registry and, once mirrored, in Ray's metrics
    system as well. The calls are prometheus_client's: `labels(*values)` then `inc`, `dec`, `set` or
    `observe`; or those directly on a metric without labels."""

    def __init__(self, metric: Any, kind: str, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]):
        self.metric, self.kind, self.name, self.doc = metric, kind, name, doc
        self.label_names, self.buckets = tuple(labels), tuple(buckets)
        self.ray: Any = None  # a ray.util.metrics instrument, once mirrored
        self._children: dict[tuple[str, ...], _Child] = {}

    def labels(self, *values: str) -> _Child:
        # Kept per label values: the batchers record every forward pass, and a lookup in prometheus_client
        # (a lock and a dict) plus a new child per pass was several microseconds of each round.
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _Child(
                self, self.metric.labels(*values), dict(zip(self.label_names, values))
            )
        return child

    def inc(self, amount: float = 1.0) -> None:
        _Child(self, self.metric, {}).inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        _Child(self, self.metric, {}).dec(amount)

    def set(self, value: float) -> None:
        _Child(self, self.metric, {}).set(value)

    def observe(self, value: float) -> None:
        _Child(self, self.metric, {}).observe(value)

    def mirror(self, make: Callable[..., Any]) -> None:
        """Record into `make(...)`'s instrument too (ray.util.metrics' Counter, Gauge or Histogram)."""
        if self.ray is not None:
            return
        name = RAY_PREFIX + self.name
        if self.kind == "histogram":
            self.ray = make(name, self.doc, boundaries=list(self.buckets), tag_keys=self.label_names)
        else:
            self.ray = make(name, self.doc, tag_keys=self.label_names)
        if self.kind == "gauge" and not self.label_names:  # a gauge starts at what it holds now
            self.ray.set(self.metric._value.get())


class _Child:
    def __init__(self, family: Family, metric: Any, tags: dict[str, str]):
        self.family, self.metric, self.tags = family, metric, tags

    def inc(self, amount: float = 1.0) -> None:
        self.metric.inc(amount)
        ray = self.family.ray
        if ray is not None:
            if self.family.kind == "gauge":
                ray.set(self.metric._value.get(), tags=self.tags)
            elif amount > 0:  # Ray's counters take only positive steps
                ray.inc(amount, tags=self.tags)

    def dec(self, amount: float = 1.0) -> None:
        self.metric.dec(amount)
        if self.family.ray is not None:
            self.family.ray.set(self.metric._value.get(), tags=self.tags)

    def set(self, value: float) -> None:
        self.metric.set(value)
        if self.family.ray is not None:
            self.family.ray.set(value, tags=self.tags)

    def observe(self, value: float) -> None:
        self.metric.observe(value)
        if self.family.ray is not None:
            self.family.ray.observe(value, tags=self.tags)


class Metrics:
    """The service's metrics on a registry of their own (`exposition()` renders them)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.families: list[Family] = []

        def add(metric: Any, kind: str, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]) -> Family:
            family = Family(metric, kind, name, doc, labels, buckets)
            self.families.append(family)
            return family

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Family:
            return add(Counter(PREFIX + name, doc, labels, registry=r), "counter", name, doc, labels, ())

        def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Family:
            return add(Gauge(PREFIX + name, doc, labels, registry=r), "gauge", name, doc, labels, ())

        def histogram(
            name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS
        ) -> Family:
            metric = Histogram(PREFIX + name, doc, labels, registry=r, buckets=buckets)
            return add(metric, "histogram", name, doc, labels, buckets)

        self.num_drafts = counter("spec_decode_num_drafts", "Draft blocks reviewed", ["tier"])
        # Over num_drafts: the share of rounds that drafted (the others were plain steps: engine.policies.floor).
        self.drafted_rounds = counter(
            "spec_decode_num_drafted_rounds", "Draft blocks reviewed that held at least one draft", ["tier"]
        )
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens reviewed", ["tier", "drafter"])
        self.num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted", ["tier", "drafter"]
        )
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each block position",
            ["tier", "position"],
        )
        self.drafted_per_pos = counter(
            "spec_decode_num_draft_tokens_per_pos", "Draft tokens reviewed at each block position", ["tier", "position"]
        )
        self.running = gauge("num_requests_running", "Requests decoding")
        self.heap_frozen = gauge(
            "heap_frozen_objects", "Objects alive at start-up, left out of the cyclic collector's walks (gc.freeze)"
        )
        self.waiting = gauge("num_requests_waiting", "Requests admitted and waiting for a worker")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated by finished requests")
        self.requests = counter("request_success", "Requests finished", ["finish_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token")
        self.itl = histogram("inter_token_latency_seconds", "Between output tokens (a chunk's gap over its tokens)")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token")
        self.queue = histogram("request_queue_time_seconds", "Arrival to start of work")
        self.tier_calls = counter("tier_calls", "Forward passes (MaG: proposals) per tier", ["tier"])
        # The engine loop's accounting of finished requests (engine/loop.py): where their time went.
        self.engine_pass_seconds = counter(
            "engine_pass_seconds", "Requests' shares of batched forward passes, per tier", ["tier"]
        )
        self.engine_run_seconds = counter("engine_run_seconds", "Requests' time on the engine loop outside passes")
        self.engine_wait_seconds = counter(
            "engine_wait_seconds", "Requests' time waiting (their turn, remote tiers, the session store)"
        )
        self.graph_failures = counter(
            "cuda_graph_failures",
            "CUDA graph captures or replays that failed (that bucket's pass ran eagerly)",
            ["tier"],
        )
        self.tier_pass_seconds = histogram("tier_pass_seconds", "Seconds of one batched forward pass", ["tier"])
        self.tier_batch_size = histogram(
            "tier_batch_size", "Rows of one batched forward pass", ["tier"], buckets=BATCH_BUCKETS
        )
        self.lossy_deferrals = counter(
            "lossy_deferrals", "Tokens emitted from a distribution other than the target's", ["rule"]
        )
        self.lossy_deviation = counter(
            "lossy_deviation", "Summed expected total-variation distance from the target", ["rule"]
        )
        # Each model tier's paged KV pool (models.kvpool), in tokens as vLLM counts its prefix cache.
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in a tier's prefix cache", ["tier"]
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Of them, tokens found cached", ["tier"])
        self.kv_evictions = counter("kv_block_evictions", "Cached KV blocks given to other requests", ["tier"])
        self.kv_preemptions = counter("kv_preemptions", "Requests' KV caches emptied to make room", ["tier"])
        self.kv_blocks_used = gauge("kv_blocks_used", "KV blocks requests hold", ["tier"])
        self.kv_blocks_cached = gauge("kv_blocks_cached", "KV blocks nobody holds, kept for their prefix", ["tier"])
        self.kv_blocks_free = gauge("kv_blocks_free", "KV blocks free or not yet allocated, under the budget", ["tier"])
        self.session_store_errors = counter("session_store_errors", "Session store calls that failed")
        self.rejected = counter("requests_rejected", "Requests refused or failed, by status", ["code"])
        self._lock = threading.Lock()

    def request(self, stats: CascadeStats, prompt_tokens: int, times: RequestTimes, finish_reason: str) -> None:
        """One finished request: its reviews by reviewer, drafter and position, tokens, timings."""
        for reviewer, review in stats.reviews.items():
            if review.reviews:
                self.num_drafts.labels(reviewer).inc(review.reviews)
            if review.drafted_by_position and review.drafted_by_position[0]:
                self.drafted_rounds.labels(reviewer).inc(review.drafted_by_position[0])
            # Counters that would not move are not touched: a request that drafted nothing (most at T = 1
            # under load) spent 7x plain's time here on label lookups of zeros (py-spy, 64 streams).
            for drafter, n in review.drafted_by_drafter.items():
                if n:
                    self.num_draft_tokens.labels(reviewer, drafter).inc(n)
                    self.num_accepted_tokens.labels(reviewer, drafter).inc(review.accepted_by_drafter.get(drafter, 0))
            positions = zip(review.drafted_by_position, review.accepted_by_position)
            for position, (drafted, accepted) in enumerate(positions):
                if position >= MAX_POSITIONS:
                    break
                if drafted:  # accepted <= drafted
                    self.drafted_per_pos.labels(reviewer, str(position)).inc(drafted)
                    self.accepted_per_pos.labels(reviewer, str(position)).inc(accepted)
        for tier, counters in stats.tiers.items():
            if counters.calls:
                self.tier_calls.labels(tier).inc(counters.calls)
        if stats.engine is not None:
            for tier, seconds in stats.engine.pass_s.items():
                self.engine_pass_seconds.labels(tier).inc(seconds)
            self.engine_run_seconds.inc(stats.engine.run_s)
            self.engine_wait_seconds.inc(stats.engine.waited_s)
        if stats.off_target_tokens or stats.tv_deviation:
            self.lossy_deferrals.labels(stats.verification).inc(stats.off_target_tokens)
            self.lossy_deviation.labels(stats.verification).inc(stats.tv_deviation)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(stats.generated)
        self.requests.labels(finish_reason).inc()
        if times.queue_s:
            self.queue.observe(times.queue_s)
        if times.first_token_s is not None:
            self.ttft.observe(times.first_token_s)
        for gap, tokens in times.gaps:
            for _ in range(tokens):
                self.itl.observe(gap / tokens)
        self.e2e.observe(times.e2e_s)

    def mirror(self, kinds: Mapping[str, Callable[..., Any]]) -> None:
        """From now on, record into another metrics system too: `kinds` makes its instrument of each
        kind ("counter", "gauge", "histogram"), as ray.util.metrics' classes do (serving.ray_metrics)."""
        with self._lock:
            for family in self.families:
                family.mirror(kinds[family.kind])

    def ray_names(self) -> set[str]:
        """The names Ray's exporter gives this registry's metrics (`ray_cascade_...`), as `names()` does."""
        return {"ray_" + RAY_PREFIX + name[len(PREFIX) :] for name in self.names()}

    def refused(self, code: str) -> None:
        self.rejected.labels(code).inc()

    def forward_pass(self, tier: str, rows: int, seconds: float) -> None:
        self.tier_batch_size.labels(tier).observe(rows)
        self.tier_pass_seconds.labels(tier).observe(seconds)

    def graph_failure(self, tier: str) -> None:
        self.graph_failures.labels(tier).inc()

    def kv_event(self, tier: str, event: str, amount: int) -> None:
        """A KV pool's event (models.kvpool.KVPool.report): a lookup's queries and hits, evictions,
        preemptions."""
        KV_EVENTS[event](self).labels(tier).inc(amount)

    def kv_blocks(self, tier: str, used: int, cached: int, free: int) -> None:
        self.kv_blocks_used.labels(tier).set(used)
        self.kv_blocks_cached.labels(tier).set(cached)
        self.kv_blocks_free.labels(tier).set(free)

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes (content type `CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    def names(self) -> set[str]:
        """Every sample name this registry exports (with `_total`, `_bucket`, ... suffixes)."""
        return {s.name for family in self.registry.collect() for s in family.samples} | {
            family.name + suffix
            for family in self.registry.collect()
            for suffix in (
                ("_total",)
                if family.type == "counter"
                else ("_bucket", "_sum", "_count")
                if family.type == "histogram"
                else ("",)
            )
        }


# A KV pool's event name -> its counter (one registry: models.kvpool reports these names).
KV_EVENTS: dict[str, Callable[[Metrics], Family]] = {
    "queries": lambda m: m.prefix_cache_queries,
    "hits": lambda m: m.prefix_cache_hits,
    "evictions": lambda m: m.kv_evictions,
    "preemptions": lambda m: m.kv_preemptions,
}


def merge_expositions(texts: Iterable[str]) -> bytes:
    """Several processes' expositions as one, each sample summed over the processes by name and labels:
    the edge's `/metrics` with its coordinator's and tiers' (their counters, histogram buckets, and the
    gauges here, which count requests, all add up). `_created` timestamps are left out."""
    families: dict[str, Metric] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created"):  # the text format parses them as gauges of their own
                continue
            families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            totals = sums.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                totals[key] = totals.get(key, 0.0) + sample.value
    for name, family in families.items():
        for (sample_name, labels), value in sums[name].items():
            family.add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry()
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    """A collector of families made beforehand (prometheus_client collects through `collect`)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


_DEFAULT: Metrics | None = None
_DEFAULT_LOCK = threading.Lock()


def default_metrics() -> Metrics:
    """This process's metrics (made on first use)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Metrics()
        return _DEFAULT
