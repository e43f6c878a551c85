"""`cascade-service bench`: every method is greedy and exact, and the outputs have the documented shape;
`--lossy` accounts each rule's deviation and `--adaptive` stays exact while it changes block lengths.

One bench run over the tiny family (module fixture) feeds most tests; it runs in-process through the
command's own argparse registration.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest
import yaml

from cascade_service.bench import lossy
from cascade_service.bench.cli import add_bench_command
from cascade_service.bench.methods import parse_methods
from cascade_service.config import load_config, make_cascade
from cascade_service.models.acceptance_head import AcceptanceHead

from ..helpers.bench import run_bench

METHODS = ["hf-ar", "ar", "hf-assisted:close", "hf-prompt-lookup", "sd:close", "csd:close+mag", "csd:close+mid+mag"]
PROMPTS = [
    "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\n",  # repeats: lookups match
    "import os\n",
]
FIGURES = {
    "tokens_per_s": float,
    "speedup_vs_hf_ar": float,
    "swi_params": float,
    "swi_measured": float,
    "target_calls_per_token": float,
    "mean_accepted_length": float,
    "identical_to_hf_ar": bool,
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def inputs(tiny_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    config = {
        "tiers": {
            "target": {"name": "target", "path": str(tiny_family["target"])},
            "drafters": [
                {"name": "close", "path": str(tiny_family["close"]), "backend": "lean"},
                {"name": "mid", "path": str(tiny_family["mid"])},
                {"kind": "mag"},
            ],
        },
        "schedule": {"k_matrix": [[4, 2, 0], [0, 2, 6], [0, 0, 6]], "leniency": 1.5},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


@pytest.fixture(scope="module")
def bench_out(inputs):
    out, stdout = inputs / "out", io.StringIO()
    with contextlib.redirect_stdout(stdout):  # capsys is function-scoped; this run is shared
        code = run_bench(
            "--config",
            str(inputs / "config.yaml"),
            "--prompts",
            str(inputs / "prompts.jsonl"),
            "--methods",
            ",".join(METHODS),
            "--max-new-tokens",
            "16",
            "--sd-k-sweep",
            "1,3",
            "--repeats",
            "1",
            "--out",
            str(out),
        )
    assert code == 0
    return out, stdout.getvalue()


@pytest.fixture(scope="module")
def results(bench_out):
    return json.loads((bench_out[0] / "results.json").read_text())


def test_results_json_has_the_documented_figures_for_every_method(results):
    assert list(results["methods"]) == METHODS
    for method, figures in results["methods"].items():
        for key, kind in FIGURES.items():
            assert type(figures[key]) is kind, f"{method}.{key} is {type(figures[key]).__name__}"
        assert figures["tokens_per_s"] > 0 and figures["mean_accepted_length"] >= 1.0, method
    for key in ("config", "machine", "max_new_tokens", "prompts", "command"):
        assert key in results
    assert results["methods"]["hf-ar"]["speedup_vs_hf_ar"] == 1.0


def test_every_greedy_method_reproduces_hf_ar_token_for_token(results):
    for method, figures in results["methods"].items():
        assert figures["identical_to_hf_ar"] is True, method
        assert all(p["identical_to_hf_ar"] for p in figures["per_prompt"]), method
    for k, figures in results["methods"]["sd:close"]["sweep"].items():
        assert figures["identical_to_hf_ar"] is True, f"sd:close k={k}"


def test_call_counts_agree_between_forward_hooks_and_engine_counters(results):
    # Autoregressive decoding costs one target forward per token, however it is counted.
    for method in ("hf-ar", "ar"):
        figures = results["methods"][method]
        assert figures["target_calls_per_token"] == 1.0 and figures["swi_params"] == 1.0, method
    assisted = results["methods"]["hf-assisted:close"]
    assert assisted["drafter_calls_per_token"]["close"] > 0
    for method in ("hf-assisted:close", "sd:close", "csd:close+mag", "csd:close+mid+mag"):
        figures = results["methods"][method]
        assert figures["mean_accepted_length"] == pytest.approx(1 / figures["target_calls_per_token"]), method


def test_sd_keeps_every_swept_k_and_reports_the_fastest(results):
    sd = results["methods"]["sd:close"]
    assert set(sd["sweep"]) == {"1", "3"}
    assert sd["best_k"] in (1, 3)
    assert sd["tokens_per_s"] == max(f["tokens_per_s"] for f in sd["sweep"].values())
    assert sd["setup"]["k_matrix"] == [[sd["best_k"]]]


def test_csd_uses_the_config_schedule_only_for_the_config_drafters(results):
    own = results["methods"]["csd:close+mid+mag"]["setup"]
    assert own["k_matrix"] == [[4, 2, 0], [0, 2, 6], [0, 0, 6]] and own["leniency"] == 1.5
    subset = results["methods"]["csd:close+mag"]["setup"]
    assert subset["k_matrix"] == [[5, 0], [0, 10]] and subset["leniency"] == 1.0


def test_cascade_methods_report_acceptance_by_position_per_reviewer(results):
    by_reviewer = results["methods"]["csd:close+mid+mag"]["acceptance_by_position"]
    assert set(by_reviewer) == {"target", "close", "mid"}
    assert all(0.0 <= rate <= 1.0 for rates in by_reviewer.values() for rate in rates)
    assert "acceptance_by_position" not in results["methods"]["ar"]


def test_plots_are_png_files(bench_out):
    for name in ("acceptance_by_position.png", "speedup.png"):
        data = (bench_out[0] / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name


def test_results_md_has_a_row_per_method_and_is_printed(bench_out):
    out, stdout = bench_out
    table = (out / "results.md").read_text()
    first = table.split("\n\n")[0]  # the methods table; the sections after it name methods again
    for method in METHODS:
        assert sum(line.startswith(f"| `{method}` |") for line in first.splitlines()) == 1, method
    assert "SD sweep for `sd:close`" in table
    assert table in stdout


def test_results_show_what_a_schedule_is_tuned_by(bench_out):
    results, table = json.loads((bench_out[0] / "results.json").read_text()), (bench_out[0] / "results.md").read_text()
    costs = results["tier_costs"]
    assert {t: c["backend"] for t, c in costs.items()} == {"target": "hf", "close": "lean", "mid": "hf"}
    for c in (costs["close"], costs["mid"]):
        assert 0 < c["vs_target"]["1"] == pytest.approx(c["step_ms"]["1"] / costs["target"]["step_ms"]["1"])
    assert set(costs["close"]["hf_step_ms"]) == {"1", "16"} and "hf_step_ms" not in costs["mid"]
    assert "| `close` | lean |" in table and "| `mid` | hf |" in table
    predicted = table.split("Predicted (SWI on measured step costs) and measured speedup:")[1].split("\n\n")[1]
    swi = results["methods"]["sd:close"]["swi_measured"]
    assert any(line.startswith("| `sd:close` |") and f"{swi:.2f}x" in line for line in predicted.splitlines())
    assert "| `csd:close+mid+mag" in predicted and "| `hf-ar` |" not in predicted  # drafting methods only
    acceptance = table.split("Acceptance by draft position")[1]
    assert "| `csd:close+mid+mag" in acceptance and "| `target` |" in acceptance


def test_hf_ar_always_runs_first_as_the_reference(inputs):
    config = load_config(inputs / "config.yaml").cascade
    methods = parse_methods("csd:close+mag,ar", config, [2])
    assert [m.name for m in methods] == ["hf-ar", "csd:close+mag", "ar"]


def test_csd_takes_its_schedule_from_the_tuned_config_with_exactly_its_drafters(inputs):
    config = load_config(inputs / "config.yaml").cascade
    tuned = make_cascade(
        config.target, [d for d in config.drafters if d.name in ("close", "mag")], [[3, 1], [0, 7]], 2.0
    )
    plain, with_tuned = (
        {m.name: m for m in parse_methods("csd:close+mag,csd:close+mid+mag", config, [2], extra)}
        for extra in ((), (tuned,))
    )
    assert plain["csd:close+mag"].variants[0].cascade.schedule.to_lists() == [[5, 0], [0, 10]]  # default
    runner = with_tuned["csd:close+mag"].variants[0]
    assert runner.cascade.schedule.to_lists() == [[3, 1], [0, 7]] and runner.cascade.leniency == 2.0
    # the config's own drafter set keeps the config's schedule
    assert with_tuned["csd:close+mid+mag"].variants[0].cascade.schedule == config.schedule


@pytest.mark.parametrize("method", ["csd:nope", "frob", "hf-assisted:mag", "sd:close+mid", "csd:mag+close"])
def test_bad_method_names_raise_value_error_naming_the_method(inputs, tmp_path, method):
    with pytest.raises(ValueError, match=method.replace("+", r"\+")):
        run_bench(
            "--config",
            str(inputs / "config.yaml"),
            "--prompts",
            str(inputs / "prompts.jsonl"),
            "--methods",
            f"ar,{method}",
            "--out",
            str(tmp_path),
        )


# --- bench --lossy and --adaptive (issue 5) ---------------------------------------------------------


def test_bench_lossy_writes_curves_and_accounts_the_deviation(inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(lossy.GRIDS, "token-v3", (-1.0, 0.9))
    monkeypatch.setitem(lossy.GRIDS, "lossy", (0.0, 0.9))
    out = tmp_path / "lossy"
    assert (
        run_bench(
            "--lossy",
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
    """`bench --adaptive` for `drafter` with a random depth-1 head of its width; adaptive.json."""
    from cascade_service.models.hf import HFModel

    AcceptanceHead(HFModel.load(tiny_family[drafter]).config.hidden_size, depth=1).save(tmp_path / "head")
    out = tmp_path / "adaptive"
    assert (
        run_bench(
            "--adaptive",
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


def test_the_recorded_command_repeats_every_tuned_config():
    from cascade_service.bench.runs import command_line

    parser = argparse.ArgumentParser(prog="cascade-service")
    add_bench_command(parser.add_subparsers(dest="command", required=True), argparse.ArgumentParser)
    args = parser.parse_args(
        [
            "bench",
            "--config",
            "c.yaml",
            "--prompts",
            "p.jsonl",
            "--methods",
            "hf-ar",
            "--tuned",
            "a.yaml",
            "--tuned",
            "b.yaml",
            "--out",
            "o",
        ]
    )
    assert "--tuned a.yaml --tuned b.yaml" in command_line(args)


def test_bench_modes_reject_mixed_flags(inputs):
    base = ["--config", str(inputs / "config.yaml"), "--prompts", str(inputs / "prompts.jsonl"), "--out", "/tmp/x"]
    with pytest.raises(ValueError, match="pick one"):
        run_bench("--lossy", "--adaptive", *base)
    with pytest.raises(ValueError, match="--rules"):
        run_bench("--lossy", "--rules", "token-v9", *base)
    with pytest.raises(ValueError, match="--methods is required"):
        run_bench(*base)
    with pytest.raises(ValueError, match="--drafter"):
        run_bench("--adaptive", "--drafter", "mag", *base)
    with pytest.raises(ValueError, match="--reviews must be a drafter smaller than 'mid'"):
        run_bench("--adaptive", "--drafter", "mid", "--reviews", "close", *base)
    with pytest.raises(ValueError, match="--under must be a model drafter bigger than 'close'"):
        run_bench("--adaptive", "--drafter", "close", "--under", "mid", *base)
