"""`cascade-service tune` writes a valid config whose schedule was measured, and stays exact."""

from __future__ import annotations

import json

import yaml

from cascade_service.cli import main
from cascade_service.config import GenerationConfig, load_config
from cascade_service.core.cascade import Lookup
from cascade_service.core.schedule import Schedule
from cascade_service.inprocess import InProcess
from cascade_service.tune import candidate_grid


def test_grid_holds_only_valid_schedules_around_k_star():
    grid = candidate_grid(["base", "small", "mag"], {"base": 5, "small": 3})
    assert grid and all(c.leniency in (1.0, 2.0) for c in grid)
    for c in grid:  # tune never emits a K-matrix the schedule refuses (every entry runs)
        Schedule.parse([list(row) for row in c.k_matrix], ["base", "small", "mag"])
    assert {c.k_matrix[0][0] for c in grid} == {3, 5, 7}
    assert all(c.k_matrix[2][2] in (4, 10) for c in grid)
    # every schedule competes with and without the MaG-first gate; without MaG there is no gate
    assert {c.lookup for c in grid} == {None, Lookup(2, 10), Lookup(2, 20)}
    assert {c.lookup for c in candidate_grid(["base", "small"], {"base": 5, "small": 3})} == {None}


def test_tune_writes_a_loadable_config_with_the_measured_best_schedule(tiny_family, tmp_path, capsys):
    config = {
        "tiers": {
            "target": {"path": str(tiny_family["target"])},
            "drafters": [{"name": "close", "path": str(tiny_family["close"])}, {"kind": "mag"}],
        },
        "schedule": {"k_matrix": [[2, 0], [0, 4]], "leniency": 1.0},
    }
    source = tmp_path / "in.yaml"
    source.write_text(yaml.safe_dump(config))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):\n", "class A:\n    x = 1\n"]))
    out = tmp_path / "tuned.yaml"
    assert (
        main(["tune", "--config", str(source), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "16"])
        == 0
    )
    err = capsys.readouterr().err
    assert "k* =" in err and "stage 4" in err
    assert out.read_text().startswith("# Tuned by `cascade-service tune`")
    tuned = load_config(out)
    assert [d.name for d in tuned.cascade.drafters] == ["close", "mag"]
    # whatever schedule won, the tuned cascade is still exact
    engine = InProcess(tuned.cascade)
    ids = engine.encode("def f(x):\n")
    gen = GenerationConfig(max_new_tokens=16)
    assert engine.generate(ids, gen).token_ids == engine.variant([]).generate(ids, gen).token_ids
