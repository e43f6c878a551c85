"""Remote tiers without Ray: the coordinator's RemoteTier talking to TierGroups through a direct call.

The transport is the only thing Ray adds; everything that decides tokens is here. Greedy output
equals the oracle even when every call misses the replica's KV cache (it rebuilds from the context
the call carries); greedy messages carry no full-vocabulary tensors (invariant 5); sampling is
reproducible per seed, and gives the same tokens as the same tiers in this process: every message
crosses as the wire codec's bytes.
"""

from __future__ import annotations

import pytest

from cascade_service.config import MaGConfig, ModelTierConfig, make_cascade
from cascade_service.coordinator import Coordinator, Tokenizer
from cascade_service.core.cascade import Lookup
from cascade_service.engine.leaves import Leaves
from cascade_service.models.hf import load_tokenizer
from cascade_service.sessions import MemoryStore
from cascade_service.tierhost.group import TierGroup
from cascade_service.tierhost.subcascade import SubCascade
from cascade_service.transport.codec import decode_draft_reply, decode_review_reply
from cascade_service.transport.remote import RemoteTier
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle

PROMPTS = random_prompts(2, 10, seed=41)


def _model(group: TierGroup):
    return next(iter(group.servers.values())).model


def _coordinator(family, max_cached: int, log: list):
    tiers = {n: ModelTierConfig(n, str(family[n])) for n in ("target", "close", "mid")}
    servers = {n: TierGroup([t], max_cached_requests=max_cached) for n, t in tiers.items()}
    cascade = make_cascade(
        tiers["target"],
        [tiers["close"], tiers["mid"], MaGConfig()],
        [[4, 2, 0], [0, 2, 6], [0, 0, 6]],
        1.5,
        Lookup(2, 10),
    )

    def invoker(name):
        def invoke(method, data):
            assert isinstance(data, bytes)
            reply = getattr(servers[name], method)(data)
            log.append((name, method, reply))
            return reply

        return invoke

    tok = load_tokenizer(str(family["target"]))
    coordinator = Coordinator(
        cascade,
        Tokenizer(lambda t: list(tok(t)["input_ids"]), lambda ids: tok.decode(list(ids))),
        _model(servers["target"]).vocab_size,
        frozenset(_model(servers["target"]).eos_token_ids),
        tiers=lambda scope: {n: RemoteTier(n, scope.request_id, invoker(n)) for n in servers},
        store=MemoryStore(),
        leaves=Leaves(cascade.drafters, _model(servers["target"]).vocab_size),  # MaG runs here
    )
    return coordinator, servers


@pytest.mark.parametrize("max_cached", [256, 0], ids=["warm-caches", "every-call-misses"])
def test_remote_tiers_are_exact_with_and_without_cache_hits(tiny_family, max_cached):
    log: list = []
    coordinator, servers = _coordinator(tiny_family, max_cached, log)
    for prompt in PROMPTS:
        params = coordinator.params(prompt_ids=prompt, max_new_tokens=20)
        result = coordinator.generate(params)
        assert result.token_ids == oracle(tiny_family["target"], prompt, 20)
        assert result.stats.tiers["target"].hops == result.stats.target_calls  # one hop per target block
    drafts = [decode_draft_reply(reply) for _, m, reply in log if m == "draft"]
    reviews = [decode_review_reply(reply) for _, m, reply in log if m == "review"]
    served = [r for r in drafts + reviews if r is not None]  # None: "resend the whole context"
    assert served and all(r.draft.dists is None for r in drafts if r is not None)
    assert all(r.verdict.dists is None for r in reviews if r is not None)
    misses = sum(s.cache_misses for g in servers.values() for s in g.servers.values())
    resends = len(drafts) + len(reviews) - len(served)
    if max_cached == 0:
        assert misses == len(served)  # every call rebuilt its cache from the context it carried
        assert resends == len(served) - len(servers) * len(PROMPTS)  # each tier's first call sent it all
    else:
        assert misses <= len(servers) * len(PROMPTS) < len(served)  # one prefill per tier and request
        assert resends == 0
        assert all(s.cached_requests() == 0 for s in servers.values())  # released at the end


def test_remote_sampling_is_reproducible_per_seed(tiny_family):
    coordinator, _ = _coordinator(tiny_family, 256, [])
    runs = [
        coordinator.generate(
            coordinator.params(prompt_ids=PROMPTS[0], max_new_tokens=12, temperature=1.0, seed=s)
        ).token_ids
        for s in (7, 7, 8)
    ]
    assert runs[0] == runs[1] and len(runs[0]) == 12


