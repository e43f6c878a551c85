"""Suffix decoding in the cascade: alone, as a leaf beside MaG, behind the lookup gate, always the
target's greedy `generate()`; its config; it learns from finished requests of the same engine and
drafts from an operator's corpus; MaG keeps its own bigram table beside it (one family, no shared
config class)."""

from __future__ import annotations

import pytest

from cascade_service.bench.methods import parse_methods
from cascade_service.bench.zoo import Zoo
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
from cascade_service.inprocess import InProcess
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


def _engine(family, names, k_matrix, lookup=None) -> InProcess:
    drafters = [
        SuffixConfig() if n == "suffix" else MaGConfig() if n == "mag" else ModelTierConfig(n, str(family[n]))
        for n in names
    ]
    return InProcess(make_cascade(ModelTierConfig("target", str(family["target"])), drafters, k_matrix, 1.5, lookup))


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_greedy_cascade_with_suffix_decoding_equals_transformers_generate(tiny_family, setup):
    names, k_matrix, lookup = SETUPS[setup]
    engine = _engine(tiny_family, names, k_matrix, lookup)
    drafted = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, GenerationConfig(speculation="fixed", max_new_tokens=30))
        assert result.token_ids == oracle(tiny_family["target"], prompt, 30), (setup, prompt)
        drafted += sum(t.tokens_out for name, t in result.stats.tiers.items() if name.startswith("suffix"))
    assert drafted > 0  # the suffix drafter ran: the repeating prompt has long matches


def test_the_next_request_drafts_from_the_last_ones_output(tiny_family):
    # A prompt that never repeats itself: only what an earlier request produced can be matched.
    engine = _engine(tiny_family, ["suffix"], [[16]])
    prompt = random_prompts(1, 20, seed=33)[0]
    first = engine.generate(prompt, GenerationConfig(speculation="fixed", max_new_tokens=30))
    cache = engine.leaves.suffix("suffix").of("")  # in-process: one caller, one key's space
    assert cache.nodes > 0
    again = engine.generate(prompt, GenerationConfig(speculation="fixed", max_new_tokens=30))
    assert again.token_ids == first.token_ids
    assert again.stats.target_calls < first.stats.target_calls  # it drafted the output it saw before
    # a variant of the engine (as bench and tune make) starts with none of its requests
    assert engine.variant(["suffix"], [[16]]).leaves.suffix("suffix").held_tokens == 0


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


def test_bench_method_suffix_uses_the_configs_drafter_or_one_at_the_defaults(tiny_family):
    def suffix_tiers(config):
        (method,) = [m for m in parse_methods("suffix", config, [2]) if m.name == "suffix"]
        cascade = method.variants[0].cascade
        assert cascade.schedule.to_lists() == [[32]]  # the target reviews suffix drafts directly
        return cascade.drafters

    # A config without one (the real family's) is compared with suffix decoding at its defaults, run
    # over the config's loaded target: the target's own greedy tokens, drafted from its prompt...
    plain = make_cascade(ModelTierConfig("target", str(tiny_family["target"])), [MaGConfig()], [[4]], 1.0)
    assert suffix_tiers(plain) == (SuffixConfig(),)
    (method,) = [m for m in parse_methods("suffix", plain, [2]) if m.name == "suffix"]
    outcome = method.variants[0].run(Zoo(plain), REPEATING, 24)
    assert outcome.token_ids == oracle(tiny_family["target"], REPEATING, 24)
    assert outcome.tiers["suffix"]["drafted"] > 0  # it drafted (a random target rarely keeps a draft)
    # ...and a config's own suffix drafter keeps its settings (the bench measures what it serves).
    tuned = SuffixConfig(depth=12, min_prob=0.3)
    with_suffix = make_cascade(plain.target, [MaGConfig(), tuned], [[4, 4], [0, 0]], 1.0)
    assert suffix_tiers(with_suffix) == (tuned,)


