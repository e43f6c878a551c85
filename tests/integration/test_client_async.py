"""The async client SDK (AsyncCascadeClient) against the fake CascadeService (tests/helpers/fake_service.py) on a
grpc.aio server: every method, optional fields, status codes, deadlines, retries."""

from __future__ import annotations

import time

import grpc
import pytest

from cascade_service.api.status import RETRY_DELAY_S
from cascade_service.client import AsyncCascadeClient, SessionInfo, errors
from cascade_service.proto.v1 import cascade_pb2 as pb

from ..helpers.fake_service import API_KEY, OPTIONAL_FIELDS, STATUS_CASES, assert_maps, closed_port_target, run_async


def test_async_every_method_against_a_grpc_aio_server():
    async def scenario(target, state):
        async with AsyncCascadeClient(target, api_key=API_KEY) as client:
            result = await client.generate("def f():", session_id="s-9")
            assert (result.text, result.token_ids, result.session_id) == ("echo:def f():", [7, 8, 9], "s-9")
            assert result.stats["tiers"]["target"]["calls"] == 2
            chunks = [c async for c in client.stream("hi")]
            assert [c.text for c in chunks] == ["a", "b", "c"] and chunks[-1].finish_reason == "length"
            assert chunks[0].stats is None and chunks[-1].stats["generated_tokens"] == 3
            created = await client.create_session(prompt="ab", session_id="s-a")
            assert created == SessionInfo("s-a", [97, 98], 1, "ab")
            assert await client.get_session("s-a") == created
            assert await client.delete_session("s-a") is True
            assert await client.delete_session("s-a") is False
            assert await client.health() == "SERVING"

    state = run_async(scenario, api_key=API_KEY)
    assert [m["authorization"] for m in state.metadata] == [f"Bearer {API_KEY}"] * 6
    assert [f for f in OPTIONAL_FIELDS if state.requests[0].HasField(f)] == []


def test_async_given_optional_arguments_are_sent():
    async def scenario(target, state):
        async with AsyncCascadeClient(target) as client:
            await client.generate("x", max_new_tokens=8, temperature=0.0, top_p=1.0, seed=3, verification="exact")

    request = run_async(scenario).requests[-1]
    assert all(request.HasField(f) for f in OPTIONAL_FIELDS)
    assert (request.max_new_tokens, request.temperature, request.seed, request.verification.rule) == (8, 0, 3, "exact")


def test_async_each_status_code_raises_its_exception_class():
    async def scenario(target, state):
        async with AsyncCascadeClient(target) as client:
            for code_name, cls in STATUS_CASES:
                with pytest.raises(errors.CascadeError) as info:
                    await client.generate(f"fail:{code_name}")
                assert_maps(info.value, code_name, cls)

    run_async(scenario)


def test_async_deadline_and_mid_stream_errors_are_mapped():
    async def scenario(target, state):
        async with AsyncCascadeClient(target, timeout_s=0.05) as client:
            with pytest.raises(errors.DeadlineExceeded):
                await client.generate("sleep:0.5")
            with pytest.raises(errors.DeadlineExceeded):
                [c async for c in client.stream("sleep:0.5")]
            seen = []
            with pytest.raises(errors.Internal):
                async for chunk in client.stream("midstream:INTERNAL", timeout_s=5.0):
                    seen.append(chunk.text)
            assert seen == ["a"]
        async with AsyncCascadeClient(target) as client:
            with pytest.raises(errors.Unauthenticated):
                [c async for c in client.stream("fail:UNAUTHENTICATED")]

    run_async(scenario)


def test_async_get_session_retries_unavailable_but_generate_does_not():
    async def scenario(target, state):
        state.sessions["s"] = pb.Session(session_id="s", version=2)
        async with AsyncCascadeClient(target) as client:
            assert (await client.get_session("s")).version == 2
            with pytest.raises(errors.Unavailable):
                await client.generate("fail:UNAVAILABLE")

    state = run_async(scenario, get_session_failures=2)
    assert state.calls == {"GetSession": 3, "Generate": 1}


def test_async_get_session_waits_as_long_as_the_servers_retry_info_says():
    async def scenario(target, state):
        state.sessions["s"] = pb.Session(session_id="s", version=2)
        async with AsyncCascadeClient(target) as client:
            start = time.monotonic()
            assert (await client.get_session("s")).version == 2
            assert time.monotonic() - start >= 0.6  # two sleeps of the hinted 0.3 s, not the default 0.25 s in all

    assert run_async(scenario, get_session_failures=2, retry_after_s=0.3).calls == {"GetSession": 3}


def test_async_the_rich_details_reach_the_exception():
    # grpc.aio's AioRpcError hands its trailer over as grpc.aio.Metadata, not a tuple.
    async def scenario(target, state):
        message = "max_new_tokens: asked to fail with INVALID_ARGUMENT"
        async with AsyncCascadeClient(target) as client:
            with pytest.raises(errors.InvalidArgument) as info:
                await client.generate("rich:INVALID_ARGUMENT")
            assert info.value.field_violations == (errors.FieldViolation("max_new_tokens", message),)
            with pytest.raises(errors.InvalidArgument) as info:
                [c async for c in client.stream("rich:INVALID_ARGUMENT")]
            assert info.value.field_violations == (errors.FieldViolation("max_new_tokens", message),)
            with pytest.raises(errors.Unavailable) as info:
                await client.generate("rich:UNAVAILABLE")
            assert info.value.retry_delay_s == RETRY_DELAY_S[grpc.StatusCode.UNAVAILABLE]

    run_async(scenario)


def test_async_unreachable_server_raises_unavailable():
    async def scenario(target, state):
        async with AsyncCascadeClient(closed_port_target(), timeout_s=5.0) as client:
            with pytest.raises(errors.Unavailable):
                await client.health()

    run_async(scenario)
