"""Training and judging kept apart (zoo/judged.py): every package a benchmark or report judges on is
found, a recipe that trains on one, on a package depending on one, on a package whose dependencies
cannot be read, or on one not installed is refused before anything is built; the shipped recipe
passes; versions are read from the distribution, not the import name."""

from __future__ import annotations

import importlib
import importlib.metadata
import json

import pytest

from cascade_service.bench.prompt_sets import PROMPTS_DIR, SOURCES
from cascade_service.zoo.evaluate import EVAL_PACKAGES, eval_source_versions
from cascade_service.zoo.judged import (
    JudgedCodeError,
    check_training_packages,
    judged_packages,
    prompt_set_packages,
)
from cascade_service.zoo.lengthen import LONG_PRESETS, TRAIN_PACKAGES, LongSpec, build_long


def test_every_package_a_benchmark_judges_on_is_judged():
    judged = judged_packages()
    assert set(EVAL_PACKAGES) <= set(judged)  # prompts.jsonl, the reports' figures
    assert {package for package, _ in SOURCES} <= set(judged)  # how disagree.jsonl was made
    sets = sorted(PROMPTS_DIR.glob("*.jsonl"))
    assert sets  # every prompt set that ships with the benchmarks, by the package each line names
    for path in sets:
        for line in path.read_text().splitlines():
            if line.strip():
                package = json.loads(line)["source"].split()[0]
                assert f"bench/prompts/{path.name}" in judged[package]


def test_a_prompt_set_that_does_not_say_what_it_was_cut_from_is_an_error(tmp_path):
    (tmp_path / "mine.jsonl").write_text(json.dumps({"prompt": "def f():\n"}) + "\n")
    with pytest.raises(JudgedCodeError, match=r"mine.jsonl line 1: no \"source\""):
        prompt_set_packages(tmp_path)


def test_the_shipped_recipe_trains_on_nothing_judged_nor_on_anything_depending_on_it():
    assert LONG_PRESETS["quality"].packages == TRAIN_PACKAGES
    cleared = check_training_packages(TRAIN_PACKAGES)
    judged = judged_packages()
    assert set(cleared) == set(TRAIN_PACKAGES) and not set(cleared) & set(judged)
    for found in cleared.values():  # its whole dependency closure is clear of judged distributions
        assert not {"starlette", "anyio", "attrs", "h11", "uvicorn", "pyyaml", "click", "jinja2"} & set(
            found["depends_on"]
        )


def test_judged_packages_are_refused_by_name():
    with pytest.raises(JudgedCodeError) as refused:
        check_training_packages(("h11", "tqdm", "urllib3"), who="bad")
    message = str(refused.value)
    assert message.startswith("bad: refusing to train on h11, tqdm:")
    assert "h11: judged code (named by bench.prompt_sets.SOURCES, bench/prompts/disagree.jsonl)" in message
    assert "tqdm: judged code (named by zoo.evaluate.EVAL_PACKAGES)" in message


def test_a_package_depending_on_judged_code_is_refused_with_the_chain():
    with pytest.raises(JudgedCodeError) as refused:
        check_training_packages(("fastapi", "jsonschema"))
    message = str(refused.value)
    assert "fastapi: depends on judged code: fastapi -> starlette" in message
    assert "fastapi -> anyio" in message
    assert "jsonschema: depends on judged code: jsonschema -> attrs" in message


def test_a_missing_package_and_one_without_metadata_are_refused_not_skipped(tmp_path, monkeypatch):
    package = tmp_path / "unlisted_pkg_for_test"
    package.mkdir()
    (package / "__init__.py").write_text("def f():\n    return 1\n")  # importable, no dist-info beside it
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    with pytest.raises(JudgedCodeError) as refused:
        check_training_packages(("no_such_package_here", "unlisted_pkg_for_test", "urllib3"))
    message = str(refused.value)
    assert "no_such_package_here: not installed here" in message
    assert "unlisted_pkg_for_test: unknown: no installed distribution's metadata names it" in message
    assert message.startswith("training: refusing to train on no_such_package_here, unlisted_pkg_for_test:")


def test_a_recipe_with_judged_code_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    bad = LongSpec(name="bad", source="test", window=64, steps=1, batch=1, lr=1e-3, packages=("h11", "fastapi"))
    monkeypatch.setitem(LONG_PRESETS, "bad", bad)
    with pytest.raises(JudgedCodeError, match=r"bad: refusing to train on h11, fastapi:"):
        build_long("bad", tmp_path / "out", {}, progress=False)  # no source family needed to refuse
    assert not (tmp_path / "out").exists()


def test_versions_are_the_distributions_not_the_import_names():
    versions = eval_source_versions(["markdown_it", "yaml", "attr", "no_such_package_here"])
    assert versions["markdown_it"] == importlib.metadata.version("markdown-it-py") != "unknown"
    assert versions["yaml"] == importlib.metadata.version("PyYAML")
    assert versions["attr"] == importlib.metadata.version("attrs")
    assert versions["no_such_package_here"] == "unknown"
