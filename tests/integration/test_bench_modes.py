"""`cascade-service bench lossy` accounts each rule's deviation and `bench adaptive` stays exact while it
changes block lengths, over the tiny family (tests/helpers/bench.py's config and prompts)."""

from __future__ import annotations

import json

import pytest

from cascade_service.bench import lossy
from cascade_service.models.acceptance_head import AcceptanceHead

from ..helpers.bench import bench_inputs, run_bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def inputs(tiny_family, tmp_path_factory):
    return bench_inputs(tmp_path_factory.mktemp("bench"), tiny_family)


def test_bench_lossy_writes_curves_and_accounts_the_deviation(inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(lossy.GRIDS, "token-v3", (-1.0, 0.9))
    monkeypatch.setitem(lossy.GRIDS, "lossy", (0.0, 0.9))
    out = tmp_path / "lossy"
    assert (
        run_bench(
            "lossy",
            "--config",
            str(inputs / "config.yaml"),
            "--prompts",
            str(inputs / "prompts.jsonl"),
            "--rules",
            "token-v3,lossy",
            "--temperature",
            "1.0",
            "--seeds",
            "0",
            "--max-new-tokens",
            "12",
            "--out",
            str(out),
        )
        == 0
    )
    results = json.loads((out / "lossy.json").read_text())
    assert results["exact"]["tv_per_token"] == 0.0 and results["exact"]["off_target_tokens"] == 0
    for rule in ("token-v3", "lossy"):
        strict, loose = results["rules"][rule]
        assert strict["off_target_tokens"] == 0 and strict["tv_per_token"] == 0.0
        assert loose["off_target_tokens"] > 0 and loose["tv_per_token"] > 0.0
        assert loose["target_calls_per_token"] <= strict["target_calls_per_token"]
    assert results["token_v3_vs_lossy"]["rows"]  # at least the zero-loss level
    assert (out / "lossy_curves.png").read_bytes()[:8] == PNG_MAGIC
    assert "token-v3 vs lossy" in capsys.readouterr().out


def _adaptive(inputs, tiny_family, tmp_path, drafter: str, *flags: str) -> dict:
    """`bench adaptive` for `drafter` with a random depth-1 head of its width; adaptive.json."""
    from cascade_service.models.hf import HFModel

    AcceptanceHead(HFModel.load(tiny_family[drafter]).config.hidden_size, depth=1).save(tmp_path / "head")
    out = tmp_path / "adaptive"
    assert (
        run_bench(
            "adaptive",
            "--config",
            str(inputs / "config.yaml"),
            "--prompts",
            str(inputs / "prompts.jsonl"),
            "--drafter",
            drafter,
            "--head",
            str(tmp_path / "head"),
            "--max-k",
            "6",
            "--repeats",
            "1",
            *flags,
            "--out",
            str(out),
        )
        == 0
    )
    return json.loads((out / "adaptive.json").read_text())


def test_bench_adaptive_is_exact_and_summarises_against_the_best_fixed_k(inputs, tiny_family, tmp_path):
    results = _adaptive(
        inputs,
        tiny_family,
        tmp_path,
        "mid",
        "--sd-k-sweep",
        "1,3",
        "--thresholds",
        "0.5",
        "--confidence",
        "0.4",
        "--max-new-tokens",
        "10",
    )
    assert set(results["methods"]) == {"fixed K=1", "fixed K=3", "specdec h=0.5", "confidence h=0.4"}
    assert all(m["identical"] for m in results["methods"].values())
    assert results["best_fixed"] in ("fixed K=1", "fixed K=3")
    assert set(results["summary"]) == {"specdec", "confidence"}
    assert results["methods"]["fixed K=1"]["mean_block"] <= 1.0


def test_bench_adaptive_at_a_reviewing_tier_is_exact_and_stops_early(inputs, tiny_family, tmp_path):
    """--reviews: close reviews mid's drafts and SpecDec++ ends close's part of the target's block."""
    results = _adaptive(
        inputs,
        tiny_family,
        tmp_path,
        "close",
        "--reviews",
        "mid",
        "--other-k",
        "2",
        "--sd-k-sweep",
        "1,4",
        "--thresholds",
        "0.01",
        "--max-new-tokens",
        "12",
    )
    assert (results["reviews"], results["other_k"]) == ("mid", 2)
    assert set(results["methods"]) == {"fixed K=1", "fixed K=4", "specdec h=0.01"}  # no confidence rule here
    assert all(m["identical"] for m in results["methods"].values())
    # h = 0.01: the stopper ends every part at its second token (the head gives no certainty), so
    # blocks are at most 2 long, where the cap alone would allow 6.
    assert 0 < results["methods"]["specdec h=0.01"]["mean_block"] <= 2.0
    assert results["methods"]["fixed K=4"]["mean_block"] > 2.0
    assert "--reviews mid" in results["command"]


def test_bench_adaptive_at_a_tier_drafting_under_a_reviewer_is_exact_and_stops_early(inputs, tiny_family, tmp_path):
    """--under: mid drafts for close, which reviews it; SpecDec++ ends mid's block, not close's."""
    results = _adaptive(
        inputs,
        tiny_family,
        tmp_path,
        "mid",
        "--under",
        "close",
        "--other-k",
        "3",
        "--sd-k-sweep",
        "1,5",
        "--thresholds",
        "0.01",
        "--confidence",
        "0.4",
        "--max-new-tokens",
        "12",
    )
    assert (results["under"], results["other_k"]) == ("close", 3)
    assert set(results["methods"]) == {"fixed K=1", "fixed K=5", "specdec h=0.01", "confidence h=0.4"}
    assert all(m["identical"] for m in results["methods"].values())
    assert "drafting under close" in results["setting"]
    # mean_block is mid's block as close sees it: at most 2 once the stopper ends it, 5 when fixed.
    assert 0 < results["methods"]["specdec h=0.01"]["mean_block"] <= 2.0
    assert results["methods"]["fixed K=5"]["mean_block"] > 2.0
