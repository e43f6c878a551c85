"""The offline zoo (`test` preset): it loads as HF models, caches, holds its prompts out of training, and
the same spec builds the same bytes."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import pytest

from cascade_service.core.proposers.mag import BigramTable
from cascade_service.models.hf import HFModel, load_tokenizer
from cascade_service.zoo.build import PRESETS, TIERS, build_zoo, corpus_files, held_out_modules
from cascade_service.zoo.evaluate import eval_package_files

CODE = 'async def f(x, *a, **k) -> dict:\n    """Doc: ünïcode \\t tabs."""\n\treturn {"a": x ** 2}  # ok\n'


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return build_zoo("test", tmp_path_factory.mktemp("zoo-test"), progress=False)


def _prompts(path) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()]


def test_tiers_are_local_hf_llama_dirs_whose_tokenizer_round_trips_code(zoo):
    sizes = []
    for name in TIERS:
        model = HFModel.load(zoo[name])
        tokenizer = load_tokenizer(zoo[name])
        assert model.config.model_type == "llama"
        assert model.eos_token_ids == {tokenizer.eos_token_id}
        assert model.vocab_size == len(tokenizer) == PRESETS["test"].vocab_size
        assert tokenizer.decode(tokenizer(CODE).input_ids) == CODE
        sizes.append(model.num_parameters)
    assert sizes == sorted(sizes, reverse=True)  # large > base > small


def test_a_second_build_of_the_same_spec_returns_at_once(zoo):
    began = time.perf_counter()
    again = build_zoo("test", zoo["large"].parent, progress=False)
    assert time.perf_counter() - began < 2.0
    assert again == zoo


def test_report_gives_size_speed_agreement_loss_and_training_per_tier(zoo):
    report = json.loads(zoo["report"].read_text())
    # The test preset is the CI's pipeline check: it must stay well under a minute.
    assert report["preset"] == "test" and 0 < report["build_s"]["total"] < 60
    assert report["evaluation"]["sources"] == ["heldout", "external"]
    assert set(report["evaluation"]["packages"]) == set(eval_package_files()) != set()
    for name in TIERS:
        tier = report["tiers"][name]
        assert tier["params"] > 0
        assert set(tier["step_ms"]) == set(tier["step_ratio"]) == {"threads_1", "threads_2"}
        for key in ("greedy_agreement", "heldout_agreement", "external_agreement"):
            assert 0.0 <= tier[key] <= 1.0
        for source in ("heldout", "external"):  # a model that learnt anything beats uniform guessing
            assert 0 < tier[f"{source}_loss"] < math.log(PRESETS["test"].vocab_size)
            assert tier[f"{source}_bits_per_char"] > 0
        assert tier["train"]["steps"] > 0 and tier["train"]["tokens"] > 0 and tier["train"]["final_loss"] > 0
    assert report["tiers"]["large"]["step_ratio"]["threads_1"] == 1.0
    training, loops = report["training"], report["loops"]
    assert training["tokens"] == report["tiers"]["large"]["train"]["tokens"] and training["tokens_per_s"] > 0
    assert loops["continuations"] == PRESETS["test"].eval_prompts and 0 <= loops["ending_in_a_loop"] <= 2
    assert len(loops["samples"]) == 2 and all(isinstance(s, str) for s in loops["samples"])


def test_prompts_come_from_held_out_code_and_never_from_the_training_corpus(zoo):
    prompts, tune = _prompts(zoo["prompts"]), _prompts(zoo["tune_prompts"])
    assert len(prompts) == 24 and len(tune) == 8 and not set(prompts) & set(tune)
    # Benchmark prompts from the evaluation packages, tuning prompts from the held-out stdlib modules.
    package_text = "".join(p.read_text(errors="replace") for ps in eval_package_files().values() for p in ps)
    held_text = "".join(p.read_text(errors="replace") for p in held_out_modules())
    assert all(p.splitlines()[0].strip() in package_text for p in prompts)
    assert all(p.splitlines()[0].strip() in held_text for p in tune)
    # Every run of three consecutive (stripped) lines in the training files.
    seen = set()
    for path in corpus_files():
        lines = [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines()]
        seen.update(zip(lines, lines[1:], lines[2:]))
    tokenizer = load_tokenizer(zoo["large"])
    for prompt in prompts + tune:
        # a def opening with a docstring (any string literal, as ast.get_docstring accepts) near the top
        assert prompt.startswith(("def ", "async def "))
        assert any(l.strip().lstrip("rRuU").startswith(('"', "'")) for l in prompt.splitlines()[1:8]), prompt
        assert len(tokenizer(prompt).input_ids) <= PRESETS["test"].max_prompt_tokens
        lines = [line.strip() for line in prompt.splitlines()]
        assert tuple(lines[:3]) not in seen, f"prompt opening occurs in the training corpus: {lines[:3]}"


def test_bigram_table_loads_with_the_zoo_vocabulary(zoo):
    table = BigramTable.load(zoo["bigram"])
    assert table.vocab_size == PRESETS["test"].vocab_size
    assert sum(table.next(t) is not None for t in range(table.vocab_size)) > table.vocab_size // 2


def test_the_same_spec_builds_byte_identical_tokenizer_weights_table_and_prompts(tmp_path):
    base = PRESETS["test"]
    spec = replace(
        base,
        corpus_chars=300_000,
        eval_prompts=1,
        eval_steps=2,
        eval_windows=1,
        schedule=replace(base.schedule, lm_steps=6, distill_steps=3),
    )
    first = build_zoo(spec, tmp_path / "a", progress=False)
    second = build_zoo(spec, tmp_path / "b", progress=False)
    for key in ("bigram", "prompts", "tune_prompts"):
        assert first[key].read_bytes() == second[key].read_bytes(), key
    for name in TIERS:
        for file in ("model.safetensors", "tokenizer.json", "config.json"):
            assert (first[name] / file).read_bytes() == (second[name] / file).read_bytes(), f"{name}/{file}"


def test_zoo_evaluate_measures_a_built_family_on_given_prompts(zoo, tmp_path, capsys):
    from cascade_service.cli.main import main

    prompts = tmp_path / "two.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in _prompts(zoo["tune_prompts"])[:2]))
    out = tmp_path / "eval.json"
    assert main(["zoo", "evaluate", str(zoo["large"].parent), "--prompts", str(prompts), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["loops"]["continuations"] == 2 and report["evaluation"]["vocab_size"] == PRESETS["test"].vocab_size
    for name in TIERS:
        assert 0 < report["tiers"][name]["external_bits_per_char"] < 8  # below a byte per character
    # Loss and agreement by position in 1,024-token windows: each span of each tier, the target agreeing
    # with itself everywhere.
    spans = report["by_context"]["sources"]["external"]
    assert report["by_context"]["window"] == 1024
    for name in TIERS:
        assert list(spans[name]) == ["0-256", "256-512", "512-1024"], spans[name]
        assert all(v["loss"] > 0 and 0 <= v["agreement"] <= 1 for v in spans[name].values())
    assert all(v["agreement"] == 1.0 for v in spans["large"].values())
    shown = capsys.readouterr().out
    assert "ending in a loop" in shown and "large on external by position (loss/agreement): 0-256" in shown


def test_zoo_evaluate_refuses_a_directory_without_a_family(tmp_path):
    from cascade_service.zoo.compare import evaluate_dir

    with pytest.raises(FileNotFoundError, match="not a zoo directory"):
        evaluate_dir(tmp_path)
