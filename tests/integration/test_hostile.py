"""The standalone server's front end against hostile clients: idle calls, slow and missing bodies, bytes
that are no message, keys checked before the body, per-key and pending limits, health under load.

The clients here are raw grpc.aio calls over loopback (no SDK): they send headers and then nothing, or
bytes of their own choosing, as a hostile client would. Each idle call is a separate HTTP/2 stream;
several channels with their own connections carry them, so the per-connection limit is not what holds
them back.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from cascade_service.api.admission import Limits
from cascade_service.api.server import start_server
from cascade_service.config import (
    GenerationConfig,
    MaGConfig,
    ModelTierConfig,
    make_cascade,
)
from cascade_service.inprocess import InProcess
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.rpc.auth import ApiKeys
from cascade_service.sessions import MemoryStore
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle
from ..helpers.raw_grpc import (
    CASCADE_METHODS,
    GENERATE,
    HEALTH,
    REFLECTION,
    STREAMING,
    health_check,
    idle_call,
    own_channel,
    raw_call,
    violated_fields,
)

PROMPT = random_prompts(1, 10, seed=31)[0]
KEYS = ApiKeys([("alice-key", "alice"), ("bob-key", "bob")])


@pytest.fixture(scope="module")
def coordinator(tiny_family):
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        [ModelTierConfig("mid", str(tiny_family["mid"])), MaGConfig()],
        [[3, 1], [0, 3]],
        1.5,
    )
    return InProcess(cascade).coordinator(MemoryStore(), GenerationConfig(max_new_tokens=8))


def _serve(coordinator: Any, **limits: Any) -> tuple[Any, str]:
    api_keys = limits.pop("api_keys", None)
    server, port = start_server(coordinator, limits=Limits(**limits), api_keys=api_keys)
    return server, f"127.0.0.1:{port}"


async def _generate(channel: grpc.aio.Channel, metadata: Any = None, timeout: float = 60) -> pb.GenerateResponse:
    call = channel.unary_unary(
        GENERATE,
        request_serializer=pb.GenerateRequest.SerializeToString,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    return await call(
        pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=8, temperature=0), metadata=metadata, timeout=timeout
    )


def test_idle_calls_cost_no_worker_and_health_answers_beside_them(coordinator, tiny_family):
    """Two workers and 400 calls that never send a body (Generate, streams, reflection, health): 200 times
    the worker count. A normal request still gets the oracle's tokens at once, and health answers."""
    server, address = _serve(coordinator, workers=2, max_queued=2, body_timeout_s=120)
    expected = oracle(tiny_family["target"], PROMPT, 8)

    async def run() -> tuple[float, float]:
        channels = [own_channel(address) for _ in range(8)]
        alone = time.perf_counter()
        assert list((await _generate(channels[0])).token_ids) == expected
        alone = time.perf_counter() - alone
        paths = [*CASCADE_METHODS, *REFLECTION, *HEALTH]
        idle = [idle_call(channels[i % 8], paths[i % len(paths)]) for i in range(400)]
        await asyncio.sleep(1.0)  # every idle call is open at the server
        beside = time.perf_counter()
        assert list((await _generate(channels[0], timeout=30)).token_ids) == expected
        beside = time.perf_counter() - beside
        assert await health_check(channels[1]) == health_pb2.HealthCheckResponse.SERVING
        assert not any(call.done() for call in idle)  # they were all still waiting
        for call in idle:
            call.cancel()
        await asyncio.sleep(0.5)  # the cancels are seen before this loop closes
        for channel in channels:
            await channel.close()
        return alone, beside

    try:
        alone, beside = asyncio.run(run())
        print(f"a request alone {alone * 1e3:.0f} ms, beside 400 idle calls {beside * 1e3:.0f} ms")
    finally:
        server.stop(0)


def test_a_call_without_a_key_is_refused_on_its_headers(coordinator):
    server, address = _serve(coordinator, api_keys=KEYS, body_timeout_s=120)

    async def run() -> None:
        async with own_channel(address) as channel:
            for metadata in (None, (("authorization", "Bearer nobody"),)):
                call = idle_call(channel, GENERATE, metadata)  # never sends a body
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await asyncio.wait_for(call.read(), 5)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # A key on the headers, and the call is served.
            reply = await _generate(channel, metadata=(("authorization", "Bearer alice-key"),))
            assert len(reply.token_ids) == 8

    try:
        asyncio.run(run())
    finally:
        server.stop(0)


