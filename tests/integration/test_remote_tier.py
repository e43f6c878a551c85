"""Remote tiers without Ray: the coordinator's RemoteTier talking to TierServers through a direct call.

The transport is the only thing Ray adds; everything that decides tokens is here. Greedy output
equals the oracle even when every call misses the replica's KV cache (it rebuilds from the context
the call carries); greedy messages carry no full-vocabulary tensors (invariant 5); sampling is
reproducible per seed.
"""

from __future__ import annotations

import pytest

from cascade_service.config import MaGConfig, ModelTierConfig, make_cascade
from cascade_service.coordinator import Coordinator, Tokenizer
from cascade_service.core.cascade import Lookup
from cascade_service.models.hf import load_tokenizer
from cascade_service.models.tiny import random_prompts
from cascade_service.serving.remote import RemoteTier
from cascade_service.serving.tier import TierServer
from cascade_service.sessions import MemoryStore

from .test_oracle import _oracle

PROMPTS = random_prompts(2, 10, seed=41)


def _coordinator(family, max_cached: int, log: list):
    tiers = {n: ModelTierConfig(n, str(family[n])) for n in ("target", "close", "mid")}
    servers = {n: TierServer(t, max_cached_requests=max_cached) for n, t in tiers.items()}
    cascade = make_cascade(tiers["target"], [tiers["close"], tiers["mid"], MaGConfig()],
                           [[4, 2, 0], [0, 2, 6], [0, 0, 6]], 1.5, Lookup(2, 10))

    def invoker(name):
        def invoke(method, message):
            reply = getattr(servers[name], method)(message["request_id"] if method == "release" else message)
            log.append((name, method, reply))
            return reply
        return invoke

    tok = load_tokenizer(str(family["target"]))
    coordinator = Coordinator(
        cascade, Tokenizer(lambda t: list(tok(t)["input_ids"]), lambda ids: tok.decode(list(ids))),
        servers["target"].model.vocab_size, frozenset(servers["target"].model.eos_token_ids),
        tiers=lambda rid: {n: RemoteTier(n, rid, invoker(n)) for n in servers}, store=MemoryStore(),
        release=lambda tiers: [t.release() for t in tiers.values()])
    return coordinator, servers


@pytest.mark.parametrize("max_cached", [256, 0], ids=["warm-caches", "every-call-misses"])
def test_remote_tiers_are_exact_with_and_without_cache_hits(tiny_family, max_cached):
    log: list = []
    coordinator, servers = _coordinator(tiny_family, max_cached, log)
    for prompt in PROMPTS:
        params = coordinator.params(prompt_ids=prompt, max_new_tokens=20)
        result = coordinator.generate(params)
        assert result.token_ids == _oracle(tiny_family["target"], prompt, 20)
        assert result.stats.tiers["target"].hops == result.stats.target_calls  # one hop per target block
    calls = [(n, m) for n, m, _ in log if m != "release"]
    assert calls and all(reply["dists"] is None for _, m, reply in log if m in ("draft", "review"))
    misses = sum(s.cache_misses for s in servers.values())
    if max_cached == 0:
        assert misses == len(calls)  # every call rebuilt its cache from the context it carried
    else:
        assert misses <= len(servers) * len(PROMPTS) < len(calls)  # one prefill per tier and request
        assert all(s.cached_requests() == 0 for s in servers.values())  # released at the end


def test_remote_sampling_is_reproducible_per_seed(tiny_family):
    coordinator, _ = _coordinator(tiny_family, 256, [])
    runs = [coordinator.generate(coordinator.params(prompt_ids=PROMPTS[0], max_new_tokens=12, temperature=1.0, seed=s)).token_ids
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] and len(runs[0]) == 12


