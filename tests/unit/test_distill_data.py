"""`distill`'s held-out report prompts by package (zoo/distill_data.py): whole packages held out, the
same ones on every run, none of them trained on; a folder's packages are its top-level entries, a
prompt file's the packages its lines' "source" names."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from cascade_service.zoo.distill_data import Corpus, cut_prompts, cut_sourced_prompts, source_units, split_by_package


class _Chars:
    """A tokenizer of one id per character (cut_prompts needs `__call__(...).input_ids`)."""

    def __call__(self, text):
        return SimpleNamespace(input_ids=[ord(c) for c in text])


def test_whole_packages_are_held_out_within_the_share_and_the_same_on_every_call():
    packages = [f"pkg{i}" for i in range(10) for _ in range(i + 1)]  # 55 texts, packages of 1..10
    texts = [f"text {n}" for n in range(len(packages))]
    (train, train_pkgs), (held, held_pkgs) = split_by_package(texts, packages, 0.2, "src")
    assert held and train and not set(held_pkgs) & set(train_pkgs)
    assert len(held) <= 0.2 * len(texts)
    for package in set(held_pkgs):  # whole: every text of a held-out package is held out
        assert held_pkgs.count(package) == packages.count(package)
    assert split_by_package(texts, packages, 0.2, "src") == ((train, train_pkgs), (held, held_pkgs))


def test_a_share_smaller_than_any_package_holds_out_the_smallest_and_one_package_is_refused():
    (_, train_pkgs), (_, held_pkgs) = split_by_package(["a", "b", "c"], ["x", "x", "y"], 0.05, "src")
    assert held_pkgs == ["y"] and train_pkgs == ["x", "x"]
    with pytest.raises(ValueError, match="--prompts src: 1 package.*give --report-prompts"):
        split_by_package(["a", "b"], ["x", "x"], 0.5, "src")


def test_the_packages_of_a_folder_a_prompt_file_and_a_corpus(tmp_path):
    (tmp_path / "alpha" / "sub").mkdir(parents=True)
    (tmp_path / "alpha" / "sub" / "m.py").write_text("x = 1\n")
    (tmp_path / "alpha" / "n.py").write_text("y = 2\n")
    (tmp_path / "beta.py").write_text("z = 3\n")
    (tmp_path / "empty.py").write_text("\n")  # blank: not a text
    assert source_units(tmp_path) == (["y = 2\n", "x = 1\n", "z = 3\n"], ["alpha", "alpha", "beta.py"])
    lines = [{"prompt": "a", "source": "starlette 1.0: routing.py"}, {"prompt": "b"}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n\n" for line in lines))
    assert source_units(prompts) == (["a", "b"], ["starlette", "line 3"])
    assert source_units(Corpus("c", ("t1", "t2"), ("p", "q"))) == (["t1", "t2"], ["p", "q"])
    assert source_units(Corpus("c", ("t1", "t2"))) == (["t1", "t2"], ["c[0]", "c[1]"])


def test_sourced_prompts_are_the_prompts_cut_prompts_cuts_with_their_packages():
    texts = ["line one\nline two\nline three\n" * 5, "other\ntext here\n" * 8]
    plain = cut_prompts(texts, _Chars(), 12, 10, 30, seed=3)
    sourced = cut_sourced_prompts(texts, ["a", "b"], _Chars(), 12, 10, 30, seed=3)
    assert [ids for ids, _ in sourced] == plain
    for ids, package in sourced:
        assert "".join(map(chr, ids)) in texts["ab".index(package)]