def test_a_body_that_does_not_come_ends_the_call_within_the_body_timeout(coordinator):
    server, address = _serve(coordinator, body_timeout_s=0.5)

    async def run() -> None:
        async with own_channel(address) as channel:
            for path in (
                GENERATE,
                "/cascade.v1.CascadeService/GenerateStream",
                "/grpc.health.v1.Health/Check",
                REFLECTION[0],
            ):
                start = time.perf_counter()
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await asyncio.wait_for(idle_call(channel, path).read(), 10)
                took = time.perf_counter() - start
                assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, path
                assert caught.value.details() == "request: the message did not arrive within 0.5 s"
                assert took < 5, (path, took)
            # A body that never ends (no half-close after its one message) times out the same way.
            call = channel.stream_stream(GENERATE)()
            await call.write(pb.GenerateRequest(prompt_token_ids=PROMPT).SerializeToString())
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await asyncio.wait_for(call.read(), 10)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    try:
        asyncio.run(run())
    finally:
        server.stop(0)


def test_calls_waiting_for_a_body_are_bounded_and_health_answers_past_the_bound(coordinator):
    server, address = _serve(coordinator, max_pending=5, body_timeout_s=120)  # probes have their own bound

    async def run() -> None:
        async with own_channel(address) as channel:
            idle = [idle_call(channel, GENERATE) for _ in range(5)]
            await asyncio.sleep(0.5)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await asyncio.wait_for(idle_call(channel, GENERATE).read(), 5)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert caught.value.details() == "5 calls are waiting for their request; retry later"
            assert await health_check(channel) == health_pb2.HealthCheckResponse.SERVING
            for call in idle:
                call.cancel()
            await asyncio.sleep(0.3)
            assert len((await _generate(channel)).token_ids) == 8  # the bound is free again

    try:
        asyncio.run(run())
    finally:
        server.stop(0)


def test_one_key_is_held_to_its_limit_and_another_key_is_served(coordinator):
    server, address = _serve(coordinator, api_keys=KEYS, max_calls_per_key=3, body_timeout_s=120)
    alice, bob = (("authorization", "Bearer alice-key"),), (("authorization", "Bearer bob-key"),)

    async def run() -> None:
        async with own_channel(address) as channel:
            idle = [idle_call(channel, GENERATE, alice) for _ in range(3)]
            await asyncio.sleep(0.5)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _generate(channel, metadata=alice)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "this API key has 3 calls open" in caught.value.details()
            assert len((await _generate(channel, metadata=bob)).token_ids) == 8
            for call in idle:
                call.cancel()
            await asyncio.sleep(0.3)
            assert len((await _generate(channel, metadata=alice)).token_ids) == 8

    try:
        asyncio.run(run())
    finally:
        server.stop(0)


def test_health_answers_while_every_worker_is_busy_and_the_queue_is_full(coordinator):
    server, address = _serve(coordinator, workers=1, max_queued=0)
    long = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=4000, temperature=0)  # within the 4,096 positions

    async def run() -> None:
        async with own_channel(address) as channel:
            stream = channel.unary_stream(
                "/cascade.v1.CascadeService/GenerateStream",
                request_serializer=pb.GenerateRequest.SerializeToString,
                response_deserializer=pb.GenerateChunk.FromString,
            )(long, timeout=120)
            assert (await stream.read()).token_ids  # the one worker is busy
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _generate(channel)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            start = time.perf_counter()
            assert await health_check(channel) == health_pb2.HealthCheckResponse.SERVING
            assert time.perf_counter() - start < 2.0
            stream.cancel()
            await asyncio.sleep(0.5)  # the worker comes back once the decode sees the cancel
            assert len((await _generate(channel)).token_ids) == 8

    try:
        asyncio.run(run())
    finally:
        server.stop(0)


def _bad_bodies() -> list[tuple[str, bytes, str | None]]:
    """(what, bytes, the field the error must name, or None where no field can be known)."""
    request = pb.GenerateRequest(
        prompt="hi", prompt_token_ids=[5, 6, 7], session_id="s", verification=pb.Verification(rule="exact")
    ).SerializeToString()
    bad_utf8 = b"\x0a\x02\xc3\x28"  # prompt (field 1) = b"\xc3\x28"
    nested = b"\x4a\x04\x0a\x02\xff\xfe"  # verification (9) { rule (1) = b"\xff\xfe" }
    packed = b"\x12\x03\x05\x06\x87"  # prompt_token_ids packed, last varint cut
    return [
        ("truncated", request[:-2], "verification"),
        ("invalid UTF-8", bad_utf8, "prompt"),
        ("nested invalid UTF-8", nested, "verification.rule"),
        ("cut varint", packed, "prompt_token_ids"),
        ("wire type 7 on prompt", b"\x0f", "prompt"),
        ("field number 0", b"\x07", "request"),
        ("tag past the end", b"\x80", "request"),
    ]


