"""The captured graphs' bookkeeping (models.graphs.GraphTable), which a CPU can run: a bounded
number of graphs, the least recently replayed dropped first; a stale one captured again; a failure
drops that bucket's graph, not the runner (issue 59, points 1 and 4). The capture itself is CUDA's and
is exercised by tests/gpu."""

from __future__ import annotations

import types

import torch

from cascade_service.metrics import default_metrics
from cascade_service.models.graphs import GraphTable, _Graph
from cascade_service.models.poolhold import CaptureFailed
from cascade_service.models.staticpass import drop_runner, padding_inputs

CPU = torch.device("cpu")


def _table(limit: int = 3, retries: int = 2) -> tuple[GraphTable, list[tuple]]:
    captured: list[tuple] = []

    def capture(inputs, storage):
        captured.append(inputs.key)
        return _Graph(None, inputs, torch.zeros(1), storage)

    return GraphTable(capture, limit=limit, retries=retries), captured


def test_the_least_recently_replayed_graph_goes_first_and_comes_back_at_its_next_use():
    table, captured = _table(limit=3)
    a, b, c, d = (padding_inputs(rows, 1, 256, CPU) for rows in (1, 2, 4, 8))
    for inputs in (a, b, c, a, d):  # a replayed again before d comes: b is the oldest
        table.get(inputs, (0,))
    assert list(table.graphs) == [c.key, a.key, d.key] and table.evictions == 1
    table.get(b, (0,))
    assert captured == [a.key, b.key, c.key, d.key, b.key] and len(table.graphs) == 3


def test_a_graph_over_a_moved_pool_is_captured_again():
    table, captured = _table()
    a = padding_inputs(1, 4, 256, CPU)
    first = table.get(a, (0, 32))
    assert table.get(a, (0, 32)) is first
    assert table.get(a, (1, 64)) is not first and captured == [a.key, a.key]


def test_a_failing_bucket_loses_its_graph_and_is_refused_after_its_retries_the_others_kept():
    table, _ = _table(retries=2)
    a, b = padding_inputs(1, 1, 256, CPU), padding_inputs(2, 1, 256, CPU)
    table.get(a, (0,))
    table.get(b, (0,))
    for attempt in range(3):
        assert not table.refused(a.key), attempt
        table.failed(a.key)
        assert a.key not in table.graphs and b.key in table.graphs
        if attempt < 2:
            table.get(a, (0,))  # captured again at its next use
    assert table.refused(a.key) and not table.refused(b.key)


def test_a_buckets_failure_keeps_the_runner_and_is_counted_once():
    runner = object()
    model = types.SimpleNamespace(name="graph-check", static=runner)
    failures = default_metrics().graph_failures.labels("graph-check").metric  # prometheus_client's child
    before = failures._value.get()
    drop_runner(model, CaptureFailed("out of memory", (1, 1, 256)))
    drop_runner(model, CaptureFailed("refused", (1, 1, 256), fresh=False))  # a refused bucket: nothing new
    assert model.static is runner and failures._value.get() == before + 1
    drop_runner(model, CaptureFailed("the runner itself"))  # no bucket: the fixed-shape passes go
    assert model.static is None and failures._value.get() == before + 2
