"""`bench load --config C --protocols grpc,http`: the same server under load through gRPC and through
the OpenAI-compatible HTTP API, side by side, with time to first token and inter-token latency.

One standalone server process (`serve --frontend standalone --http-port 0`) serves both; each level
runs N streaming clients for S seconds through one protocol, then through the other, alternating so
drift on a noisy machine hits both alike. Streams are read as they come: time to first token is
request start to the first chunk with tokens, inter-token latency a later chunk's gap over its tokens.
Writes load.json: {"runs": [{"protocol", "concurrency", "tokens_per_s", "p50_s", "p99_s", "ttft_p50_s",
"ttft_p99_s", "itl_p50_s", "itl_p99_s", "errors", ...}], "http_over_grpc": {N: ratio}}.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .load import Level, ServerProcess

PROTOCOLS = ("grpc", "http")


@dataclass
class StreamLevel(Level):
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        return super().summary() | {
            f"{name}_{q}_s": _quantile(values, p)
            for name, values in (("ttft", self.ttft), ("itl", self.itl))
            for q, p in (("p50", 0.5), ("p99", 0.99))
        }


def _quantile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))] if p != 0.5 else statistics.median(ordered), 5)


Stream = Callable[[str], Iterator[int]]  # prompt -> token counts of the chunks, as they arrive


def grpc_streams(target: str, max_new_tokens: int, timeout_s: float) -> Callable[[], tuple[Stream, Callable]]:
    def open_client() -> tuple[Stream, Callable]:
        from ..client import CascadeClient

        client = CascadeClient(target, timeout_s=timeout_s)
        return (lambda prompt: (len(c.token_ids) for c in client.stream(prompt, max_new_tokens=max_new_tokens))), (
            client.close
        )

    return open_client


def http_streams(host: str, port: int, model: str, max_new_tokens: int, timeout_s: float):  # type: ignore[no-untyped-def]
    def open_client() -> tuple[Stream, Callable]:
        connection = http.client.HTTPConnection(host, port, timeout=timeout_s)

        def stream(prompt: str) -> Iterator[int]:
            body = {"model": model, "prompt": prompt, "max_tokens": max_new_tokens, "stream": True}
            connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            reply = connection.getresponse()
            if reply.status != 200:
                reply.read()
                raise RuntimeError(f"HTTP {reply.status}")
            for line in reply:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[len(b"data: ") :])
                yield int(event.get("cascade", {}).get("tokens", 0))  # the chunk's tokens (api.openai_http)
            reply.read()

        return stream, connection.close

    return open_client


def run_stream_level(
    open_client: Callable[[], tuple[Stream, Callable]], concurrency: int, duration_s: float, prompts: Sequence[str]
) -> StreamLevel:
    level = StreamLevel(concurrency)
    lock = threading.Lock()
    deadline = time.monotonic() + duration_s

    def worker(index: int) -> None:
        stream, close = open_client()
        try:
            i = index
            while time.monotonic() < deadline:
                prompt = prompts[i % len(prompts)]
                i += concurrency
                start = last = time.perf_counter()
                first: float | None = None
                gaps: list[float] = []
                tokens = 0
                try:
                    for n in stream(prompt):
                        if not n:
                            continue
                        now = time.perf_counter()
                        if first is None:
                            first = now - start
                        else:
                            gaps += [(now - last) / n] * n
                        last, tokens = now, tokens + n
                except Exception as exc:
                    with lock:
                        name = type(exc).__name__
                        level.errors[name] = level.errors.get(name, 0) + 1
                    continue
                with lock:
                    level.latencies.append(time.perf_counter() - start)
                    level.tokens += tokens
                    level.itl += gaps
                    if first is not None:
                        level.ttft.append(first)
        finally:
            close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    level.seconds = time.perf_counter() - start
    return level


def run_protocols(
    config_path: str,
    concurrencies: Sequence[int],
    duration_s: float,
    prompts: Sequence[str],
    max_new_tokens: int,
    out: Path,
    command: str,
    timeout_s: float = 300.0,
) -> dict:
    from ..config import load_config

    model = load_config(config_path).cascade.target.name
    server = ServerProcess(config_path, "cascade", extra=["--http-port", "0"])
    runs: list[dict[str, Any]] = []
    try:
        target = server.wait_ready()
        http_port = server.wait_http()
        host = target.rsplit(":", 1)[0]
        clients = {
            "grpc": grpc_streams(target, max_new_tokens, timeout_s),
            "http": http_streams(host, http_port, model, max_new_tokens, timeout_s),
        }
        for client in clients.values():  # warm-up
            run_stream_level(client, max(concurrencies), min(5.0, duration_s), prompts)
        for n in concurrencies:
            for protocol, client in clients.items():
                level = run_stream_level(client, n, duration_s, prompts).summary()
                runs.append({"protocol": protocol, **level})
                print(
                    f"{protocol:>4} concurrency {n:>3}: {level['requests']} requests, "
                    f"{level['tokens_per_s']:.1f} tok/s, "
                    f"TTFT p50 {level['ttft_p50_s']} s p99 {level['ttft_p99_s']} s, "
                    f"ITL p50 {level['itl_p50_s']} s p99 {level['itl_p99_s']} s, errors {level['errors']}",
                    flush=True,
                )
    finally:
        server.stop()
    by = {(r["protocol"], r["concurrency"]): r["tokens_per_s"] for r in runs}
    ratios = {str(n): round(by[("http", n)] / by[("grpc", n)], 3) for n in concurrencies if by.get(("grpc", n))}
    for streams, ratio in ratios.items():
        print(f"HTTP / gRPC throughput at {streams} streams: {ratio:.2f}x")
    results: dict[str, Any] = {"command": command, "config": config_path, "duration_s": duration_s, "runs": runs}
    results["http_over_grpc"] = ratios
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps(results, indent=1) + "\n")
    return results
