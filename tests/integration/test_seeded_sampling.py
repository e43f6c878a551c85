"""A seed fixes a sampled output on the served path, whatever drafts, at any load (issue 59, point 0).

A user sends the same seeded request at T > 0 to a plain server and to a cascade server under each
speculation mode ("off", the K-matrix as "fixed", the default "auto": the floor over load
adaptation), alone and while 8 other streams run: every reply has the same tokens. Before draws were
keyed by position (core.sampling `race`) the floor's choice of drafting or not, and every draft,
changed which random draws a token took, so the same seed gave other tokens.
"""

from __future__ import annotations

import threading

import pytest

from cascade_service.client import CascadeClient
from cascade_service.config import MaGConfig, ModelTierConfig, make_cascade
from cascade_service.core.cascade import Lookup
from cascade_service.zoo.tiny import random_prompts

from ..helpers.threads import concurrently
from ..helpers.tier_servers import beside_plain

PROMPTS = random_prompts(3, 24, seed=59)
OTHERS = random_prompts(8, 30, seed=590)
NEW = 24
SAMPLINGS = [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}]


@pytest.fixture(scope="module")
def servers(tiny_family):
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        [
            ModelTierConfig("close", str(tiny_family["close"])),
            ModelTierConfig("mid", str(tiny_family["mid"])),
            MaGConfig(),
        ],
        [[3, 2, 0], [0, 2, 3], [0, 0, 4]],
        1.5,
        lookup=Lookup(2, 8),
    )
    with beside_plain(cascade) as pair:  # the default: the floor over load adaptation
        yield pair


def _replies(client: CascadeClient, prompt: list[int], seed: int, sampling: dict) -> dict[str, list[int]]:
    return {
        mode: client.generate(
            prompt_token_ids=prompt, max_new_tokens=NEW, seed=seed, speculation=mode, **sampling
        ).token_ids
        for mode in ("off", "fixed", "auto")
    }


def test_a_seeded_request_gives_the_same_tokens_under_every_mode_alone_and_beside_8_streams(servers):
    served, plain = servers
    with (
        CascadeClient(f"127.0.0.1:{served.port}", timeout_s=120) as cascade,
        CascadeClient(f"127.0.0.1:{plain.port}", timeout_s=120) as target,
    ):
        expected = {
            (i, s, seed): target.generate(prompt_token_ids=p, max_new_tokens=NEW, seed=seed, **sampling).token_ids
            for i, p in enumerate(PROMPTS)
            for s, sampling in enumerate(SAMPLINGS)
            for seed in (3, 4)
        }
        drafted = 0
        for (i, s, seed), tokens in expected.items():
            for mode, got in _replies(cascade, PROMPTS[i], seed, SAMPLINGS[s]).items():
                assert got == tokens, ("alone", mode, i, s, seed)
            reply = cascade.generate(
                prompt_token_ids=PROMPTS[i], max_new_tokens=NEW, seed=seed, speculation="fixed", **SAMPLINGS[s]
            )
            drafted += reply.stats["drafted_rounds"]
        assert drafted > 0  # the K-matrix drafted: the tokens were equal with drafts in play

        # Under load: 8 other sampled streams on the same server the whole time.
        done = threading.Event()

        def stream(j: int) -> None:
            n = 0
            while not done.is_set():
                cascade.generate(prompt_token_ids=OTHERS[j], max_new_tokens=16, temperature=1.0, seed=1000 * j + n)
                n += 1

        others = threading.Thread(target=lambda: concurrently(8, stream))
        others.start()
        try:
            for (i, s, seed), tokens in expected.items():
                if seed != 3:
                    continue
                for mode, got in _replies(cascade, PROMPTS[i], seed, SAMPLINGS[s]).items():
                    assert got == tokens, ("beside 8 streams", mode, i, s, seed)
        finally:
            done.set()
            others.join()
