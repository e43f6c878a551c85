"""`cascade-service bench methods`: every greedy method is exact and the outputs have the documented shape,
every method beside plain decoding (`ar`) and the default (the floor); `bench lossy` and `bench adaptive`
are in test_bench_modes.py, the command tree and the old flags in tests/unit/test_bench_cli.py.

One bench run over the tiny family (module fixture) feeds most tests; it runs in-process through the
command's own argparse registration.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from cascade_service.bench.methods import parse_methods
from cascade_service.cli.parser import UsageError
from cascade_service.config import load_config, make_cascade
from cascade_service.core.cascade import Lookup

from ..helpers.bench import bench_inputs, bench_parser, run_bench

METHODS = ["hf-ar", "ar", "default", "off", "hf-assisted:close", "hf-prompt-lookup", "sd:close", "csd:close+mag"]
METHODS += ["csd:close+mid+mag"]
FIGURES = {
    "tokens_per_s": float,
    "speedup_vs_hf_ar": float,
    "swi_params": float,
    "swi_measured": float,
    "target_calls_per_token": float,
    "mean_accepted_length": float,
    "identical_to_hf_ar": bool,
    "speedup_vs_ar": float,
    "drafted_round_share": float,
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def inputs(tiny_family, tmp_path_factory):
    return bench_inputs(tmp_path_factory.mktemp("bench"), tiny_family)


@pytest.fixture(scope="module")
def bench_out(inputs):
    out, stdout = inputs / "out", io.StringIO()
    with contextlib.redirect_stdout(stdout):  # capsys is function-scoped; this run is shared
        code = run_bench(
            "methods",
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
    assert results["methods"]["hf-ar"]["speedup_vs_hf_ar"] == 1.0 and results["methods"]["ar"]["speedup_vs_ar"] == 1.0
    # default: the whole config under the floor; off: no drafts; the fixed methods draft every round
    assert results["methods"]["default"]["setup"]["speculation"] == "auto"
    assert results["methods"]["off"]["drafted_round_share"] == 0.0 == results["methods"]["ar"]["drafted_round_share"]
    assert results["methods"]["csd:close+mid+mag"]["drafted_round_share"] > 0.9


def test_every_greedy_method_reproduces_hf_ar_token_for_token(results):
    for method, figures in results["methods"].items():
        assert figures["identical_to_hf_ar"] is True, method
        assert all(p["identical_to_hf_ar"] for p in figures["per_prompt"]), method
    for k, figures in results["methods"]["sd:close"]["sweep"].items():
        assert figures["identical_to_hf_ar"] is True, f"sd:close k={k}"


def test_call_counts_agree_between_forward_hooks_and_engine_counters(results):
    # Autoregressive decoding costs one target forward per token, however it is counted.
    for method in ("hf-ar", "ar", "off"):
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
    for spec in ("csd:close+mag,ar", "csd:close+mag"):  # ar, plain decoding at the same load, always runs too
        assert [m.name for m in parse_methods(spec, config, [2])] == ["hf-ar", "ar", "csd:close+mag"]


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


def test_a_tuned_config_with_the_configs_own_drafters_lends_csd_its_schedule(inputs):
    # `tune` writes a config with the drafters of the one it tuned: given as --tuned, its schedule is the
    # one csd runs, so the tuned and the config's own (`default`) run side by side.
    config = load_config(inputs / "config.yaml").cascade
    lookup = Lookup(2, 20, "mag")
    tuned = make_cascade(config.target, list(config.drafters), [[3, 1, 0], [0, 2, 4], [0, 0, 6]], 2.0, lookup)
    methods = {m.name: m for m in parse_methods("csd:close+mid+mag,default", config, [2], (tuned,))}
    csd = methods["csd:close+mid+mag"].variants[0].cascade
    assert csd.schedule.to_lists() == [[3, 1, 0], [0, 2, 4], [0, 0, 6]]
    assert (csd.leniency, csd.lookup) == (2.0, lookup)
    assert methods["default"].variants[0].cascade.schedule == config.schedule != csd.schedule


@pytest.mark.parametrize("method", ["csd:nope", "frob", "hf-assisted:mag", "sd:close+mid", "csd:mag+close"])
def test_bad_method_names_raise_value_error_naming_the_method(inputs, tmp_path, method):
    with pytest.raises(ValueError, match=method.replace("+", r"\+")):
        run_bench(
            "methods",
            "--config",
            str(inputs / "config.yaml"),
            "--prompts",
            str(inputs / "prompts.jsonl"),
            "--methods",
            f"ar,{method}",
            "--out",
            str(tmp_path),
        )


def test_the_recorded_command_repeats_every_tuned_config():
    from cascade_service.bench.runs import command_line

    args = bench_parser().parse_args(
        [
            "bench",
            "methods",
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
    assert command_line(args).startswith("cascade-service bench methods --config c.yaml")
    assert "--tuned a.yaml --tuned b.yaml" in command_line(args)


def test_bench_modes_reject_bad_flags(inputs):
    base = ["--config", str(inputs / "config.yaml"), "--prompts", str(inputs / "prompts.jsonl"), "--out", "/tmp/x"]
    with pytest.raises(UsageError, match="separate benchmarks"):
        run_bench("--lossy", "--adaptive", *base)
    with pytest.raises(UsageError, match="unrecognized arguments: --methods"):
        run_bench("lossy", "--methods", "ar", *base)
    with pytest.raises(ValueError, match="--rules"):
        run_bench("lossy", "--rules", "token-v9", *base)
    with pytest.raises(UsageError, match="required: --methods"):
        run_bench("methods", *base)
    with pytest.raises(ValueError, match="--drafter"):
        run_bench("adaptive", "--drafter", "mag", *base)
    with pytest.raises(ValueError, match="--reviews must be a drafter smaller than 'mid'"):
        run_bench("adaptive", "--drafter", "mid", "--reviews", "close", *base)
    with pytest.raises(ValueError, match="--under must be a model drafter bigger than 'close'"):
        run_bench("adaptive", "--drafter", "close", "--under", "mid", *base)
