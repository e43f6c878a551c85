"""Tiers as gRPC services of their own (cascade.tier.v1.Tier), reached by address.

Every tier remote, over real gRPC on loopback: greedy output equals plain `transformers` greedy
decoding; a model with its sub-cascade in one server; MaG on a server of its own; contexts cross as
deltas (the bytes a round costs do not grow with the sequence).
"""

from __future__ import annotations

import pytest

from cascade_service.config import GenerationConfig
from cascade_service.inprocess import InProcess
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle
from ..helpers.threads import soon
from ..helpers.tier_servers import addressed, running, serve_group, tiny_cascade

PROMPTS = random_prompts(2, 10, seed=43)


def _generate(engine: InProcess, prompt, n=20, **gen):
    return engine.generate(prompt, GenerationConfig(max_new_tokens=n, **{"speculation": "fixed", **gen}))


def test_every_tier_remote_is_exact(tiny_family):
    cascade = tiny_cascade(tiny_family)
    servers = {name: serve_group(cascade, [name]) for name in ("target", "close", "mid", "mag")}
    with running(*servers.values()):
        engine = InProcess(addressed(cascade, servers))
        assert engine.models() == []  # no weights here
        for prompt in PROMPTS:
            result = _generate(engine, prompt)
            assert result.token_ids == oracle(tiny_family["target"], prompt, 20)
            assert result.stats.tiers["target"].hops == result.stats.target_calls
        assert result.stats.tiers["mag"].calls > 0  # MaG drafted on its server
        # Released at the end of each request (fire and forget): the servers soon hold nothing.
        assert soon(lambda: all(s.service.group.cached_requests() == 0 for s in servers.values()))
        assert all(s.service.group.cached_contexts() == 0 for s in servers.values())


def test_a_sub_cascade_server_runs_in_one_call_per_block(tiny_family):
    cascade = tiny_cascade(tiny_family)
    below = serve_group(cascade, ["close", "mid", "mag"])  # close reviews mid and MaG in its server
    with running(below):
        assert set(below.service.group.systems) == {"close", "mid"}  # mid reviews MaG, close both
        engine = InProcess(addressed(cascade, {"close": below, "mid": below, "mag": below}))
        for prompt in PROMPTS:
            result = _generate(engine, prompt)
            assert result.token_ids == oracle(tiny_family["target"], prompt, 20)
            stats = result.stats
            assert stats.tiers["close"].hops == stats.tiers["close"].calls and stats.reviews["close"].reviews > 0


def test_sampled_tokens_are_the_same_remote_as_in_process(tiny_family):
    cascade = tiny_cascade(tiny_family)
    local = InProcess(cascade)
    servers = {name: serve_group(cascade, [name]) for name in ("target", "close")}
    with running(*servers.values()):
        remote = InProcess(addressed(cascade, servers))
        for seed in (3, 4):
            gen = {"temperature": 1.0, "seed": seed}
            assert (
                _generate(remote, PROMPTS[0], 16, **gen).token_ids == _generate(local, PROMPTS[0], 16, **gen).token_ids
            )


def test_a_round_sends_the_new_tokens_not_the_whole_context(tiny_family, monkeypatch):
    from cascade_service.proto.tier.v1 import tier_pb2
    from cascade_service.transport import remote as remote_module

    sent: list = []
    original = remote_module.RemoteTier._invoke

    def spy(self, method, data):
        if method == "review":  # how many context tokens the call carries (the block rides beside them)
            sent.append((self.name, len(tier_pb2.ReviewRequest.FromString(data).context.tokens)))
        return original(self, method, data)

    monkeypatch.setattr(remote_module.RemoteTier, "_invoke", spy)
    cascade = tiny_cascade(tiny_family, mag=False)
    server = serve_group(cascade, ["target"])
    with running(server):
        engine = InProcess(addressed(cascade, {"target": server}))
        long_prompt = list(range(1, 200))
        _generate(engine, long_prompt, 24)
    reviews = [n for name, n in sent if name == "target"]
    assert len(reviews) > 3
    # The first call carries the 199-token prompt; later ones only the tokens after what the server
    # holds (at most the 24 new tokens of the whole request).
    assert reviews[0] >= 199 and max(reviews[1:]) <= 24


def test_a_tier_the_server_does_not_host_fails_at_start(tiny_family):
    from cascade_service.config import ConfigError

    cascade = tiny_cascade(tiny_family)
    server = serve_group(cascade, ["mid"])
    with running(server), pytest.raises(ConfigError, match="hosts mid, not 'close'"):
        InProcess(addressed(cascade, {"close": server}))


def test_the_distribution_is_exact_with_remote_tiers_over_grpc():
    # Toy tiers behind a real tier server: rows, seeds and verdicts cross gRPC, contexts as deltas.
    from cascade_service.core.sampling import SamplingParams
    from cascade_service.tierhost.server import start_tier_server
    from cascade_service.transport.client import TierReplicas
    from cascade_service.transport.remote import RemoteTier

    from ..helpers.tier_servers import HostedTiers
    from ..helpers.toy import chi_square_rejects
    from ..helpers.toy_cascade import CASES, SAMPLES, VOCAB, sample_cascade

    hosted = HostedTiers(VOCAB)
    server = start_tier_server(hosted)
    replicas = TierReplicas([f"127.0.0.1:{server.port}"])

    def remote(tier, request_id):  # every drafter on the tier server; the target here
        if tier.name == "target":
            return tier
        hosted.register(tier, request_id)
        return RemoteTier(tier.name, request_id, replicas.invoker(request_id), system=tier.system)

    names, k, leniency = CASES["csd_base_small_mag_lenient"]
    with running(server):
        # Half the in-process test's samples: each costs a few loopback gRPC calls.
        counts, expected = sample_cascade(names, k, leniency, SamplingParams(1.0), samples=SAMPLES // 2, wrap=remote)
    rejects, stat, crit = chi_square_rejects(counts, expected, SAMPLES // 2)
    assert not rejects, f"chi-square {stat:.1f} > critical {crit:.1f}: output is not the target's distribution"
