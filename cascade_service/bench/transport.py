"""Tier transports side by side on the demo config: in-process, Ray handles, gRPC between tiers.

    cascade-service bench transport [--prompts 6] [--max-new-tokens 64] [--calls 300]

1. Per call: a tier call that runs no forward pass (a draft of 0 tokens after a real context) to the
   target tier, `--calls` times each way, alternated in blocks: the Tier protocol in this process; the
   wire codec in this process (loopback); gRPC to a tier server in another process; a Ray Serve handle
   to a tier deployment. Median and p99 in milliseconds: the transport's own cost per hop.
2. End to end, tokens/s (median over prompts of each prompt's tokens/s): the cascade in this process;
   the same coordinator reaching every model tier over gRPC (tier servers in processes of their own);
   the Ray app with every tier its own deployment (handles); the same Ray app with every tier a tier
   server reached by address (gRPC). Every run's tokens are checked against the in-process ones.
3. Bytes per target round on the gRPC wire (tier messages, both ways), beside the token ids that had to
   cross (new context tokens, blocks, drafts, verdicts; 4 bytes each) and the draft probabilities a
   lenient inner review reads (8 bytes each). Greedy: no distribution rows cross.

The prompts are the demo zoo's own (labelled as such): this measures transports, not drafting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import yaml

from ..config import GenerationConfig, load_config
from ..core.tier import DraftRequest, Scope
from ..core.types import Context
from ..inprocess import InProcess
from ..paths import zoo_dir
from ..prompts import read_prompts
from ..tierhost.loopback import loopback
from ..transport.client import TierReplicas
from ..transport.remote import RemoteTier
from ..zoo.build import build_zoo
from ..zoo.demo import demo_config
from . import tools

CALL_TIER = "large"  # the target: a plain model tier on every transport


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=300, help="per-call timings per transport")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray app's two runs")


def run(args: argparse.Namespace) -> int:
    path = demo_config("demo", "separate")
    config = load_config(path)
    model_tiers = [t.name for t in config.cascade.tiers if t.name != "mag"]
    texts = read_prompts(str(build_zoo("demo", zoo_dir("demo"))["prompts"]))[: args.prompts]
    local = InProcess(config.cascade)
    ids = [local.encode(t) for t in texts]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, speculation="fixed")  # the same rounds both ways
    print(f"config {path} (each tier its own deployment); {len(ids)} zoo prompts, {args.max_new_tokens} tokens")

    with ExitStack() as stack:
        addresses = {name: stack.enter_context(tier_server(path, name)) for name in model_tiers}
        remote_path = _addressed(path, addresses)
        remote = InProcess(load_config(remote_path).cascade)
        recorded = _record_remote_tiers(remote)

        # 1. per call
        context = Context(ids[0], len(ids[0]))
        small = next(m for m in local.models() if m.name == CALL_TIER)
        calls: dict[str, Callable[[Context], Any]] = {
            "in-process": _draft_call(local.request_tier(small, Scope("bench"))),
            "codec (loopback)": _draft_call(loopback(local.request_tier(small, Scope("bench")))),
            "gRPC": _draft_call(RemoteTier(CALL_TIER, "bench", TierReplicas([addresses[CALL_TIER]]).invoker("bench"))),
        }
        timings: dict[str, list[float]] = {name: [] for name in calls}

        # 2. end to end, this process's coordinator: in-process and gRPC alternated per prompt
        e2e: dict[str, list[float]] = {"in-process": [], "in-process coordinator, gRPC tiers": []}
        reference: list[list[int]] = []
        for x in ids:  # warm both
            remote.generate(x[:8], GenerationConfig(max_new_tokens=4))
            local.generate(x[:8], GenerationConfig(max_new_tokens=4))
        for x in ids:
            mine = _timed(local, x, gen, e2e["in-process"])
            theirs = _timed(remote, x, gen, e2e["in-process coordinator, gRPC tiers"])
            assert theirs.token_ids == mine.token_ids, "gRPC tiers and in-process disagree"
            reference.append(mine.token_ids)
        rounds = sum(r.hops for r in recorded if r.name == local.target.name)
        wire = sum(r.bytes_out + r.bytes_in for r in recorded)
        needed = sum(4 * (r.ids_out + r.ids_in) for r in recorded)
        probs = sum(8 * r.ids_in for r in recorded if r.name != local.target.name)  # drafts' proposal probs

        if not args.no_ray:
            e2e |= _ray_runs(path, remote_path, ids, reference, args.max_new_tokens, context, timings, args.calls)
        for _ in range(3):  # alternated blocks: drift hits every transport alike
            for name, call in calls.items():
                timings[name] += _times(call, args.calls // 3, context)

    print(f"\nper call (a 0-token draft of tier {CALL_TIER} after the prompt; ms):")
    for name, seconds in timings.items():
        seconds = sorted(seconds)
        p99 = seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))]
        print(
            f"  {name:<22} median {1000 * statistics.median(seconds):7.3f}   p99 {1000 * p99:7.3f}   n {len(seconds)}"
        )
    print("\nend to end (tokens/s, median over prompts; x: against the first row of its coordinator):")
    base = {"in-process": e2e["in-process"], "Ray app, handles": e2e.get("Ray app, handles", [])}
    for name, rates in e2e.items():
        against = base["Ray app, handles"] if name.startswith("Ray") else base["in-process"]
        ratio = statistics.median(r / a for r, a in zip(rates, against)) if against else float("nan")
        print(f"  {name:<36} {statistics.median(rates):7.1f} tok/s   {ratio:5.2f}x")
    print(
        f"\nbytes per target round on the gRPC wire: {wire / rounds:.0f} (tier messages, both ways); "
        f"token ids that had to cross {needed / rounds:.0f}, with the drafts' proposal probabilities "
        f"{(needed + probs) / rounds:.0f}: {wire / (needed + probs):.2f}x of ids + needed probabilities"
    )
    return 0


def _ray_runs(
    path: Path,
    remote_path: Path,
    ids: list[list[int]],
    reference: list[list[int]],
    max_new: int,
    context: Context,
    timings: dict[str, list[float]],
    n_calls: int,
) -> dict[str, list[float]]:
    from ..client import CascadeClient
    from ..serving.local import LocalService
    from ..serving.tier_deployment import invoker

    rates: dict[str, list[float]] = {}
    for name, config in (("Ray app, handles", path), ("Ray app, gRPC tiers", remote_path)):
        rates[name] = []
        with LocalService(str(config)) as service, CascadeClient(service.address, timeout_s=600) as client:
            client.generate(prompt_token_ids=ids[0][:8], max_new_tokens=4)
            for x, expected in zip(ids, reference):
                start = time.perf_counter()
                reply = client.generate(prompt_token_ids=x, max_new_tokens=max_new)
                rates[name].append(len(reply.token_ids) / (time.perf_counter() - start))
                assert list(reply.token_ids) == expected, f"{name} and in-process disagree"
            if name == "Ray app, handles":  # the handle's per-call cost, from this process
                call = _draft_call(RemoteTier(CALL_TIER, "bench", invoker(CALL_TIER, service.tier_handle(CALL_TIER))))
                timings["Ray handle"] = _times(call, n_calls, context)
    return rates


@contextmanager
def tier_server(config: Path, tier: str) -> Iterator[str]:
    """`cascade-service tier` for one tier in a process of its own; yields its address."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    command = [sys.executable, "-m", "cascade_service.cli", "tier", "--config", str(config), "--tier", tier]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if " on " not in line:
            raise RuntimeError(f"tier server {tier} did not start (exit {process.wait()})")
        yield line.split(" on ")[1].split()[0]
    finally:
        process.terminate()
        process.wait(timeout=60)


