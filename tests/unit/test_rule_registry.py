"""The final-verifier rules come from one registry: the verifier, the CLI, the API contract and the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cascade_service.cli import build_parser
from cascade_service.core.verify import REGISTRY, RULES, Verification

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", RULES)
def test_each_rule_resolves_once_to_its_registry_entry(name):
    v = Verification(name)
    assert v.family is REGISTRY[name] and v.exact  # unset alpha is the strict end
    assert v.family.low <= v.family.strict <= v.family.high


def test_the_cli_lists_the_registry():
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    help_text = next(a.help for a in generate._actions if "--verify" in a.option_strings)
    assert re.findall(r"[a-z][a-z0-9-]+", help_text.split(":", 1)[1].split("(")[0]) == list(RULES)


def test_the_docs_and_the_proto_name_every_rule():
    table = (ROOT / "docs/lossy.md").read_text()
    proto = (ROOT / "protos/cascade/v1/cascade.proto").read_text()
    for name in RULES:
        assert f"`{name}`" in table, f"docs/lossy.md has no row for {name}"
        assert f'"{name}"' in proto, f"cascade.proto does not list {name}"


def test_an_unknown_rule_names_the_registry():
    with pytest.raises(ValueError, match="verification.rule must be one of exact, lossy, chow"):
        Verification("bogus")