def test_a_tier_group_runs_its_sub_cascade_in_one_call_and_stays_exact(tiny_family, tmp_path):
    from cascade_service.config import ServingConfig
    from cascade_service.core.mag import BigramTable
    from cascade_service.serving.app import _system_heads
    from cascade_service.serving.remote import RemoteSystem
    from cascade_service.serving.tier import TierGroup

    tiers = {n: ModelTierConfig(n, str(tiny_family[n])) for n in ("target", "close", "mid")}
    bigram = tmp_path / "bigram.json"
    BigramTable.from_tokens([t for p in random_prompts(20, 30, seed=3) for t in p], 320).save(bigram)
    # target reviews close's system; close reviews mid's; mid reviews MaG: close's whole sub-cascade
    # lies in the group {close, mid} + MaG, so one call drafts close's contribution
    cascade = make_cascade(tiers["target"], [tiers["close"], tiers["mid"], MaGConfig(bigram=str(bigram))],
                           [[4, 0, 0], [0, 2, 0], [0, 0, 5]], 2.0)
    heads = _system_heads(cascade, ServingConfig(groups=(("close", "mid"),)))
    assert heads == {"close": {"tiers": ["close", "mid", "mag"], "k_matrix": [[2, 0], [0, 5]], "leniency": 2.0},
                     "mid": {"tiers": ["mid", "mag"], "k_matrix": [[5]], "leniency": 2.0}}
    assert _system_heads(make_cascade(tiers["target"], [tiers["close"], tiers["mid"], MaGConfig()],
                                      [[4, 2, 0], [0, 2, 0], [0, 0, 5]], 2.0), ServingConfig(groups=(("close",),))) == {}
    target, group = TierGroup([tiers["target"]]), TierGroup([tiers["close"], tiers["mid"]], str(bigram))
    calls: list[str] = []

    def via(server):
        def invoke(method, message):
            calls.append(method)
            return getattr(server, method)(message["request_id"] if method == "release" else message)
        return invoke

    tok = load_tokenizer(str(tiny_family["target"]))
    coordinator = Coordinator(
        cascade, Tokenizer(lambda t: list(tok(t)["input_ids"]), lambda ids: tok.decode(list(ids))),
        target.servers["target"].model.vocab_size, frozenset(target.servers["target"].model.eos_token_ids),
        tiers=lambda rid: {"target": RemoteTier("target", rid, via(target)),
                           "close": RemoteSystem("close", rid, via(group), **heads["close"]),
                           "mid": RemoteTier("mid", rid, via(group))},
        store=MemoryStore(), bigram=BigramTable.load(bigram), release=lambda ts: [t.release() for t in ts.values()])
    for prompt in PROMPTS:
        result = coordinator.generate(coordinator.params(prompt_ids=prompt, max_new_tokens=20))
        assert result.token_ids == _oracle(tiny_family["target"], prompt, 20)
        stats = result.stats
        assert stats.tiers["close"].hops > 0 and stats.tiers["mid"].hops == 0  # mid ran inside close's call
        assert stats.tiers["mid"].calls > 0 and stats.reviews["close"].reviews > 0  # its counters came back
    assert set(calls) == {"review", "system", "release"}
    assert target.cached_requests() == group.cached_requests() == 0


def test_a_reviewing_tier_with_a_head_must_review_where_its_hidden_states_are(tiny_family):
    # SpecDec++ at a reviewing tier reads that tier's hidden states: the Ray app refuses, at build time,
    # a reviewing tier whose reviews would cross to another replica one block at a time.
    from cascade_service.config import ConfigError, ServingConfig
    from cascade_service.core.adaptive import AdaptiveLength
    from cascade_service.serving.app import _check_adaptive_reviewers

    tiers = {n: ModelTierConfig(n, str(tiny_family[n])) for n in ("target", "close", "mid")}
    adaptive = {"close": AdaptiveLength("specdec", 0.5, "head-dir")}
    cascade = make_cascade(tiers["target"], [tiers["close"], tiers["mid"], MaGConfig()],
                           [[4, 0, 0], [0, 2, 0], [0, 0, 5]], 2.0, None, adaptive)
    with pytest.raises(ConfigError, match="schedule.adaptive.close: a reviewing tier"):
        _check_adaptive_reviewers(cascade, ServingConfig())
    _check_adaptive_reviewers(cascade, ServingConfig(colocate=("close",)))
    _check_adaptive_reviewers(cascade, ServingConfig(groups=(("close", "mid"),)))