def _addressed(path: Path, addresses: dict[str, str]) -> Path:
    raw = yaml.safe_load(path.read_text())
    for tier in [raw["tiers"]["target"], *raw["tiers"]["drafters"]]:
        if tier.get("name") in addresses:
            tier["address"] = addresses[tier["name"]]
    out = path.with_name(path.stem + "-grpc-tiers.yaml")
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def _record_remote_tiers(engine: InProcess) -> list[RemoteTier]:
    """Every RemoteTier the engine makes from now on (for their byte counts)."""
    made: list[RemoteTier] = []
    for model in engine.remote.values():
        make = model.tier

        def tier(request_id: str, affinity: str = "", make=make) -> RemoteTier:  # type: ignore[no-untyped-def]
            made.append(make(request_id, affinity))
            return made[-1]

        model.tier = tier  # type: ignore[method-assign,assignment]
    return made


def _draft_call(tier: Any) -> Callable[[Context], Any]:
    return lambda context: tier.draft(DraftRequest("bench", context, 0, 0))


def _times(call: Callable[[Context], Any], n: int, context: Context) -> list[float]:
    for _ in range(5):
        call(context)
    seconds = []
    for _ in range(n):
        start = time.perf_counter()
        call(context)
        seconds.append(time.perf_counter() - start)
    return seconds


def _timed(engine: InProcess, prompt: list[int], gen: GenerationConfig, rates: list[float]) -> Any:
    start = time.perf_counter()
    result = engine.generate(prompt, gen)
    rates.append(len(result.token_ids) / (time.perf_counter() - start))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.bench.transport`: the same as `cascade-service bench transport`."""
    return tools.main("transport", argv, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