def test_a_tier_group_runs_its_sub_cascade_in_one_call_and_stays_exact(tiny_family, tmp_path):
    from cascade_service.config import ServingConfig
    from cascade_service.core.proposers.mag import BigramTable
    from cascade_service.tierhost.subcascade import system_heads

    tiers = {n: ModelTierConfig(n, str(tiny_family[n])) for n in ("target", "close", "mid")}
    bigram = tmp_path / "bigram.json"
    BigramTable.from_tokens([t for p in random_prompts(20, 30, seed=3) for t in p], 320).save(bigram)
    # target reviews close's system; close reviews mid's; mid reviews MaG: close's whole sub-cascade
    # lies in the group {close, mid} + MaG, so one call drafts close's contribution
    cascade = make_cascade(
        tiers["target"],
        [tiers["close"], tiers["mid"], MaGConfig(bigram=str(bigram))],
        [[4, 0, 0], [0, 2, 0], [0, 0, 5]],
        2.0,
    )
    heads = system_heads(cascade, ServingConfig(groups=(("close", "mid"),)))  # the deployment's sub-cascades
    assert heads == {
        "close": SubCascade(("close", "mid", "mag"), ((2, 0), (0, 5)), 2.0),
        "mid": SubCascade(("mid", "mag"), ((5,),), 2.0),
    }
    assert (
        system_heads(
            make_cascade(
                tiers["target"], [tiers["close"], tiers["mid"], MaGConfig()], [[4, 2, 0], [0, 2, 0], [0, 0, 5]], 2.0
            ),
            ServingConfig(groups=(("close",),)),
        )
        == {}
    )
    target = TierGroup([tiers["target"]])
    group = TierGroup([tiers["close"], tiers["mid"]], str(bigram), systems={"close": heads["close"]})
    calls: list[str] = []

    def via(server):
        def invoke(method, data):
            calls.append(method)
            return getattr(server, method)(data)

        return invoke

    tok = load_tokenizer(str(tiny_family["target"]))
    coordinator = Coordinator(
        cascade,
        Tokenizer(lambda t: list(tok(t)["input_ids"]), lambda ids: tok.decode(list(ids))),
        target.servers["target"].model.vocab_size,
        frozenset(target.servers["target"].model.eos_token_ids),
        tiers=lambda scope: {
            "target": RemoteTier("target", scope.request_id, via(target)),
            "close": RemoteTier("close", scope.request_id, via(group), system=True),
            "mid": RemoteTier("mid", scope.request_id, via(group)),
        },
        store=MemoryStore(),
        leaves=Leaves(cascade.drafters, target.servers["target"].model.vocab_size),  # MaG, with its bigram table
    )
    for prompt in PROMPTS:
        result = coordinator.generate(coordinator.params(prompt_ids=prompt, max_new_tokens=20))
        assert result.token_ids == oracle(tiny_family["target"], prompt, 20)
        stats = result.stats
        assert stats.tiers["close"].hops > 0 and stats.tiers["mid"].hops == 0  # mid ran inside close's call
        assert stats.tiers["mid"].calls > 0 and stats.reviews["close"].reviews > 0  # its counters came back
    assert set(calls) == {"draft", "review", "release"}  # close's drafts are its whole system
    assert target.cached_requests() == group.cached_requests() == 0


def test_a_reviewing_tier_with_a_head_must_review_where_its_hidden_states_are(tiny_family):
    # SpecDec++ at a reviewing tier reads that tier's hidden states: the Ray app refuses, at build time,
    # a reviewing tier whose reviews would cross to another replica one block at a time.
    from cascade_service.config import ConfigError, ServingConfig
    from cascade_service.core.adaptive import AdaptiveLength
    from cascade_service.tierhost.subcascade import check_adaptive_reviewers

    tiers = {n: ModelTierConfig(n, str(tiny_family[n])) for n in ("target", "close", "mid")}
    adaptive = {"close": AdaptiveLength("specdec", 0.5, "head-dir")}
    cascade = make_cascade(
        tiers["target"],
        [tiers["close"], tiers["mid"], MaGConfig()],
        [[4, 0, 0], [0, 2, 0], [0, 0, 5]],
        2.0,
        None,
        adaptive,
    )
    with pytest.raises(ConfigError, match="schedule.adaptive.close: a reviewing tier"):
        check_adaptive_reviewers(cascade, ServingConfig())
    check_adaptive_reviewers(cascade, ServingConfig(colocate=("close",)))
    check_adaptive_reviewers(cascade, ServingConfig(groups=(("close", "mid"),)))
