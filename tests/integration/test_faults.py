"""Faults at the API (issue 6): what a client sees when a dependency fails, over real gRPC.

Redis down: session calls get UNAVAILABLE fast, while stateless generation keeps working and stays
exact; when Redis is back, session calls work again.
"""

from __future__ import annotations

import time

import pytest

from cascade_service.api.server import start_server
from cascade_service.client import CascadeClient, errors
from cascade_service.config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.inprocess import InProcess
from cascade_service.sessions.redis_store import RedisStore
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle
from ..redis_server import RedisServer


def test_redis_down_fails_session_calls_while_stateless_generation_stays_exact(tiny_family):
    prompt = random_prompts(1, 40, seed=91)[0]
    expected = oracle(tiny_family["target"], prompt, 12)
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        [ModelTierConfig("mid", str(tiny_family["mid"])), MaGConfig()],
        [[3, 1], [0, 3]],
        1.5,
    )
    engine = InProcess(cascade)
    with RedisServer() as redis:
        store = RedisStore(redis.url, namespace="faults", socket_timeout_s=1.0)
        server, port = start_server(engine.coordinator(store, GenerationConfig(max_new_tokens=12)))
        try:
            with CascadeClient(f"127.0.0.1:{port}", timeout_s=60) as client:
                session = client.create_session(prompt_token_ids=prompt)
                assert client.generate(prompt_token_ids=prompt).token_ids == expected  # its blocks are cached
                redis.stop()
                for call in (
                    lambda: client.get_session(session.session_id),
                    lambda: client.create_session(prompt_token_ids=[1, 2]),
                    lambda: client.generate(session_id=session.session_id, prompt_token_ids=[3]),
                    lambda: client.delete_session(session.session_id),
                ):
                    start = time.monotonic()
                    with pytest.raises(errors.Unavailable):
                        call()
                    assert time.monotonic() - start < 10  # fails fast, no hang
                stateless = client.generate(prompt_token_ids=prompt)  # unaffected, and served from the cache
                assert stateless.token_ids == expected
                assert stateless.stats["cached_prompt_tokens"] == 32
                redis.start()  # same port, no persistence: old sessions are gone, new ones work
                fresh = client.create_session(prompt_token_ids=prompt)
                result = client.generate(session_id=fresh.session_id, prompt_token_ids=[], max_new_tokens=12)
                assert result.token_ids == expected
                assert list(client.get_session(fresh.session_id).token_ids) == prompt + expected
        finally:
            server.stop(0)
            store.close()
