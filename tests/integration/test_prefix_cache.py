"""Sessions and shared prefixes keep their KV in every tier (models.kvpool), exactly.

Greedy output is checked against plain `transformers` greedy decoding of the whole context (the
oracle), with the prefix cache warm, in every shape of cascade; the hit counters show that a turn
reads only its new tokens; a prefix cached under one API key is never found under another; tier
replicas over gRPC serve a session's turns where its blocks are, and a turn whose replica died is
served by another, exactly, re-reading the session from the store.
"""

from __future__ import annotations

import pytest

from cascade_service.config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.core.cascade import Lookup
from cascade_service.inprocess import InProcess
from cascade_service.models.kvpool import BLOCK
from cascade_service.sessions import MemoryStore
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle
from ..helpers.threads import soon
from ..helpers.tier_servers import addressed, running, serve_group, tiny_cascade

N = 12


def _turns(count: int, length: int, seed: int) -> list[list[int]]:
    return random_prompts(count, length, seed=seed)


def _converse(coordinator, family, turns, owner: str = ""):
    """A session over `turns`: each turn's tokens against the oracle; yields each turn's stats."""
    record = coordinator.create_session(owner=owner)
    history: list[int] = []
    for turn in turns:
        params = coordinator.params(
            session_id=record.session_id,
            prompt_ids=turn,
            max_new_tokens=N,
            temperature=0,
            owner=owner,
            speculation="fixed",  # every tier drafts every round, so each one's cache is read
        )
        result = coordinator.generate(params)
        assert result.token_ids == oracle(family["target"], history + turn, N)
        history += turn + result.token_ids
        yield result.stats, len(history) - len(result.token_ids) - len(turn)


def test_a_conversation_reads_only_its_new_tokens_in_every_model_tier(tiny_family):
    cascade = tiny_cascade(tiny_family)
    coordinator = InProcess(cascade).coordinator(MemoryStore())
    for i, (stats, before) in enumerate(_converse(coordinator, tiny_family, _turns(4, 40, seed=1))):
        for name in ("target", "close", "mid"):
            tier = stats.tiers[name]
            if i == 0:
                assert tier.tokens_cached == 0
            else:  # the history, to the block (its last partial block and the new turn are read), or
                # for a drafter what it held of it: the last round's tokens reach it only if they were its
                # own. The history's last token (the last round's bonus) was never fed to any tier.
                whole = (before - 1) // BLOCK * BLOCK
                assert tier.tokens_cached == whole if name == "target" else tier.tokens_cached >= whole - BLOCK


SHAPES = {
    "sd": (["mid"], [[5]]),
    "vertical": (["close", "mid"], [[4, 0], [0, 4]]),
    "horizontal": (["close", "mid"], [[3, 3], [0, 0]]),
    "mag-gate": (["close", "mid", "mag"], [[4, 2, 0], [0, 2, 6], [0, 0, 6]]),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_is_exact_with_the_cache_warm(tiny_family, shape):
    names, k_matrix = SHAPES[shape]
    tiers = {n: MaGConfig() if n == "mag" else ModelTierConfig(n, str(tiny_family[n])) for n in names}
    lookup = Lookup(2) if shape == "mag-gate" else None
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])), [tiers[n] for n in names], k_matrix, 1.5, lookup
    )
    engine = InProcess(cascade)
    header = random_prompts(1, 3 * BLOCK, seed=5)[0]
    for tail in random_prompts(3, 7, seed=6):
        prompt = header + tail
        result = engine.generate(prompt, GenerationConfig(speculation="fixed", max_new_tokens=N))
        assert result.token_ids == oracle(tiny_family["target"], prompt, N)
    model_tiers = ["target", *(n for n in names if n != "mag")]
    assert all(result.stats.tiers[n].tokens_cached == 3 * BLOCK for n in model_tiers)


def test_a_prefix_cached_for_one_key_is_never_found_for_another(tiny_family):
    coordinator = InProcess(tiny_cascade(tiny_family)).coordinator(MemoryStore())
    prompt = random_prompts(1, 50, seed=7)[0]

    def cached(owner: str) -> dict[str, int]:
        params = coordinator.request(prompt, GenerationConfig(speculation="fixed", max_new_tokens=4), owner=owner)
        stats = coordinator.generate(params).stats
        return {n: stats.tiers[n].tokens_cached for n in ("target", "close", "mid")}

    assert cached("alice") == dict.fromkeys(("target", "close", "mid"), 0)
    assert cached("bob") == dict.fromkeys(("target", "close", "mid"), 0)  # alice's blocks are not bob's
    assert cached("") == dict.fromkeys(("target", "close", "mid"), 0)  # nor the anonymous space's
    assert cached("alice") == dict.fromkeys(("target", "close", "mid"), 48)


def test_tier_replicas_serve_a_session_where_its_blocks_are_and_fail_over_exactly(tiny_family):
    cascade = tiny_cascade(tiny_family)
    replicas = [serve_group(cascade, ["target"]) for _ in range(2)]
    with running(*replicas):
        coordinator = InProcess(addressed(cascade, {"target": replicas})).coordinator(MemoryStore())
        turns = _converse(coordinator, tiny_family, _turns(5, 40, seed=2))

        def hits() -> list[int]:
            return [r.service.group.servers["target"].model.kv_pool.counters.hits for r in replicas]

        def turn():
            # A release is fire and forget: the turn's last blocks are published once it arrives (a
            # client's next turn comes after it has read this one).
            result = next(turns)
            live = [r for r in replicas if r.port in alive]
            assert soon(lambda: all(r.service.group.cached_requests() == 0 for r in live))
            return result

        alive = {r.port for r in replicas}
        turn()
        for _ in range(2):  # every later turn on the same replica, reading the history from its cache
            stats, before = turn()
            assert stats.tiers["target"].tokens_cached == (before - 1) // BLOCK * BLOCK
        owner = max(range(2), key=lambda i: hits()[i])
        assert hits()[1 - owner] == 0
        replicas[owner].stop()
        alive.discard(replicas[owner].port)
        stats, _ = turn()  # on the other replica: the whole session read again, exactly
        assert stats.tiers["target"].tokens_cached == 0
        stats, before = turn()
        assert stats.tiers["target"].tokens_cached == (before - 1) // BLOCK * BLOCK