def test_a_corpus_drafts_for_the_first_request(tiny_family, tmp_path):
    engine = _engine(tiny_family, ["suffix"], [[16]])
    prompt = random_prompts(1, 20, seed=34)[0]
    expected = oracle(tiny_family["target"], prompt, 30)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(engine.decode_text(prompt + expected))
    cascade = make_cascade(engine.cascade.target, [SuffixConfig(corpus=str(corpus), corpus_tokens=4096)], [[16]], 1.0)
    with_corpus = InProcess(cascade)
    assert with_corpus.leaves.suffix("suffix").held_tokens == 0  # read-only: no key's space holds it
    fresh = engine.generate(prompt, GenerationConfig(speculation="fixed", max_new_tokens=30))
    read = with_corpus.generate(prompt, GenerationConfig(speculation="fixed", max_new_tokens=30))
    assert fresh.token_ids == read.token_ids == expected
    # the corpus holds this very text (as its tokenizer reads it back), so it drafts most of it
    assert read.stats.target_calls < fresh.stats.target_calls


def test_a_corpus_longer_than_its_bound_is_refused(tiny_family, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x\n" * 200)
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        [SuffixConfig(corpus=str(corpus), corpus_tokens=50)],
        [[16]],
        1.0,
    )
    with pytest.raises(ConfigError, match=r"corpus: .* holds \d+ tokens, more than corpus_tokens \(50\)"):
        InProcess(cascade)


def test_mag_keeps_its_bigram_table_beside_suffix_decoding(tiny_family, tmp_path):
    # Issue 37: MaG listed before suffix decoding lost its bigram table. Each keeps its own.
    from cascade_service.core.proposers.mag import BigramTable
    from cascade_service.core.types import Context

    bigram = tmp_path / "bigram.json"
    BigramTable.from_tokens([5, 9, 5, 9, 7, 3], 320).save(bigram)
    for names in (["mag", "suffix"], ["suffix", "mag"]):
        drafters = [SuffixConfig() if n == "suffix" else MaGConfig(bigram=str(bigram)) for n in names]
        cascade = make_cascade(ModelTierConfig("target", str(tiny_family["target"])), drafters, [[4, 4], [0, 0]], 1.0)
        engine = InProcess(cascade)
        twin = engine.variant(names, [[4, 4], [0, 0]])  # reuses the table it loaded, not reloading it
        assert twin.leaves.leaves["mag"].bigram is engine.leaves.leaves["mag"].bigram is not None  # type: ignore[union-attr]
        tier = engine.leaves("")["mag"]
        # no earlier match of token 5 in the context: only the bigram table can propose 9 after it
        reply = tier.draft(_request(Context([1, 2, 5], 3), 2))
        assert reply.draft.tokens == [9, 5], names


def _request(ctx, k):
    from cascade_service.core.tier import DraftRequest

    return DraftRequest("r", ctx, k, k)


@pytest.mark.parametrize("order", [["close", "mag", "suffix"], ["close", "suffix", "mag"]])
def test_a_config_mixing_mag_and_suffix_decoding_equals_transformers_generate(tiny_family, order, tmp_path):
    from cascade_service.core.proposers.mag import BigramTable

    bigram = tmp_path / "bigram.json"
    BigramTable.from_tokens([t % 320 for t in range(2000)], 320).save(bigram)
    drafters = [
        SuffixConfig()
        if n == "suffix"
        else MaGConfig(bigram=str(bigram))
        if n == "mag"
        else ModelTierConfig(n, str(tiny_family[n]))
        for n in order
    ]
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        drafters,
        [[3, 0, 0], [0, 4, 4], [0, 0, 0]],
        1.5,
        Lookup(2, 12, "suffix"),
    )
    engine = InProcess(cascade)
    for prompt in PROMPTS:
        result = engine.generate(prompt, GenerationConfig(speculation="fixed", max_new_tokens=30))
        assert result.token_ids == oracle(tiny_family["target"], prompt, 30), (order, prompt)
        rows = result.stats.reviews["close"].row()["entries"]
        assert rows["mag"]["blocks"] > 0 and rows["suffix"]["blocks"] > 0
