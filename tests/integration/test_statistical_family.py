"""MaG and suffix decoding in one config, in every wiring of the command line: `generate`, `bench` and
`tune` (the standalone server and the Ray app run such a config in tests/e2e/test_conformance.py).
Outputs equal the target's own greedy decoding, both drafters draft, and each keeps its own tables.
"""

from __future__ import annotations

import json

import pytest
import yaml

from cascade_service.cli import main
from cascade_service.config import GenerationConfig, load_config
from cascade_service.core.proposers.mag import BigramTable
from cascade_service.inprocess import InProcess

from ..helpers.bench import run_bench
from ..helpers.oracle import oracle

PROMPTS = ["for i in range(10):\n    print(i)\nfor i in range(10):\n", "def parse(argv):\n    return argv\n"]


@pytest.fixture(scope="module")
def mixed(tiny_family, tmp_path_factory):
    """A config with a model drafter, MaG (with a bigram table) and suffix decoding behind the gate."""
    root = tmp_path_factory.mktemp("mixed")
    BigramTable.from_tokens([t % 300 for t in range(3000)], 320).save(root / "bigram.json")
    config = {
        "tiers": {
            "target": {"name": "target", "path": str(tiny_family["target"])},
            "drafters": [
                {"name": "close", "path": str(tiny_family["close"])},
                {"kind": "mag", "bigram": str(root / "bigram.json")},
                {"kind": "suffix", "depth": 16},
            ],
        },
        "schedule": {
            "k_matrix": [[3, 0, 0], [0, 4, 2], [0, 0, 0]],
            "leniency": 1.5,
            "lookup": {"tier": "suffix", "min_match": 2, "tokens": 12},
        },
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


def test_generate_runs_a_config_mixing_mag_and_suffix_decoding(mixed, tiny_family, capsys):
    engine = InProcess(load_config(mixed / "config.yaml").cascade)
    assert engine.leaves.leaves["mag"].bigram is not None  # type: ignore[union-attr]  # MaG kept its table
    for prompt in PROMPTS:
        code = main(
            ["generate", "--config", str(mixed / "config.yaml"), "--prompt", prompt, "--max-new-tokens", "24", "--json"]
        )
        assert code == 0
        result = json.loads(capsys.readouterr().out)
        assert result["token_ids"] == oracle(tiny_family["target"], engine.encode(prompt), 24)
        entries = result["stats"]["reviews"]["close"]["row"]["entries"]
        assert entries["mag"]["share"] == entries["suffix"]["share"] == 1.0  # both entries ran in every block


def test_bench_runs_a_config_mixing_mag_and_suffix_decoding(mixed):
    out = mixed / "bench"
    methods = "hf-ar,csd:close+mag+suffix,csd:close+mag+suffix@total,suffix"
    code = run_bench(
        "--config", str(mixed / "config.yaml"), "--prompts", str(mixed / "prompts.jsonl"), "--methods", methods,
        "--max-new-tokens", "16", "--repeats", "1", "--out", str(out),
    )  # fmt: skip
    assert code == 0
    results = json.loads((out / "results.json").read_text())["methods"]
    for name in ("csd:close+mag+suffix", "csd:close+mag+suffix@total", "suffix"):
        assert results[name]["identical_to_hf_ar"], name
    tiers = results["csd:close+mag+suffix"]["tiers"]
    assert tiers["mag"]["drafted"] > 0 and tiers["suffix"]["drafted"] + tiers["suffix_lookup"]["drafted"] > 0
    rows = results["csd:close+mag+suffix"]["rows"]["close"]["entries"]
    assert rows["mag"]["share"] == rows["suffix"]["share"] == 1.0
    assert results["csd:close+mag+suffix@total"]["label"].endswith("@total")
    assert "K-matrix entries" in (out / "results.md").read_text()


def test_tune_runs_a_config_mixing_mag_and_suffix_decoding(mixed, tiny_family):
    out = mixed / "tuned.yaml"
    code = main(
        ["tune", "--config", str(mixed / "config.yaml"), "--prompts", str(mixed / "prompts.jsonl"),
         "--out", str(out), "--max-new-tokens", "12"]
    )  # fmt: skip
    assert code == 0
    tuned = load_config(out)
    assert [d.name for d in tuned.cascade.drafters] == ["close", "mag", "suffix"]
    assert tuned.cascade.schedule.fill.name == "entry"  # the semantics it was measured under, written out
    engine = InProcess(tuned.cascade)
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        assert engine.generate(ids, GenerationConfig(speculation="fixed", max_new_tokens=16)).token_ids == oracle(
            tiny_family["target"], ids, 16
        )
