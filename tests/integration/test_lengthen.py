"""A lengthened family (zoo/lengthen.py, here `long-test` from the test zoo): its large model trained
further at the spec's window and declaring it, so the service refuses longer contexts by name; its
drafters distilled in order against it, each distillation's before/after in the report; every package a
benchmark judges on, and every package depending on one, kept out of its training (zoo/judged.py);
its cascade exactly the large model's; reused, not rebuilt."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from cascade_service.config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.inprocess import InProcess
from cascade_service.models.hf import HFModel
from cascade_service.zoo.evaluate import EVAL_PACKAGES
from cascade_service.zoo.families import family
from cascade_service.zoo.judged import JudgedCodeError, check_training_packages, judged_packages
from cascade_service.zoo.lengthen import LONG_PRESETS, LongSpec, build_long

from ..helpers.oracle import oracle

SPEC = LONG_PRESETS["long-test"]


@pytest.fixture(scope="module")
def lengthened(test_zoo_home, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CASCADE_SERVICE_HOME", str(test_zoo_home))  # its source: the test zoo built there
        source = family("test")
        out = tmp_path_factory.mktemp("long")
        return source, build_long("long-test", out / "family", source, progress=False)


def test_every_tier_declares_the_trained_window_and_the_service_refuses_past_it(lengthened):
    source, paths = lengthened
    for tier in ("large", "base", "small"):
        assert json.loads((paths[tier] / "config.json").read_text())["max_position_embeddings"] == SPEC.window
        assert json.loads((source[tier] / "config.json").read_text())["max_position_embeddings"] > SPEC.window
        changed = load_file(paths[tier] / "model.safetensors")
        before = load_file(source[tier] / "model.safetensors")
        assert any(not changed[k].equal(before[k]) for k in before)  # trained, not copied
        for name in ("tokenizer.json", "tokenizer_config.json"):  # the source's tokenizer, byte for byte
            assert (paths[tier] / name).read_bytes() == (source[tier] / name).read_bytes()
    assert HFModel.load(paths["large"], name="large").max_positions == SPEC.window
    engine = InProcess(_cascade(paths))
    with pytest.raises(ValueError, match=rf"prompt: \d+ tokens, more than the limit of {SPEC.window - 1}"):
        engine.generate(list(range(3, 3 + SPEC.window)), GenerationConfig(max_new_tokens=4))


def test_the_report_has_each_distillation_and_the_training_left_the_evaluation_packages_out(lengthened):
    _, paths = lengthened
    report = json.loads(paths["report"].read_text())
    assert report["preset"] == "long-test" and report["lengthened_from"]["family"] == "test"
    assert set(report["training_packages"]) == set(SPEC.packages) and not set(report["training_packages"]) & set(
        EVAL_PACKAGES
    )
    assert "unknown" not in report["training_packages"].values()  # markdown_it: markdown-it-py's version
    assert report["judged_packages"] == judged_packages()
    assert set(report["training_dependencies"]) == set(SPEC.packages)
    for drafter in ("base", "small"):
        run = report["distill"][drafter]
        assert run["steps"] == SPEC.drafters.steps
        assert len(run["after"]["acceptance_by_position"]) == SPEC.drafters.draft_k
        assert run["report_prompts"].startswith("evaluation packages")
        assert set(run["report_prompt_packages"]) <= set(run["report_packages"]) <= set(EVAL_PACKAGES)
        assert not set(run["training_packages"]) & set(run["report_packages"])
        assert "target" not in run  # no path of the machine that built it
    assert not (paths["large"].parent / ".distill").exists()  # the runs' sequences are not kept
    assert report["tiers"]["large"]["train"]["steps"] == SPEC.steps


def test_its_cascade_is_the_large_models_output_and_a_second_build_reuses_it(lengthened):
    source, paths = lengthened
    engine = InProcess(_cascade(paths))
    ids = engine.encode("def parse(argv):\n    ")
    assert engine.generate(ids, GenerationConfig(max_new_tokens=16)).token_ids == oracle(paths["large"], ids, 16)
    again = build_long("long-test", paths["large"].parent, source, progress=False)
    assert again["large"].stat().st_mtime == paths["large"].stat().st_mtime


def test_a_spec_that_trains_on_judged_code_or_on_code_depending_on_it_is_refused(lengthened, tmp_path):
    source, _ = lengthened
    packages = ("h11", "tqdm", "fastapi", "markdown_it")  # disagree.jsonl's; an evaluation package; on starlette
    bad = LongSpec(name="bad", source="test", window=64, steps=1, batch=1, lr=1e-3, packages=packages)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(LONG_PRESETS, "bad", bad)
        with pytest.raises(JudgedCodeError, match=r"bad: refusing to train on h11, tqdm, fastapi:") as refused:
            build_long("bad", tmp_path / "bad", source, progress=False)
    assert "fastapi -> starlette" in str(refused.value) and not (tmp_path / "bad").exists()


def _cascade(paths):
    return make_cascade(
        ModelTierConfig("large", str(paths["large"])),
        [ModelTierConfig("base", str(paths["base"])), ModelTierConfig("small", str(paths["small"])), MaGConfig()],
        [[2, 1, 0], [0, 2, 4], [0, 0, 4]],
        1.5,
    )


def test_the_shipped_recipe_never_trains_on_code_the_benchmarks_judge_it_on():
    from cascade_service.bench.prompt_sets import SOURCES
    from cascade_service.zoo.lengthen import TRAIN_PACKAGES

    judged = set(EVAL_PACKAGES) | {package for package, _ in SOURCES}  # prompts.jsonl; disagree.jsonl
    assert judged <= set(judged_packages())
    assert LONG_PRESETS["quality"].packages == TRAIN_PACKAGES and not judged & set(TRAIN_PACKAGES)
    assert set(check_training_packages(TRAIN_PACKAGES)) == set(TRAIN_PACKAGES)  # nor code depending on it
