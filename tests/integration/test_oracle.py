"""Greedy exactness against an independent oracle (invariant 1).

For every drafter set, K-matrix and leniency, the cascade's greedy output equals plain
`transformers` `generate(do_sample=False)` of the target, token for token. Drafters include ones
that agree with the target often (its weights plus noise) and an unrelated one, so both the accept
and the reject paths run. Requests run their K-matrix every round (speculation "fixed"), so every
path runs whatever the floor would decide; the floor's own exactness is tests/integration/test_floor.py's.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from cascade_service.config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.core.cascade import Lookup
from cascade_service.core.proposers.mag import BigramTable
from cascade_service.inprocess import InProcess
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import make_engine, oracle

SHORT = random_prompts(1, 3, seed=11)[0]  # shorter than MaG's 16-token match window
LONG = random_prompts(1, 24, seed=12)[0] * 2  # 48 tokens, repeats itself: MaG finds long matches
MEDIUM = random_prompts(1, 20, seed=13)[0]

# (drafters, K-matrix); "close"/"mid" are target + noise, "unrelated" is an independent init.
SETUPS = {
    "sd_close": (["close"], [[4]]),
    "sd_unrelated": (["unrelated"], [[3]]),
    "csd_close_mag": (["close", "mag"], [[4, 2], [0, 6]]),
    "csd_mid_mag_llama_paper_shape": (["mid", "mag"], [[7, 5], [0, 5]]),  # [[13,10],[0,10]] scaled down
    "csd_close_mid_mag": (["close", "mid", "mag"], [[4, 2, 0], [0, 2, 6], [0, 0, 6]]),
    "csd_close_mid_mag_t5_paper_shape": (["close", "mid", "mag"], [[3, 7, 5], [0, 1, 5], [0, 0, 5]]),
    "csd_close_unrelated_mag": (["close", "unrelated", "mag"], [[3, 3, 2], [0, 3, 4], [0, 0, 4]]),
    # Overshoot: mid reviews MaG while close asks it for a single token (a row that never ran while
    # inner blocks were capped at what the parent still needed; the demo's K until its re-tune).
    "csd_close_mid_mag_overshoot_shape": (["close", "mid", "mag"], [[3, 0, 0], [0, 1, 0], [0, 0, 4]]),
    # The demo's K (configs/demo.yaml): the middle tier reviews both the small tier and MaG.
    "csd_close_mid_mag_demo_shape": (["close", "mid", "mag"], [[1, 0, 0], [0, 1, 5], [0, 0, 4]]),
}


@pytest.fixture(scope="module")
def oracle_cache(tiny_family):
    cache = {}

    def get(prompt, n, eos=None):
        key = (tuple(prompt), n, eos)
        if key not in cache:
            cache[key] = oracle(tiny_family["target"], prompt, n, eos)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def bigram_path(tiny_family, tmp_path_factory):
    stream = [t for p in random_prompts(50, 40, seed=3) for t in p]
    path = tmp_path_factory.mktemp("mag") / "bigram.json"
    BigramTable.from_tokens(stream, 320).save(path)
    return str(path)


@pytest.mark.parametrize("leniency", [1.0, 1.5, 3.0])
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_greedy_cascade_equals_transformers_generate(tiny_family, oracle_cache, bigram_path, setup, leniency):
    names, k_matrix = SETUPS[setup]
    engine = make_engine(tiny_family, names, k_matrix, leniency, bigram_path)
    for prompt in (SHORT, LONG):
        result = engine.generate(prompt, GenerationConfig(speculation="fixed", max_new_tokens=40))
        expected = oracle_cache(prompt, 40)
        assert result.token_ids == expected
        assert result.stats.target_calls <= len(expected)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_greedy_cascade_through_the_wire_codec_equals_transformers_generate(
    tiny_family, oracle_cache, bigram_path, setup
):
    # Every tier behind the codec: each draft, review and release crosses as bytes, as to a remote tier.
    names, k_matrix = SETUPS[setup]
    engine = make_engine(
        tiny_family, names, k_matrix, 1.5, bigram_path, Lookup(2, 8) if "mag" in names else None, loopback=True
    )
    for prompt in (SHORT, LONG):
        result = engine.generate(prompt, GenerationConfig(speculation="fixed", max_new_tokens=40))
        assert result.token_ids == oracle_cache(prompt, 40)
        assert result.stats.tiers["target"].hops == result.stats.target_calls  # it went through the wire


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_every_k_matrix_entry_runs_and_is_counted(tiny_family, oracle_cache, bigram_path, setup):
    # Invariant 7: each drafter the K-matrix names drafts, and each reviewer with a row reviews, with
    # the counts in stats.tiers; the output stays the target's own.
    names, k_matrix = SETUPS[setup]
    engine = make_engine(tiny_family, names, k_matrix, 1.5, bigram_path)
    result = engine.generate(LONG, GenerationConfig(speculation="fixed", max_new_tokens=40))
    assert result.token_ids == oracle_cache(LONG, 40)
    tiers = result.stats.to_dict()["tiers"]
    assert set(tiers) == {"target", *names}
    for name in names:
        assert tiers[name]["calls"] > 0 and tiers[name]["drafted"] > 0, (name, tiers)
        assert 0 <= tiers[name]["accepted"] <= tiers[name]["drafted"]
    for r, row in enumerate(k_matrix[1:], 1):
        if any(row):  # a reviewing drafter: it saw blocks from every tier its row names
            seen = result.stats.reviews[names[r - 1]].drafted_by_drafter
            assert {names[c] for c, q in enumerate(row) if q} <= set(seen), (names[r - 1], seen)
    assert tiers["target"]["drafted"] == 0 and tiers["target"]["calls"] == result.stats.target_calls


@pytest.mark.parametrize("lookup", [Lookup(1, 3), Lookup(2, 10), Lookup(4, 25)], ids=str)
@pytest.mark.parametrize("setup", ["csd_close_mid_mag", "csd_unrelated_mag"])
def test_mag_lookup_gate_at_the_target_is_exact(tiny_family, oracle_cache, bigram_path, setup, lookup):
    # The gate's use of MaG is counted apart (tier `mag_lookup`), so its tokens are told from MaG's
    # K-matrix ones; row 0 gives MaG nothing anyway.
    names, k_matrix = {
        "csd_close_mid_mag": SETUPS["csd_close_mid_mag"],
        "csd_unrelated_mag": (["unrelated", "mag"], [[3, 0], [0, 4]]),
    }[setup]
    engine = make_engine(tiny_family, names, k_matrix, 2.0, bigram_path, lookup)
    gated = 0
    for prompt in (SHORT, LONG, MEDIUM):
        for n in (7, 40):
            result = engine.generate(prompt, GenerationConfig(speculation="fixed", max_new_tokens=n))
            assert result.token_ids == oracle_cache(prompt, n)
            by_drafter = result.stats.reviews["target"].drafted_by_drafter
            assert "mag" not in by_drafter  # row 0 gives MaG nothing: it reaches the target only by the gate
            gated += by_drafter.get("mag_lookup", 0)
    assert gated > 0  # the gate opened: MaG's continuation went to the target unreviewed by "close"


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 13, 31])
def test_max_new_tokens_reached_inside_a_block_is_exact(tiny_family, oracle_cache, max_new_tokens):
    names, k_matrix = SETUPS["csd_close_mid_mag"]
    engine = make_engine(tiny_family, names, k_matrix, 1.5)
    result = engine.generate(MEDIUM, GenerationConfig(speculation="fixed", max_new_tokens=max_new_tokens))
    assert result.token_ids == oracle_cache(MEDIUM, max_new_tokens)
    assert len(result.token_ids) == max_new_tokens


@pytest.mark.parametrize("setup", ["sd_close", "csd_close_mag", "csd_close_mid_mag"])
def test_eos_inside_a_draft_block_stops_exactly_there(tiny_family, oracle_cache, setup):
    # Use as EOS a token the target emits mid-way through its greedy output, so EOS arrives inside a
    # multi-token round; the oracle is told the same EOS.
    free = oracle_cache(LONG, 40)
    eos = free[9]
    expected = oracle_cache(LONG, 40, eos)
    assert expected[-1] == eos and len(expected) < 40
    names, k_matrix = SETUPS[setup]
    engine = make_engine(tiny_family, names, k_matrix, 1.0)
    engine.eos_ids = frozenset({eos})
    chunks = list(engine.stream(LONG, GenerationConfig(speculation="fixed", max_new_tokens=40)))
    assert [t for c in chunks for t in c] == expected
    assert len(chunks[-1]) >= 2, "EOS should have come inside an accepted draft block"


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_greedy_cascade_is_exact_on_other_architectures(tiny_family_factory, arch):
    family = tiny_family_factory(arch)
    for names, k_matrix in (SETUPS["sd_close"], SETUPS["csd_close_mid_mag"]):
        engine = make_engine(family, names, k_matrix, 2.0)
        for prompt in (SHORT, LONG):
            assert engine.generate(
                prompt, GenerationConfig(speculation="fixed", max_new_tokens=30)
            ).token_ids == oracle(family["target"], prompt, 30)


def test_kv_caches_never_reprefill_the_prefix(tiny_family, oracle_cache):
    # Invariant 4: work per token does not grow with the output. The target feeds at most
    # prompt + generated + drafted tokens; a drafter at most prompt + generated + the tokens it
    # reviewed + the tokens it emitted. A re-prefill per round would add ~48 tokens per round.
    names, k_matrix = SETUPS["csd_close_mid_mag"]
    engine = make_engine(tiny_family, names, k_matrix, 1.5)
    result = engine.generate(LONG, GenerationConfig(speculation="fixed", max_new_tokens=60))
    stats = result.stats
    assert result.token_ids == oracle_cache(LONG, 60)
    base = len(LONG) + stats.generated
    target = stats.tiers["target"]
    assert target.tokens_processed <= base + stats.reviews["target"].drafted
    for name in ("close", "mid"):
        tier = stats.tiers[name]
        reviewed = stats.reviews[name].drafted if name in stats.reviews else 0
        assert tier.tokens_processed <= base + reviewed + tier.tokens_out, name
    assert stats.target_calls > 5  # several rounds happened, so a re-prefill would have shown


def _generate(target_dir, prompt, max_new_tokens, dtype):
    model = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True, dtype=dtype).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return model, out[0, len(prompt) :].tolist()


def _mixed_engine(family, target_dtype, drafter_dtype):
    names, k_matrix = SETUPS["csd_close_mid_mag"]
    drafters = [MaGConfig() if n == "mag" else ModelTierConfig(n, str(family[n]), drafter_dtype) for n in names]
    return InProcess(
        make_cascade(ModelTierConfig("target", str(family["target"]), target_dtype), drafters, k_matrix, 1.5)
    )


@pytest.mark.parametrize("drafter_dtype", ["bfloat16", "float16"])
def test_greedy_cascade_with_low_precision_drafters_equals_transformers_generate(
    tiny_family, oracle_cache, drafter_dtype
):
    # Invariant 6: drafters' dtypes change what they propose, never what the float32 target emits.
    engine = _mixed_engine(tiny_family, "float32", drafter_dtype)
    for prompt in (SHORT, LONG):
        assert engine.generate(
            prompt, GenerationConfig(speculation="fixed", max_new_tokens=40)
        ).token_ids == oracle_cache(prompt, 40)


def _ulp(value: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7)  # bfloat16 keeps 8 significant bits


def test_greedy_cascade_with_a_bfloat16_target_is_its_argmax_path_up_to_bfloat16_ties(tiny_family):
    # Invariant 6 against the bf16 target itself. Its logits are bf16 numbers, so two tokens often tie
    # exactly, and which of them argmax meets first depends on how a pass was shaped: the target scoring
    # a block of k + 1 tokens rounds differently from generate() feeding one token at a time. So the
    # cascade must equal generate() up to the first position where the two part, part only at a tie,
    # and emit, at every position, a token that ties the maximum of the target's own (uncached) logits.
    engine = _mixed_engine(tiny_family, "bfloat16", "float32")
    for prompt in (SHORT, LONG, MEDIUM):
        got = engine.generate(prompt, GenerationConfig(speculation="fixed", max_new_tokens=40)).token_ids
        model, expected = _generate(tiny_family["target"], prompt, 40, torch.bfloat16)
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + got])).logits[0, len(prompt) - 1 : -1].float()  # [40, V]
            part = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
            if part is not None:
                row = model(torch.tensor([prompt + got[:part]])).logits[0, -1].float()
                assert abs(float(row[got[part]] - row[expected[part]])) <= _ulp(float(row.max())), (prompt, part)
        best = logits.max(dim=-1).values
        chosen = logits[torch.arange(len(got)), got]
        assert all(float(b - c) <= _ulp(float(b)) for b, c in zip(best, chosen)), prompt
