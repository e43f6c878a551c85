"""`cascade-service bench load`: concurrent clients against a running service on loopback.

N client threads (one gRPC channel each) stream Generate requests back to back for S seconds, per
concurrency level. Per level: completed requests, tokens/s within the window (and, for comparison,
completed requests' tokens over the window and the drain: Level), p50 / p99 request latency, errors
by status code. Around the whole run: the resident memory (RSS) of the
server's process tree, read from /proc when the target is on this machine (the process that listens
on the target port and its descendants: the `serve` process with Ray's workers and replicas). A
KV-cache leak shows as growth that does not come back after the load.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import procfs
from ..config import load_config
from .clients import Level, run_level

__all__ = ["DEFAULT_PROMPTS", "MODES", "RATIOS", "Level", "ServerProcess", "run", "run_level", "run_modes"]

# The service's metric names start so (cascade_service.metrics.PREFIX, tested equal): the bench reads a server's
# /metrics as any scraper would, and imports nothing of the service's own layers.
METRICS_PREFIX = "cascade:"
DEFAULT_PROMPTS = ("def main():\n", "import os\n\n\nclass Config:\n", "for i in range(10):\n    print(i)\n")


def listener_tree_rss(port: int) -> int | None:
    """RSS bytes of the process listening on `port` here and its descendants; None if not found."""
    owner = procfs.listener_of(port)
    return None if owner is None else procfs.rss_bytes(procfs.descendants(owner))


def run(
    target: str,
    concurrencies: Sequence[int],
    duration_s: float,
    prompts: Sequence[str],
    max_new_tokens: int,
    out: Path,
    command: str,
    api_key: str | None = None,
    timeout_s: float = 120.0,
    temperature: float | None = None,
    ramp: bool = True,
) -> dict:
    port = int(target.rsplit(":", 1)[1])
    rss_before = listener_tree_rss(port)
    run_level(target, 1, min(2.0, duration_s), prompts, max_new_tokens, api_key, timeout_s, temperature)  # warm-up
    rss_warm = listener_tree_rss(port)
    levels = []
    for n in concurrencies:
        level = run_level(
            target, n, duration_s, prompts, max_new_tokens, api_key, timeout_s, temperature, ramp=ramp
        ).summary()
        levels.append(level)
        print(
            f"concurrency {n:>3}: {level['requests']} requests, {level['tokens_per_s']:.1f} tok/s "
            f"({level['drained_tokens_per_s']:.1f} drained), "
            f"p50 {level['p50_s']} s, p99 {level['p99_s']} s, errors {level['errors']}, ramp {level['ramp_s']} s",
            flush=True,
        )
    time.sleep(2.0)  # let releases of finished requests land
    rss_after = listener_tree_rss(port)
    memory = {
        "rss_before_mb": _mb(rss_before),
        "rss_after_warmup_mb": _mb(rss_warm),
        "rss_after_mb": _mb(rss_after),
        "growth_after_warmup_mb": _mb(rss_after - rss_warm) if rss_after and rss_warm else None,
    }
    results: dict[str, Any] = {
        "command": command,
        "target": target,
        "duration_s": duration_s,
        "window": "after the ramp" if ramp else "from the start",
        "max_new_tokens": max_new_tokens,
        "levels": levels,
        "memory": memory,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"server RSS: {memory['rss_after_warmup_mb']} MB after warm-up, {memory['rss_after_mb']} MB after the load "
        f"(growth {memory['growth_after_warmup_mb']} MB)"
    )
    return results


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)


# What `serve --frontend standalone` runs for each mode: the K-matrix as configured; the target alone; load
# adaptation without the floor; the default (no flag: the floor over load adaptation); and the default
# server asked for speculation "off" by every request (plain rounds through the cascade's machinery); and a
# second plain server, the control: its ratio to plain is what the bench reads between two identical servers.
MODE_FLAGS = {
    "cascade": ("--fixed-schedule",),
    "plain": ("--plain",),
    "cascade-adaptive": ("--adapt-to-load", "--no-floor"),
    "default": (),
    "off": (),
    "twin": ("--plain",),
}
MODE_REQUESTS: dict[str, dict[str, Any]] = {"off": {"speculation": "off"}}
MODES = tuple(MODE_FLAGS)
RATIOS = {mode: f"{mode.replace('cascade-', '')}_over_plain" for mode in MODES if mode != "plain"}


def rotated(modes: list[str], block: int) -> list[str]:
    """The order block `block` runs the modes in: the given order turned by one place a block, so over as
    many blocks as modes each mode runs once in each place. A fixed order confounds a mode with its place:
    on this 2-core host, 16 streams, T = 1, whichever server ran second in a block read highest in six
    blocks of seven (up to 1.42x the third; a later run, turned, did not repeat it), and "default" always
    ran before "plain"."""
    turn = block % len(modes) if modes else 0
    return modes[turn:] + modes[:turn]


def run_modes(
    config_path: str,
    concurrencies: Sequence[int],
    duration_s: float,
    prompts: Sequence[str],
    max_new_tokens: int,
    out: Path,
    command: str,
    timeout_s: float = 300.0,
    modes: Sequence[str] = ("default", "plain"),
    temperature: float | None = None,
    blocks: int = 1,
    ramp: bool = True,
) -> dict:
    """The cascade against plain decoding of its target, under load, in one run.

    Starts a standalone server per mode (`serve --frontend standalone`, with `--plain` for plain) on
    loopback, each in its own process, and alternates between them level by level (cascade, plain,
    next level...) so drift on a noisy machine hits both alike; the idle one waits on a condition.
    `blocks` > 1 runs the whole sweep that many times, each block on fresh server processes (`_block`
    says why) and in the order turned by one place (`rotated`): each ratio to plain is then the median
    of the ratios within each block (paired blocks), and each mode's tokens/s the median of its blocks.
    Writes load.json: {"runs": [{"mode", "block", "concurrency", "tokens_per_s", "p50_s", "p99_s",
    "errors", ...}], "summary": {...}}.
    """
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    runs = []
    for block in range(blocks):
        runs += _block(
            config_path, concurrencies, duration_s, prompts, max_new_tokens, timeout_s, modes, temperature, block, ramp
        )
    results: dict[str, Any] = {
        "command": command,
        "config": config_path,
        "duration_s": duration_s,
        "window": "after the ramp" if ramp else "from the start",
        "max_new_tokens": max_new_tokens,
        "runs": runs,
        "summary": _scaling(runs),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps(results, indent=1) + "\n")
    for line in _scaling_lines(results["summary"]):
        print(line)
    return results


def _block(
    config_path: str,
    concurrencies: Sequence[int],
    duration_s: float,
    prompts: Sequence[str],
    max_new_tokens: int,
    timeout_s: float,
    modes: Sequence[str],
    temperature: float | None,
    block: int,
    ramp: bool,
) -> list[dict]:
    """One block: a fresh server process per mode, warmed up, then each level in the block's order.

    Fresh per block because a server process has a speed of its own: two identical plain servers kept
    across blocks read 1.09x and 1.18x each other over three blocks at 64 streams, T = 1, the same one ahead
    in every block (2026-12-01; whatever fixes it, memory placement or alignment, lasts the process's
    life). Servers kept across blocks pair that difference in every block and the median keeps it;
    fresh ones draw it anew, so the blocks' spread shows it and their median averages it out."""
    servers = {mode: ServerProcess(config_path, mode, ("--http-port", "0")) for mode in modes}
    runs = []
    try:
        targets = {mode: server.wait_ready() for mode, server in servers.items()}
        scrapes = {mode: server.wait_http() for mode, server in servers.items()}  # /metrics: the target's passes
        target_tier = load_config(config_path).cascade.target.name
        for target in targets.values():  # warm-up: first passes, allocator, thread pools
            run_level(
                target, max(concurrencies), min(5.0, duration_s), prompts, max_new_tokens, None, timeout_s, temperature
            )
        order = rotated(list(targets), block)
        for n in concurrencies:
            for mode in order:
                target, options = targets[mode], MODE_REQUESTS.get(mode)
                before = EngineCounts.scrape(scrapes[mode], target_tier)
                level = run_level(
                    target, n, duration_s, prompts, max_new_tokens, None, timeout_s, temperature, options, ramp
                ).summary()
                level |= EngineCounts.scrape(scrapes[mode], target_tier).since(before)
                runs.append({"mode": mode, "block": block, **level})
                print(
                    f"{mode:>16} concurrency {n:>3}: {level['requests']} requests, {level['tokens_per_s']:.1f} "
                    f"tok/s ({level['drained_tokens_per_s']:.1f} drained), p50 {level['p50_s']} s, "
                    f"p99 {level['p99_s']} s, errors {level['errors']}, "
                    f"rounds that drafted {level['drafted_round_share']:.0%}, ramp {level['ramp_s']} s, "
                    f"target passes a token {level['target_passes_per_token']} "
                    f"({level['target_pass_ms']} ms a pass)",
                    flush=True,
                )
    finally:
        for server in servers.values():
            server.stop()
    return runs


