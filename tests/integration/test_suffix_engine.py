"""Suffix decoding in the cascade: alone, as a leaf beside MaG, behind the lookup gate, always the
target's greedy `generate()`; its config; it learns from finished requests of the same engine."""

from __future__ import annotations

import pytest

from cascade_service.bench.methods import parse_methods
from cascade_service.config import (
    ConfigError,
    GenerationConfig,
    MaGConfig,
    ModelTierConfig,
    SuffixConfig,
    make_cascade,
    parse_config,
)
from cascade_service.core.cascade import Lookup
from cascade_service.engine import Engine
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle

REPEATING = random_prompts(1, 12, seed=31)[0] * 3  # long self-matches: suffix decoding drafts a lot
PROMPTS = [REPEATING, *random_prompts(2, 15, seed=32)]

SETUPS = {
    "suffix_alone": (["suffix"], [[16]], None),
    "close_suffix": (["close", "suffix"], [[3, 2], [0, 6]], None),
    "close_suffix_mag": (["close", "suffix", "mag"], [[3, 0, 0], [0, 6, 4], [0, 0, 0]], None),
    "close_mid_suffix_gate": (["close", "mid", "suffix"], [[2, 1, 0], [0, 1, 4], [0, 0, 4]], Lookup(2, 12, "suffix")),
}


def _engine(family, names, k_matrix, lookup=None) -> Engine:
    drafters = [
        SuffixConfig() if n == "suffix" else MaGConfig() if n == "mag" else ModelTierConfig(n, str(family[n]))
        for n in names
    ]
    return Engine(make_cascade(ModelTierConfig("target", str(family["target"])), drafters, k_matrix, 1.5, lookup))


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_greedy_cascade_with_suffix_decoding_equals_transformers_generate(tiny_family, setup):
    names, k_matrix, lookup = SETUPS[setup]
    engine = _engine(tiny_family, names, k_matrix, lookup)
    drafted = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=30))
        assert result.token_ids == oracle(tiny_family["target"], prompt, 30), (setup, prompt)
        drafted += sum(t.tokens_out for name, t in result.stats.tiers.items() if name.startswith("suffix"))
    assert drafted > 0  # the suffix drafter ran: the repeating prompt has long matches


def test_the_next_request_drafts_from_the_last_ones_output(tiny_family):
    # A prompt that never repeats itself: only what an earlier request produced can be matched.
    engine = _engine(tiny_family, ["suffix"], [[16]])
    prompt = random_prompts(1, 20, seed=33)[0]
    first = engine.generate(prompt, GenerationConfig(max_new_tokens=30))
    cache = engine.suffix["suffix"]
    assert cache.nodes > 0
    again = engine.generate(prompt, GenerationConfig(max_new_tokens=30))
    assert again.token_ids == first.token_ids
    assert again.stats.target_calls < first.stats.target_calls  # it drafted the output it saw before


def test_suffix_config_fields_and_errors(tiny_family):
    tiers = {"target": {"path": str(tiny_family["target"])}, "drafters": [{"kind": "suffix", "depth": 16}]}
    parsed = parse_config({"tiers": tiers, "schedule": {"k_matrix": [[8]]}}).cascade
    assert parsed.drafters[0] == SuffixConfig(depth=16)
    tiers["drafters"] = [{"kind": "suffix", "min_prob": 2}]
    with pytest.raises(ConfigError, match=r"tiers\.drafters\[0\]\.min_prob must be a number in \[0, 1\]"):
        parse_config({"tiers": tiers})
    tiers["drafters"] = [{"kind": "suffix", "address": "127.0.0.1:9"}]
    with pytest.raises(ConfigError, match="address"):
        parse_config({"tiers": tiers})
    tiers["drafters"] = [{"path": str(tiny_family["close"])}, "mag"]
    schedule = {"k_matrix": [[2, 0], [0, 4]], "lookup": {"tier": "suffix"}}
    with pytest.raises(ConfigError, match=r"schedule\.lookup\.tier: 'suffix' is not a statistical drafter"):
        parse_config({"tiers": tiers, "schedule": schedule})


def test_bench_method_suffix_needs_the_drafter_in_the_config(tiny_family):
    plain = make_cascade(ModelTierConfig("target", str(tiny_family["target"])), [MaGConfig()], [[4]], 1.0)
    with pytest.raises(ValueError, match="method 'suffix': the config has no suffix drafter"):
        parse_methods("suffix", plain, [2])
    with_suffix = make_cascade(plain.target, [SuffixConfig()], [[4]], 1.0)
    (method,) = [m for m in parse_methods("suffix", with_suffix, [2]) if m.name == "suffix"]
    assert method.variants[0].cascade.schedule.to_lists() == [[32]]
