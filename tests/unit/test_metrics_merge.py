"""Expositions of several processes merged into one page: each sample summed over the processes."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from cascade_service.core.stats import CascadeStats
from cascade_service.metrics import Metrics, RequestTimes, merge_expositions


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_samples_add_up_by_name_and_labels_and_created_stamps_go():
    coordinator, tier, edge = Metrics(), Metrics(), Metrics()
    stats = CascadeStats(target="large", generated=4)
    stats.reviewer("large").record(["small", "small", "mag"], 1)
    for _ in range(2):
        coordinator.request(stats, 7, RequestTimes(0.0, 0.05, [(0.02, 1)], 0.2), "length")
    tier.forward_pass("large", rows=3, seconds=0.01)
    edge.refused("RESOURCE_EXHAUSTED")
    edge.waiting.set(2)
    merged = merge_expositions(m.exposition().decode() for m in (coordinator, tier, edge)).decode()
    samples = _samples(merged)
    assert samples[("cascade:generation_tokens_total", ())] == 8
    assert samples[("cascade:spec_decode_num_draft_tokens_total", (("drafter", "small"), ("tier", "large")))] == 4
    assert samples[("cascade:e2e_request_latency_seconds_count", ())] == 2
    assert samples[("cascade:tier_batch_size_sum", (("tier", "large"),))] == 3
    assert samples[("cascade:requests_rejected_total", (("code", "RESOURCE_EXHAUSTED"),))] == 1
    assert samples[("cascade:num_requests_waiting", ())] == 2
    assert not any(name.endswith("_created") for name, _ in samples) and "_created" not in merged
    # Every family keeps its type: Prometheus and the dashboard read counters and histograms as such.
    kinds = {f.name: f.type for f in text_string_to_metric_families(merged)}
    assert kinds["cascade:generation_tokens"] == "counter" and kinds["cascade:tier_pass_seconds"] == "histogram"