def _scaling(runs: list[dict], figure: str = "tokens_per_s") -> dict:
    """Per mode, throughput relative to its own single stream; per level, each cascade mode / plain;
    under "drained", the same ratios of the drained figure (Level).

    With several blocks, a ratio to plain is the median of the ratios within each block (paired), and
    a mode's throughput the median of its blocks'."""
    blocks = sorted({r.get("block", 0) for r in runs})
    by = {(r["mode"], r["concurrency"], r.get("block", 0)): r[figure] for r in runs if figure in r}
    levels = sorted({r["concurrency"] for r in runs})
    summary: dict = {"over_single_stream": {}, "blocks": len(blocks)}
    for n in levels:
        for mode, key in RATIOS.items():
            paired = [
                by[(mode, n, b)] / by[("plain", n, b)] for b in blocks if by.get(("plain", n, b)) and (mode, n, b) in by
            ]
            if paired:
                summary.setdefault(key, {})[str(n)] = round(statistics.median(paired), 3)
    for mode in MODES:
        per_level = {n: [by[(mode, n, b)] for b in blocks if (mode, n, b) in by] for n in levels}
        medians = {n: statistics.median(v) for n, v in per_level.items() if v}
        if medians.get(1):
            summary["over_single_stream"][mode] = {str(n): round(t / medians[1], 2) for n, t in medians.items()}
    if figure == "tokens_per_s":
        summary["drained"] = _scaling(runs, "drained_tokens_per_s")
    return summary


