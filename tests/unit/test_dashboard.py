"""The Grafana dashboard (deploy/grafana/) asks only for metrics the service exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cascade_service.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "cascade-dashboard.json"
NAME = re.compile(r"cascade:[A-Za-z0-9_:]+")


def _expressions() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_every_expression_names_a_metric_the_service_exports():
    exported = Metrics().names()
    named = {name for expr in _expressions() for name in NAME.findall(expr)}
    assert named and not named - exported, sorted(named - exported)


def test_the_check_catches_a_wrong_name():
    assert "cascade:spec_decode_num_drafts" not in Metrics().names()  # the exposition's is `_total`
    assert "cascade:spec_decode_num_drafts_total" in Metrics().names()


def test_the_dashboard_shows_what_operators_watch():
    text = " ".join(_expressions())
    for wanted in ("per_pos", "generation_tokens", "time_to_first_token", "inter_token_latency", "tier_pass_seconds"):
        assert wanted in text, wanted
    assert "num_requests_waiting" in text
