"""`cascade-service bench idle`: how many idle calls a service holds while serving normal requests.

An idle call sends its headers and never a body: a slow or hostile client. Per level of idle calls
(opened first, over connections of 50 streams each, all still open when the level is measured), the
benchmark times normal Generate requests one after another and health checks, and compares their
latency with the same requests with no idle calls (measured in the same run, before and after the
levels). Idle calls the service refused (it bounds them) are counted; a level holds when the refused
count is 0 and the requests succeed.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from ..proto.v1 import cascade_pb2 as pb

STREAMS_PER_CONNECTION = 50
GENERATE = "/cascade.v1.CascadeService/Generate"


async def _open_idle(address: str, count: int, metadata: Any) -> tuple[list[grpc.aio.Channel], list[Any]]:
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(-(-count // STREAMS_PER_CONNECTION))
    ]
    calls = [channels[i // STREAMS_PER_CONNECTION].stream_stream(GENERATE)(metadata=metadata) for i in range(count)]
    return channels, calls


async def _time_requests(
    channel: grpc.aio.Channel, prompt: str, max_new_tokens: int, n: int, metadata: Any
) -> tuple[list[float], list[float], dict[str, int]]:
    generate = channel.unary_unary(
        GENERATE,
        request_serializer=pb.GenerateRequest.SerializeToString,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    request = pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, temperature=0)
    latencies: list[float] = []
    health: list[float] = []
    errors: dict[str, int] = {}
    for _ in range(n):
        start = time.perf_counter()
        try:
            await generate(request, metadata=metadata, timeout=60)
            latencies.append(time.perf_counter() - start)
        except grpc.aio.AioRpcError as err:
            errors[err.code().name] = errors.get(err.code().name, 0) + 1
        start = time.perf_counter()
        try:
            await check(health_pb2.HealthCheckRequest(), timeout=10)
            health.append(time.perf_counter() - start)
        except grpc.aio.AioRpcError as err:
            errors[f"health {err.code().name}"] = errors.get(f"health {err.code().name}", 0) + 1
    return latencies, health, errors


def _summary(
    idle: int, latencies: list[float], health: list[float], errors: dict[str, int], refused: int, baseline: float | None
) -> dict[str, Any]:
    median = statistics.median(latencies) if latencies else None
    return {
        "idle_calls": idle,
        "requests": len(latencies),
        "median_ms": _ms(median),
        "p90_ms": _ms(sorted(latencies)[int(0.9 * (len(latencies) - 1))] if latencies else None),
        "health_median_ms": _ms(statistics.median(health) if health else None),
        "vs_no_idle": round(median / baseline, 2) if median and baseline else None,
        "idle_refused": refused,
        "errors": errors,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


async def measure(
    address: str, levels: Sequence[int], requests: int, prompt: str, max_new_tokens: int, api_key: str | None = None
) -> list[dict[str, Any]]:
    """Per level: the latency of `requests` Generate calls and health checks beside that many idle calls."""
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    rows = []
    async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        await _time_requests(channel, prompt, max_new_tokens, 2, metadata)  # warm up
        baseline_run = await _time_requests(channel, prompt, max_new_tokens, requests, metadata)
        baseline = statistics.median(baseline_run[0]) if baseline_run[0] else None
        rows.append(_summary(0, *baseline_run, 0, baseline))
        for level in levels:
            channels, calls = await _open_idle(address, level, metadata)
            await asyncio.sleep(1.0)  # every idle call is at the server (or refused by it)
            refused = sum(call.done() for call in calls)
            rows.append(
                _summary(
                    level, *await _time_requests(channel, prompt, max_new_tokens, requests, metadata), refused, baseline
                )
            )
            refused = sum(call.done() for call in calls)  # also those the service ended while requests ran
            rows[-1]["idle_refused"] = refused
            for call in calls:
                call.cancel()
            await asyncio.sleep(0.5)
            for idle_channel in channels:
                await idle_channel.close()
        after = await _time_requests(channel, prompt, max_new_tokens, requests, metadata)
        rows.append({**_summary(0, *after, 0, baseline), "note": "after the levels"})
    return rows


def table(rows: list[dict[str, Any]], workers: int | None) -> str:
    lines = [
        "| idle calls | x workers | median ms | p90 ms | vs none | health ms | idle refused | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        times = f"{row['idle_calls'] / workers:g}" if workers else "-"
        lines.append(
            f"| {row['idle_calls']}{' (after)' if row.get('note') else ''} | {times} | {row['median_ms']} | "
            f"{row['p90_ms']} | {row['vs_no_idle']} | {row['health_median_ms']} | {row['idle_refused']} | "
            f"{row['errors'] or ''} |"
        )
    return "\n".join(lines) + "\n"


def run(
    address: str,
    levels: Sequence[int],
    requests: int,
    prompt: str,
    max_new_tokens: int,
    out: Path,
    command: str,
    api_key: str | None = None,
    workers: int | None = None,
) -> list[dict[str, Any]]:
    rows = asyncio.run(measure(address, levels, requests, prompt, max_new_tokens, api_key))
    out.mkdir(parents=True, exist_ok=True)
    (out / "idle.json").write_text(json.dumps({"command": command, "workers": workers, "levels": rows}, indent=1))
    print(f"# {command}\n")
    print(table(rows, workers), end="")
    return rows


def run_standalone(
    config_path: str,
    levels: Sequence[int],
    requests: int,
    prompt: str,
    max_new_tokens: int,
    out: Path,
    command: str,
    workers: int,
) -> list[dict[str, Any]]:
    """Start the config's cascade standalone (`workers` calls at once) on loopback and measure it."""
    from ..config import load_config
    from ..standalone import start_standalone

    standalone = start_standalone(load_config(config_path), "127.0.0.1", 0, max_streams=workers)
    try:
        return run(
            f"127.0.0.1:{standalone.port}", levels, requests, prompt, max_new_tokens, out, command, workers=workers
        )
    finally:
        standalone.stop(0)