def _scaling_lines(summary: dict) -> list[str]:
    names = {
        "cascade": "cascade (K-matrix as configured)",
        "cascade-adaptive": "cascade adapting to load, no floor",
        "off": "cascade with speculation off",
        "twin": "a second plain server (the control)",
    }
    lines = [
        f"{names.get(mode, mode)} / plain at {n} streams: {r:.2f}x"
        for mode, key in RATIOS.items()
        for n, r in summary.get(key, {}).items()
    ]
    drained = summary.get("drained", {})
    lines += [
        f"{names.get(mode, mode)} / plain at {n} streams, drained figures: {r:.2f}x"
        for mode, key in RATIOS.items()
        for n, r in drained.get(key, {}).items()
    ]
    for mode, ratios in summary["over_single_stream"].items():
        lines.append(f"{mode}: throughput / single stream: " + ", ".join(f"{n}: {r:.2f}x" for n, r in ratios.items()))
    return lines


@dataclass(frozen=True)
class EngineCounts:
    """What a server's /metrics says of its work so far: the target's forward passes and their seconds
    (`tier_pass_seconds`, every batched pass), and the tokens its finished requests generated."""

    passes: float
    pass_s: float
    tokens: float

    @classmethod
    def scrape(cls, http_port: int, target: str) -> EngineCounts:
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30) as page:
            text = page.read().decode()
        # the target's pass histogram (its count and sum), and the tokens of every finished request
        wanted = {
            (f"{METRICS_PREFIX}tier_pass_seconds_count", target): "passes",
            (f"{METRICS_PREFIX}tier_pass_seconds_sum", target): "pass_s",
            (f"{METRICS_PREFIX}generation_tokens_total", None): "tokens",
        }
        found = dict.fromkeys(wanted.values(), 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                field = wanted.get((sample.name, sample.labels.get("tier")))
                if field is not None:
                    found[field] += sample.value
        return cls(**found)

    def since(self, before: EngineCounts) -> dict[str, float | None]:
        """A level's figures: its requests' tokens (its ramp and drain included, as the passes are)
        against the target passes run meanwhile. A plain server at N streams runs about 1 / N a token
        (prefill chunks add some); drafting that pays runs fewer."""
        passes, tokens = self.passes - before.passes, self.tokens - before.tokens
        return {
            "target_passes_per_token": round(passes / tokens, 4) if tokens else None,
            "target_pass_ms": round((self.pass_s - before.pass_s) / passes * 1e3, 3) if passes else None,
            "target_pass_ms_per_token": round((self.pass_s - before.pass_s) / tokens * 1e3, 4) if tokens else None,
        }


class ServerProcess:
    """`cascade-service serve --frontend standalone` in a child process on a free loopback port."""

    def __init__(self, config_path: str, mode: str, extra: Sequence[str] = ()):
        import subprocess
        import sys

        flags = list(MODE_FLAGS[mode])
        args = [
            sys.executable,
            "-m",
            "cascade_service.cli",
            "serve",
            "--frontend",
            "standalone",
            "--config",
            config_path,
            "--grpc-port",
            "0",
            *flags,
            *extra,
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)

    def wait_ready(self, timeout_s: float = 600.0) -> str:
        # The server prints "serving ... on HOST:PORT (...)" once it listens; the port was chosen by it.
        import select

        deadline = time.monotonic() + timeout_s
        assert self.process.stdout is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.process.returncode} before serving")
            ready, _, _ = select.select([self.process.stdout], [], [], 1.0)
            if ready:
                line = self.process.stdout.readline()
                if line.startswith("serving "):
                    return line.split(" on ", 1)[1].split()[0]
        raise TimeoutError(f"the server did not start within {timeout_s} s")

    def wait_http(self, timeout_s: float = 60.0) -> int:
        """The HTTP API's port, from the line `serve` prints after the gRPC one (with --http-port)."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if "HTTP API on http://" not in line:
            raise RuntimeError(f"the server did not announce its HTTP API: {line!r}")
        return int(line.rsplit(":", 1)[1].split("/")[0])

    def stop(self) -> None:
        import signal

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except Exception:
                self.process.kill()
                self.process.wait()
