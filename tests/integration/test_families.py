"""The families a new user gets without training: the shipped one matches its manifest, loads and runs
exactly; a changed or missing file is refused by name; the grown family (here from the test zoo, as
`grown-test`) is bigger than its source, computes what its source computed at growth, and its cascade
is exact."""

from __future__ import annotations

import json
import shutil

import pytest

from cascade_service.config import GenerationConfig, load_config
from cascade_service.inprocess import InProcess
from cascade_service.zoo import shipped
from cascade_service.zoo.families import BUILDERS, family

from ..helpers.oracle import oracle


def test_the_shipped_family_matches_its_manifest_and_names_its_recipe():
    manifest = shipped.verify(shipped.family_dir())
    assert manifest["preset"] == "quality" and manifest["preset"] in BUILDERS  # `zoo build` rebuilds it
    weights = [rel for rel in manifest["files"] if rel.endswith("model.safetensors")]
    assert sorted(weights) == ["base/model.safetensors", "large/model.safetensors", "small/model.safetensors"]
    total = sum(f["size"] for f in manifest["files"].values())
    assert total < 40e6  # the repository grows by less than 40 MB


def test_the_shipped_config_runs_the_shipped_family_exactly():
    cascade = load_config("configs/demo.yaml").cascade
    engine = InProcess(cascade)
    assert engine.target.num_parameters > 1_000_000
    prompts = [json.loads(line)["prompt"] for line in family()["prompts"].read_text().splitlines()][:2]
    for prompt in prompts:
        ids = engine.encode(prompt)
        result = engine.generate(ids, GenerationConfig(max_new_tokens=24))
        assert result.token_ids == oracle(cascade.target.path, ids, 24)


@pytest.mark.parametrize("damage", ["changed", "missing", "extra"])
def test_a_damaged_family_is_refused_naming_the_file(tmp_path, damage):
    copy = tmp_path / "family"
    shutil.copytree(shipped.family_dir(), copy)
    if damage == "changed":
        path = copy / "bigram.json"
        path.write_text(path.read_text().replace(",", ", ", 1))
        message = "bigram.json: does not match MANIFEST.json"
    elif damage == "missing":
        (copy / "small" / "config.json").unlink()
        message = "small/config.json: listed in MANIFEST.json but missing"
    else:
        (copy / "large" / "notes.txt").write_text("added by hand")
        message = "large/notes.txt: not in MANIFEST.json"
    with pytest.raises(shipped.ShippedFamilyError, match=message):
        shipped.verify(copy)


def test_the_grown_family_is_bigger_and_its_cascade_exact(test_zoo_home, monkeypatch, tmp_path):
    from cascade_service.config import MaGConfig, ModelTierConfig, make_cascade
    from cascade_service.zoo.families import family
    from cascade_service.zoo.grown import GROWN_PRESETS, build_grown

    monkeypatch.setenv("CASCADE_SERVICE_HOME", str(test_zoo_home))  # its source: the test zoo built there
    paths = build_grown("grown-test", tmp_path / "grown", family("test"), progress=False)
    report = json.loads(paths["report"].read_text())
    source = json.loads((test_zoo_home / "zoo" / "test" / "report.json").read_text())
    tiers, growth = report["tiers"], GROWN_PRESETS["grown-test"].growth
    assert tiers["large"]["params"] > 2 * source["tiers"]["large"]["params"]
    assert report["grown_from"]["family"] == "test"
    assert len(tiers["large"]["pass_ms"]["threads_2"]) == 9  # the cost of reviewing 0..8 drafts
    engine_config = json.loads((paths["large"] / "config.json").read_text())
    assert engine_config["hidden_size"] == growth.hidden and engine_config["num_hidden_layers"] == growth.layers
    cascade = make_cascade(
        ModelTierConfig("large", str(paths["large"])),
        [ModelTierConfig("base", str(paths["base"])), ModelTierConfig("small", str(paths["small"])), MaGConfig()],
        [[2, 1, 0], [0, 2, 4], [0, 0, 4]],
        1.5,
    )
    engine = InProcess(cascade)
    ids = engine.encode("def parse(argv):\n    ")
    assert engine.generate(ids, GenerationConfig(max_new_tokens=16)).token_ids == oracle(paths["large"], ids, 16)
    again = build_grown("grown-test", tmp_path / "grown", family("test"), progress=False)  # reused, not rebuilt
    assert again["large"].stat().st_mtime == paths["large"].stat().st_mtime
