"""`cascade-service distill` on the tiny family: agreement with the target rises, a stopped run resumed
ends with the weights an unstopped one has, the output is a model directory the engine loads (its
output still the target's), a drafter distilled from a distilled drafter works (a cascade in order),
and bad arguments are refused naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cascade_service.cli.main import main
from cascade_service.config import ModelTierConfig, make_cascade
from cascade_service.core.request import GenerationConfig
from cascade_service.inprocess import InProcess
from cascade_service.models.hf import load_tokenizer
from cascade_service.zoo import distill as distill_module
from cascade_service.zoo.distill import Settings, distill
from cascade_service.zoo.tiny import random_prompts
from tests.helpers.oracle import oracle

SOURCE = Path(__file__).resolve().parents[2] / "cascade_service" / "core"  # code files to cut prompts from
QUICK = Settings(
    steps=30,
    batch=4,
    prompts=40,
    min_prompt_tokens=20,
    max_prompt_tokens=60,
    continuation=16,
    held_out=0.2,
    checkpoint_every=10,
    lr=1e-2,
)


def test_agreement_rises_and_the_drafter_serves(tiny_family, tmp_path):
    out = tmp_path / "drafter"
    report = distill(tiny_family["target"], SOURCE, out, size="32:1", settings=QUICK, progress=False)
    before, after = report["before"], report["after"]
    assert after["acceptance_by_position"][0] > before["acceptance_by_position"][0] + 0.1, report
    assert after["agreement_by_context"]["0-256"] > before["agreement_by_context"]["0-256"] + 0.1, report
    assert report["steps"] == 30 and report["sequences"] > 0 and report["peak_rss_mb"] > 0
    assert json.loads((out / "distill.json").read_text())["after"] == after
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        [ModelTierConfig("distilled", str(out), backend="lean")],
        [[3]],
        1.0,
    )
    engine = InProcess(cascade)
    for prompt in random_prompts(2, 12, seed=3):
        assert engine.generate(prompt, GenerationConfig(max_new_tokens=20)).token_ids == oracle(
            tiny_family["target"], prompt, 20
        )
    # A cascade in order: a smaller drafter distilled against the one just made, the same command.
    second = distill(out, SOURCE, tmp_path / "smaller", size="16:1", settings=QUICK, progress=False)
    assert second["after"]["acceptance_by_position"][0] > second["before"]["acceptance_by_position"][0]


def test_by_default_the_report_prompts_come_from_packages_the_training_never_read(tiny_family, tmp_path):
    source = tmp_path / "packages"
    files = {}  # file -> its package (the folder directly under `source`), every line unique to it
    for p in range(6):
        for m in range(2):
            path = source / f"pkg{p}" / f"mod{m}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(f"def f_{p}_{m}_{i}(x):\n    return x * {p} + {m * 100 + i}\n" for i in range(40)))
            files[path] = f"pkg{p}"
    quick = Settings(steps=2, batch=2, prompts=24, min_prompt_tokens=20, max_prompt_tokens=40, continuation=4)
    out = tmp_path / "drafter"
    report = distill(tiny_family["target"], source, out, size="16:1", settings=quick, progress=False)
    tokenizer = load_tokenizer(tiny_family["target"])
    encoded = {package: [] for package in files.values()}
    for path, package in files.items():
        encoded[package].append(_key(tokenizer(path.read_text()).input_ids))

    def packages_of(name):  # the packages a run's prompts were cut from, found by their tokens
        found = []
        for line in (out / ".distill" / name).read_text().splitlines():
            item = json.loads(line)
            prompt = _key(item["ids"][: item["prompt"]])
            found.append({package for package, texts in encoded.items() if any(prompt in t for t in texts)})
        assert found and all(len(f) == 1 for f in found)  # each prompt found in exactly one package
        return set().union(*found), found

    trained, _ = packages_of("sequences.jsonl")
    judged, each = packages_of("held_out.jsonl")
    assert judged and trained and not judged & trained
    assert set(report["report_packages"]) == judged and set(report["training_packages"]) == trained
    assert [{p} for p in report["report_prompt_packages"]] == each
    assert report["report_prompts"].startswith("packages of --prompts held out of training")


def _key(ids):
    return "," + ",".join(map(str, ids)) + ","


def test_a_stopped_run_resumes_to_the_weights_of_an_unstopped_one(tiny_family, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    distill(tiny_family["target"], SOURCE, whole, size="32:1", settings=QUICK, progress=False)
    real = distill_module._save

    def save_then_stop(path, drafter, opt, step, *rest):
        real(path, drafter, opt, step, *rest)
        if step == 20:
            raise KeyboardInterrupt  # a stop right after the step-20 checkpoint

    monkeypatch.setattr(distill_module, "_save", save_then_stop)
    stopped = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        distill(tiny_family["target"], SOURCE, stopped, size="32:1", settings=QUICK, progress=False)
    assert not (stopped / "model.safetensors").exists()
    monkeypatch.undo()
    lines = (stopped / ".distill" / "sequences.jsonl").read_text()
    report = distill(tiny_family["target"], SOURCE, stopped, size="32:1", settings=QUICK, resume=True, progress=False)
    assert (stopped / ".distill" / "sequences.jsonl").read_text() == lines  # the continuations were reused
    assert report["steps"] == 30
    a, b = load_file(whole / "model.safetensors"), load_file(stopped / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_arguments_are_refused_naming_the_flag(tiny_family, tmp_path, capsys):
    common = ["distill", "--target", str(tiny_family["target"]), "--prompts", str(SOURCE)]
    assert main([*common, "--size", "huge", "--out", str(tmp_path / "a")]) == 2
    assert "--size must be one of base, small or HIDDEN:LAYERS" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert main([*common, "--size", "small", "--out", str(taken)]) == 2
    assert "exists and is not a distill run's directory" in capsys.readouterr().err
    assert main([*common, "--size", "small", "--out", str(tmp_path / "b"), "--prompts", "/nonexistent"]) == 2
    assert "--prompts /nonexistent: no such file or folder" in capsys.readouterr().err
    assert main([*common, "--drafter", str(tiny_family["mid"]), "--size", "small", "--out", str(tmp_path / "c")]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_command_distills_with_total_variation_and_reports_on_other_code(tiny_family, tmp_path, capsys):
    out, other = tmp_path / "tv", SOURCE.parent / "engine"
    args = ["distill", "--target", str(tiny_family["target"]), "--prompts", str(SOURCE), "--size", "32:1"]
    args += ["--out", str(out), "--report-prompts", str(other), "--divergence", "tv", "--steps", "12"]
    args += ["--batch", "4", "--prompts-count", "30", "--min-prompt-tokens", "20", "--max-prompt-tokens", "60"]
    assert main([*args, "--continuation", "8", "--checkpoint-every", "5"]) == 0
    shown = json.loads(capsys.readouterr().out)
    report = json.loads((out / "distill.json").read_text())
    assert shown["after"] == report["after"] and report["steps"] == 12
    assert report["settings"]["divergence"] == "tv" and report["report_prompts"] == str(other)
    assert report["held_out_prompts"] == 16


def test_acceptance_measures_a_drafter_without_training_it(tiny_family, tmp_path, capsys):
    from cascade_service.zoo.acceptance import acceptance
    from cascade_service.zoo.acceptance import main as acceptance_main

    quick = Settings(min_prompt_tokens=20, max_prompt_tokens=60, continuation=16, threads=1)
    target = tiny_family["target"]
    weights = (target / "model.safetensors").read_bytes()
    itself = acceptance(target, target, SOURCE, quick)  # a drafter that is its target agrees everywhere
    assert itself["acceptance_by_position"] == [1.0] * quick.draft_k and itself["points"] > 0
    assert set(itself["agreement_by_context"].values()) == {1.0}
    other = acceptance(target, tiny_family["unrelated"], SOURCE, quick)
    assert other["acceptance_by_position"][0] < 1.0 and other["held_out_prompts"] == itself["held_out_prompts"]
    assert (target / "model.safetensors").read_bytes() == weights  # measured, not trained
    argv = ["--target", str(target), "--drafter", str(tiny_family["unrelated"]), "--prompts", str(SOURCE)]
    assert acceptance_main([*argv, "--threads", "1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["prompts"] == str(SOURCE) and printed["points"] > 0
