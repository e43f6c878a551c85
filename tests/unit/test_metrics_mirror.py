"""Metrics mirrored into Ray's metrics system record what the Prometheus registry records, under Ray's
names (no `:`), with the same labels as tags. A recording stand-in takes the place of ray.util.metrics
here; tests/e2e/test_service.py scrapes a real Ray node's exporter."""

from __future__ import annotations

from typing import ClassVar

from cascade_service.core.stats import CascadeStats
from cascade_service.metrics import Metrics, RequestTimes


class Recorder:
    """ray.util.metrics' Counter, Gauge and Histogram, as far as Metrics uses them."""

    made: ClassVar[dict[str, Recorder]] = {}

    def __init__(self, name: str, description: str = "", boundaries=None, tag_keys=()):
        assert ":" not in name
        self.name, self.tag_keys, self.boundaries = name, tuple(tag_keys), boundaries
        self.calls: list[tuple[str, float, dict]] = []
        Recorder.made[name] = self

    def inc(self, value: float = 1.0, tags=None) -> None:
        assert value > 0, "Ray's counters refuse steps that are not positive"
        self.calls.append(("inc", value, dict(tags or {})))

    def set(self, value: float, tags=None) -> None:
        self.calls.append(("set", value, dict(tags or {})))

    def observe(self, value: float, tags=None) -> None:
        self.calls.append(("observe", value, dict(tags or {})))


def _mirrored() -> Metrics:
    metrics = Metrics()
    Recorder.made = {}
    metrics.mirror({"counter": Recorder, "gauge": Recorder, "histogram": Recorder})
    return metrics


def test_every_family_is_mirrored_under_rays_name_with_its_labels_as_tags():
    metrics = _mirrored()
    assert set(Recorder.made) == {"cascade_" + f.name for f in metrics.families}
    assert Recorder.made["cascade_spec_decode_num_draft_tokens"].tag_keys == ("tier", "drafter")
    assert Recorder.made["cascade_tier_pass_seconds"].boundaries  # histograms keep their buckets
    assert "ray_cascade_spec_decode_num_drafts_total" in metrics.ray_names()


def test_a_request_records_the_same_counts_in_both():
    metrics = _mirrored()
    stats = CascadeStats(target="target", generated=5)
    stats.reviewer("target").record(["mid", "mid", "mag"], 2)
    stats.tier("target").calls = 3
    metrics.request(stats, prompt_tokens=7, times=RequestTimes(0.0, 0.1, [(0.2, 2)], 0.5), finish_reason="length")
    metrics.forward_pass("target", rows=4, seconds=0.01)
    drafted = Recorder.made["cascade_spec_decode_num_draft_tokens"].calls
    assert sorted(drafted, key=lambda c: c[2]["drafter"]) == [
        ("inc", 1, {"tier": "target", "drafter": "mag"}),
        ("inc", 2, {"tier": "target", "drafter": "mid"}),
    ]
    # A drafter with nothing accepted adds nothing in Ray (its counters take positive steps only).
    accepted = Recorder.made["cascade_spec_decode_num_accepted_tokens"].calls
    assert accepted == [("inc", 2, {"tier": "target", "drafter": "mid"})]
    assert Recorder.made["cascade_generation_tokens"].calls == [("inc", 5, {})]
    assert Recorder.made["cascade_inter_token_latency_seconds"].calls == [("observe", 0.1, {})] * 2
    assert Recorder.made["cascade_tier_batch_size"].calls == [("observe", 4, {"tier": "target"})]
    registry = metrics.registry
    assert registry.get_sample_value("cascade:generation_tokens_total") == 5
    labels = {"tier": "target", "drafter": "mid"}
    assert registry.get_sample_value("cascade:spec_decode_num_accepted_tokens_total", labels) == 2


def test_gauges_push_their_value_after_each_change():
    metrics = _mirrored()
    metrics.running.inc()
    metrics.running.inc()
    metrics.running.dec()
    metrics.waiting.set(3)
    # The value it held when mirrored, then each change.
    running = Recorder.made["cascade_num_requests_running"].calls
    assert running == [("set", 0, {}), ("set", 1, {}), ("set", 2, {}), ("set", 1, {})]
    assert Recorder.made["cascade_num_requests_waiting"].calls[-1] == ("set", 3, {})


def test_a_request_that_drafted_nothing_touches_no_drafting_counter():
    """Most requests at T = 1 under load draft nothing: their reviews' zero counts are not looked up by
    label (7x plain's time at the request's end, 64 streams), and no zero series appears for them."""
    metrics = Metrics()
    stats = CascadeStats(target="target", generated=5)
    review = stats.reviewer("target")
    for _ in range(5):
        review.record([], 0)  # five blocks, nothing drafted
    review.drafted_by_drafter["mid"] = 0
    metrics.request(stats, prompt_tokens=7, times=RequestTimes(0.0, 0.1, [(0.2, 2)], 0.5), finish_reason="length")
    text = metrics.exposition().decode()
    assert "cascade:spec_decode_num_drafts_total" in text  # its reviews are counted
    families = ("num_draft_tokens", "num_accepted_tokens", "num_draft_tokens_per_pos", "num_accepted_tokens_per_pos")
    for family in families:
        assert f"cascade:spec_decode_{family}_total{{" not in text, family
