"""`cascade-service demo`, the README's main job, runs end to end as a new user runs it: the family shipped
with the package (nothing trained), the service on local Ray, requests through the client SDK, the
speed table."""

from __future__ import annotations

import pytest

from cascade_service.cli import main


def test_demo_decodes_held_out_prompts_and_reports_identical_tokens(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CASCADE_SERVICE_HOME", str(tmp_path))  # an empty home: nothing to train or reuse
    assert main(["demo", "--prompts", "2", "--max-new-tokens", "12", "--passes", "2"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "zoo" / "quality" / "large").exists()  # the shipped family, not a build
    rows = [
        line for line in out.splitlines() if line.startswith(("ar (large alone)", "csd in-process", "csd via service"))
    ]
    assert len(rows) == 3
    assert all(row.split()[-1] == "True" for row in rows), out  # in-process and served tokens equal the large's
    assert out.count("--- continuation:") == 2
    accounting = next(line for line in out.splitlines() if line.startswith("orchestration per target round"))
    assert " ms in-process, " in accounting and " ms in the service " in accounting, accounting
    assert "tier hops per round" in accounting
    assert out.count("x, ") == 1 and "per pass:" in out  # one ratio per pass, then the median


def test_in_process_worker_decodes_in_a_child_process_and_reports_errors(tiny_family, tmp_path):
    import os

    import yaml

    from cascade_service.bench.inprocess import InProcessWorker
    from cascade_service.config import GenerationConfig, load_config
    from cascade_service.engine import Engine

    tiny_config = tmp_path / "tiny.yaml"
    tiny_config.write_text(
        yaml.safe_dump(
            {
                "tiers": {
                    "target": {"name": "target", "path": str(tiny_family["target"])},
                    "drafters": [{"name": "mid", "path": str(tiny_family["mid"])}, {"kind": "mag"}],
                }
            }
        )
    )
    engine = Engine(load_config(tiny_config).cascade)
    ids = [5, 9, 13, 2, 7]
    with InProcessWorker(str(tiny_config), torch_threads=1) as worker:
        assert worker.process.pid != os.getpid()
        with pytest.raises(RuntimeError, match="KeyError"):
            worker.generate("no-such-variant", ids, 8)
        for variant, expected in (("csd", engine), ("ar", engine.variant([]))):
            reply = worker.generate(variant, ids, 8)  # still answering after the error
            assert reply["tokens"] == expected.generate(ids, GenerationConfig(max_new_tokens=8)).token_ids
            assert reply["seconds"] > 0 and reply["target_calls"] >= 1
    assert worker.process.returncode == 0


def test_demo_schedule_is_the_tuned_one_in_configs_demo_yaml():
    from pathlib import Path

    from cascade_service.config import load_config
    from cascade_service.zoo.demo import DEFAULT_LAYOUT, DEMO_K_MATRIX, DEMO_LENIENCY, DEMO_LOOKUP, LAYOUTS

    config = load_config(Path(__file__).parents[2] / "configs" / "demo.yaml")
    cascade = config.cascade
    assert (cascade.schedule.to_lists(), cascade.leniency, cascade.lookup) == (
        DEMO_K_MATRIX,
        DEMO_LENIENCY,
        DEMO_LOOKUP,
    )
    assert config.serving.colocate == tuple(LAYOUTS[DEFAULT_LAYOUT]["colocate"])
    assert config.serving.groups == ()