def test_bytes_that_are_no_message_get_invalid_argument_naming_the_field(coordinator):
    server, address = _serve(coordinator)

    async def run() -> None:
        async with own_channel(address) as channel:
            for what, body, field in _bad_bodies():
                for path in ("/cascade.v1.CascadeService/Generate", "/cascade.v1.CascadeService/GenerateStream"):
                    error = await raw_call(channel, path, body)
                    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, path, error.details())
                    assert error.details().startswith(f"{field}: not a valid cascade.v1.GenerateRequest"), what
                    assert violated_fields(error) == ([field] if field != "request" else []), what
            # Unary and streaming alike, on every method, health and reflection included.
            for path in [*CASCADE_METHODS, *HEALTH, *REFLECTION]:
                error = await raw_call(channel, path, b"\x0a\x05ab")  # a string field cut short
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, error.details())
                assert "not a valid" in error.details()
            error = await raw_call(channel, "/grpc.health.v1.Health/Check", b"\x0a\x02\xc3\x28")
            assert error.details() == "service: not a valid grpc.health.v1.HealthCheckRequest (not UTF-8)"

    try:
        asyncio.run(run())
    finally:
        server.stop(0)


def test_random_bytes_on_every_method_never_get_internal(coordinator):
    """Seeded random bodies: each ends with INVALID_ARGUMENT, or, where the bytes happen to parse, with
    the answer to that message (a validation error, NOT_FOUND, a reply); never INTERNAL or UNKNOWN."""
    server, address = _serve(coordinator)
    rng = random.Random(7)
    bodies = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(40)]

    async def run() -> dict[str, int]:
        seen: dict[str, int] = {}
        async with own_channel(address) as channel:
            for i, body in enumerate(bodies):
                path = [*CASCADE_METHODS, *HEALTH][i % 7]
                try:
                    if path in STREAMING:
                        async for _ in channel.stream_stream(path)(iter([body]), timeout=30):
                            if path.endswith("Watch"):
                                break  # a Watch that parsed stays open
                    else:
                        await channel.unary_unary(path)(body, timeout=30)
                    code = "OK"
                except grpc.aio.AioRpcError as err:
                    code = err.code().name
                    assert "\n" not in (err.details() or "")
                seen[code] = seen.get(code, 0) + 1
        return seen

    try:
        seen = asyncio.run(run())
    finally:
        server.stop(0)
    print("random bodies:", seen)
    assert not {"INTERNAL", "UNKNOWN"} & set(seen), seen
    assert seen.get("INVALID_ARGUMENT", 0) >= len(bodies) // 2, seen


def test_a_unary_call_with_two_messages_is_invalid_argument(coordinator):
    server, address = _serve(coordinator)
    body = pb.GenerateRequest(prompt_token_ids=PROMPT).SerializeToString()

    async def run() -> None:
        async with own_channel(address) as channel:
            call = channel.stream_stream(GENERATE)(iter([body, body]), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in call:
                    pass
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details() == "request: this method takes one request message"

    try:
        asyncio.run(run())
    finally:
        server.stop(0)


def test_long_bad_values_are_quoted_short_and_the_error_arrives_whole(coordinator):
    """A 64 KB session id or rule name would overflow the client's metadata limit if quoted whole (the
    client would see RESOURCE_EXHAUSTED); it is quoted as a short escaped prefix with its length."""
    server, address = _serve(coordinator)
    long_id, long_rule = "s" * 65536 + "\n", "\x00" + "r" * 65535

    async def run() -> None:
        async with own_channel(address) as channel:
            for request, field in (
                (pb.GenerateRequest(prompt="x", session_id=long_id), "session_id"),
                (pb.GenerateRequest(prompt="x", verification=pb.Verification(rule=long_rule)), "verification.rule"),
            ):
                for path in ("/cascade.v1.CascadeService/Generate", "/cascade.v1.CascadeService/GenerateStream"):
                    error = await raw_call(channel, path, request.SerializeToString())
                    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, error.details()[:200])
                    assert len(error.details()) < 300, error.details()
                    assert error.details().endswith(("(65537 characters)", "(65536 characters)")), error.details()
                    assert violated_fields(error) == [field]
            for path, body in (
                ("/cascade.v1.CascadeService/GetSession", pb.GetSessionRequest(session_id=long_id)),
                ("/cascade.v1.CascadeService/CreateSession", pb.CreateSessionRequest(session_id=long_id, prompt="x")),
            ):
                error = await raw_call(channel, path, body.SerializeToString())
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and len(error.details()) < 300

    try:
        asyncio.run(run())
    finally:
        server.stop(0)
