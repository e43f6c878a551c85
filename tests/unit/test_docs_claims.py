"""What README.md and docs/algorithm.md say the demo's schedule is, is what configs/demo.yaml (and the
demo itself) runs: a sentence of the form "(`configs/demo.yaml`) runs K = `[[...]]`" in each."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from cascade_service.zoo.demo import DEMO_K_MATRIX

ROOT = Path(__file__).resolve().parents[2]
CLAIM = re.compile(r"\(`configs/demo\.yaml`\) runs K = `(\[\[[^`]*\]\])`")


def test_the_demo_k_matrix_named_in_readme_and_algorithm_md_is_the_shipped_one():
    shipped = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())["schedule"]["k_matrix"]
    assert DEMO_K_MATRIX == shipped
    for doc in ("README.md", "docs/algorithm.md"):
        claims = CLAIM.findall((ROOT / doc).read_text())
        assert claims, f"{doc} does not name the demo's K-matrix"
        assert all(json.loads(claim) == shipped for claim in claims), (doc, claims, shipped)


def test_the_claim_pattern_catches_a_wrong_matrix():
    # The negative control: a sentence naming another matrix is found and differs.
    wrong = "The shipped demo (`configs/demo.yaml`) runs K = `[[2, 0, 0], [0, 1, 0], [0, 0, 10]]`."
    (claim,) = CLAIM.findall(wrong)
    assert json.loads(claim) != yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())["schedule"]["k_matrix"]


def test_the_benchmarks_page_is_the_current_state_and_short_enough_to_read():
    # Issue 59 point 15: one section per question, the history in CHANGELOG.md, at most 500 lines.
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(page.splitlines()) <= 500
    for gone in ("the previous family", "was 1.19x"):  # how the history read when it lived here
        assert gone not in page
    assert "## Benchmark history" in (ROOT / "CHANGELOG.md").read_text()
