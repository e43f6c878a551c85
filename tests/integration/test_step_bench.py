"""bench.steps prices each tier's pass under each graphs mode side by side: every cell a positive time."""

from __future__ import annotations

import re

import yaml

from cascade_service.bench.steps import main


def test_the_step_bench_times_every_tier_under_every_mode(tiny_family, tmp_path, capsys):
    config = {
        "tiers": {
            "target": {"name": "target", "path": str(tiny_family["target"])},
            "drafters": [{"name": "mid", "path": str(tiny_family["mid"]), "backend": "lean"}, {"kind": "mag"}],
        }
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["--config", str(path), "--modes", "off,eager", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "ms" in line]
    assert [row.split("|")[1:3] for row in rows] == [
        [" target (hf) ", " off "],
        [" target (hf) ", " eager "],
        [" mid (lean) ", " off "],
        [" mid (lean) ", " eager "],
    ]
    for row in rows:
        times = [float(t) for t in re.findall(r"([\d.]+) ms", row)]
        assert len(times) == 4 and min(times) > 0, row
