"""Speculation per request (GenerationConfig.speculation, core.policy.SPECULATION): "auto", "fixed" and
"off" give the oracle's greedy tokens in every cascade shape; "off" calls no drafter and makes one target
pass per token; "fixed" runs the K-matrix even where the server adapts to load; the mode is checked
where the config is made."""

from __future__ import annotations

import pytest

from cascade_service.config import GenerationConfig
from cascade_service.core.cascade import Lookup
from cascade_service.sessions import MemoryStore
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import make_engine, oracle

PROMPTS = random_prompts(2, 10, seed=91)
N = 20
SHAPES = {
    "sd": (["close"], [[4]], None),
    "vertical": (["close", "mid"], [[3, 3], [0, 4]], None),
    "horizontal+mag": (["close", "mid", "mag"], [[4, 2, 0], [0, 2, 6], [0, 0, 6]], Lookup(2, 10)),
}


def _drafted(stats: dict) -> int:
    return sum(stats.get("drafted_by_position", []))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_mode_gives_the_oracles_tokens_and_off_drafts_nothing(tiny_family, shape):
    names, k_matrix, lookup = SHAPES[shape]
    engine = make_engine(tiny_family, names, k_matrix, 1.5, lookup=lookup)
    for prompt in PROMPTS:
        expected = oracle(tiny_family["target"], prompt, N)
        results = {
            m: engine.generate(prompt, GenerationConfig(max_new_tokens=N, speculation=m))
            for m in ("auto", "fixed", "off")
        }
        for mode, result in results.items():
            assert result.token_ids == expected, (shape, mode)
        off = results["off"].stats.to_dict()
        assert off["target_calls"] == N and _drafted(off) == 0, off
        assert all(not tier.get("calls") for name, tier in off["tiers"].items() if name != "target"), off
        assert _drafted(results["fixed"].stats.to_dict()) > 0


def test_fixed_runs_the_k_matrix_where_the_server_adapts_to_load_and_off_wins_over_it(tiny_family):
    names, k_matrix, lookup = SHAPES["horizontal+mag"]
    engine = make_engine(tiny_family, names, k_matrix, 1.5, lookup=lookup)
    coordinator = engine.coordinator(MemoryStore(), GenerationConfig(max_new_tokens=N), adapt_to_load=True)
    prompt = PROMPTS[0]
    expected = oracle(tiny_family["target"], prompt, N)
    for mode in ("auto", "fixed", "off"):
        chunk = coordinator.generate(coordinator.params(prompt_ids=prompt, temperature=0.0, speculation=mode))
        assert chunk.token_ids == expected, mode
        stats = chunk.stats.to_dict()
        rows = chunk.stats.reviews["target"].row() if mode != "off" else {}
        if mode == "fixed":  # every block the row's: each drafter of the target's row called in every block
            assert all(entry["share"] == 1.0 for entry in rows["entries"].values() if entry["blocks"]), rows
            assert _drafted(stats) > 0
        if mode == "off":
            assert stats["target_calls"] == N and _drafted(stats) == 0


@pytest.mark.parametrize("mode", ["", "OFF", "sometimes", None, 1])
def test_a_bad_mode_is_refused_naming_the_field(mode):
    with pytest.raises(ValueError, match=r"^speculation\.mode must be one of auto, fixed, off"):
        GenerationConfig(speculation=mode)  # type: ignore[arg-type]


def test_the_modes_map_to_their_policies():
    from cascade_service.core.policy import FIXED, OFF, SPECULATION

    made: list[tuple[bool, str]] = []

    def policies(greedy: bool, scope: str):
        made.append((greedy, scope))
        return "the server's policy"

    assert SPECULATION["auto"](policies, True, "key") == "the server's policy" and made == [(True, "key")]
    assert SPECULATION["auto"](None, False, "") is FIXED  # a server without policies runs the K-matrix
    assert SPECULATION["fixed"](policies, False, "") is FIXED and SPECULATION["off"](policies, False, "") is OFF
    assert made == [(True, "key")]  # only "auto" asks the server's policies, with the request's scope
    assert OFF.cap("model", 8, 8) == 0 and OFF.cap("lookup", 8, 8) == 0 and FIXED.cap("model", 8, 6) == 6
    assert not OFF.allows("lookup") and FIXED.allows("model")


def test_a_requests_own_target_row_runs_as_given_and_keeps_the_output(tiny_family):
    names, k_matrix, lookup = SHAPES["horizontal+mag"]  # configured target row [4, 2, 0]
    engine = make_engine(tiny_family, names, k_matrix, 1.5, lookup=lookup)
    coordinator = engine.coordinator(MemoryStore(), GenerationConfig(max_new_tokens=N), adapt_to_load=True)
    prompt = PROMPTS[1]
    expected = oracle(tiny_family["target"], prompt, N)
    for row, drafters in (((6, 0, 0), {"close"}), ((2, 3, 0), {"close", "mid"})):
        chunk = coordinator.generate(coordinator.params(prompt_ids=prompt, temperature=0.0, target_row=row))
        assert chunk.token_ids == expected, row
        entries = chunk.stats.reviews["target"].row()["entries"]
        assert {name for name, entry in entries.items() if entry["blocks"]} == drafters, (row, entries)
    with pytest.raises(ValueError, match=r"^speculation\.target_row: "):  # close reviewed by no one
        coordinator.params(prompt_ids=prompt, target_row=(0, 4, 0))
    with pytest.raises(ValueError, match=r"^speculation\.target_row"):
        coordinator.params(prompt_ids=prompt, target_row=(4, 2))  # one entry per drafter
    with pytest.raises(ValueError, match=r"^speculation\.target_row"):
        GenerationConfig(target_row=(4, 2, 65))


def test_a_request_the_floor_rests_runs_the_target_alone(tiny_family):
    """A policy that never lets anything draft (a request the floor admits resting, as speculation "off")
    gets a cascade of the target alone: the oracle's tokens, and no drafter's system or lookup built."""
    from cascade_service.engine.policies.goodput import FloorModel
    from cascade_service.engine.policies.rest import RestingFloor

    names, k_matrix, lookup = SHAPES["horizontal+mag"]
    engine = make_engine(tiny_family, names, k_matrix, 1.5, lookup=lookup)
    coordinator = engine.coordinator(MemoryStore(), GenerationConfig(max_new_tokens=N))
    model = FloorModel()
    coordinator.policies = lambda greedy, scope="": RestingFloor(model, greedy, scope)
    for prompt in PROMPTS:
        chunk = coordinator.generate(coordinator.params(prompt_ids=prompt, temperature=0.0))
        assert chunk.token_ids == oracle(tiny_family["target"], prompt, N)
        stats = chunk.stats.to_dict()
        assert stats["target_calls"] == N and _drafted(stats) == 0, stats
        assert set(stats["tiers"]) == {"target"}, stats["tiers"]  # no drafter, no lookup in its cascade
    assert model.level() == 0 and model.at(True, 0).plain_s is not None  # its rounds were timed into p
