"""Where the service's time goes: per-tier time in-process vs through the service, per hop.

    cascade-service bench service-overhead [--layout embedded|separate|colocated] \
        [--prompts 6] [--max-new-tokens 64]

Runs the demo zoo's cascade in-process and through a local service (`serving.app.LocalService`),
interleaved per prompt, and prints wall time for both and, per tier, calls, time and the extra
milliseconds per hop. It also times a trivial Serve handle call from the driver: the transport floor.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from ..client import CascadeClient
from ..config import GenerationConfig, load_config
from ..inprocess import InProcess
from ..paths import zoo_dir
from ..prompts import read_prompts
from ..zoo.build import build_zoo
from ..zoo.demo import demo_config
from . import tools


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layout",
        default="separate",
        choices=["embedded", "separate", "colocated"],
        help="the demo's layouts, or every tier inside the coordinator (colocated)",
    )
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)


def run(args: argparse.Namespace) -> int:
    from ..serving.local import LocalService

    path = demo_config("demo", args.layout)
    engine = InProcess(load_config(path).cascade)
    texts = read_prompts(str(build_zoo("demo", zoo_dir("demo"))["prompts"]))[: args.prompts]
    ids = [engine.encode(t) for t in texts]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, speculation="fixed")  # the same rounds both ways
    local: dict[str, list[float]] = {}
    remote: dict[str, list[float]] = {}
    wall = {"in-process": 0.0, "service": 0.0}
    with LocalService(str(path)) as service, CascadeClient(service.address, timeout_s=600) as client:
        client.generate(prompt_token_ids=ids[0][:8], max_new_tokens=8)
        engine.generate(ids[0][:8], GenerationConfig(max_new_tokens=8))
        for x in ids:
            start = time.perf_counter()
            mine = engine.generate(x, gen)
            wall["in-process"] += time.perf_counter() - start
            start = time.perf_counter()
            served = client.generate(prompt_token_ids=x, max_new_tokens=args.max_new_tokens)
            wall["service"] += time.perf_counter() - start
            assert served.token_ids == mine.token_ids, "service and in-process disagree"
            for name, c in mine.stats.tiers.items():
                row = local.setdefault(name, [0, 0.0])
                row[0] += c.calls
                row[1] += c.time_s
            for name, c in served.stats["tiers"].items():
                row = remote.setdefault(name, [0, 0.0, 0])
                row[0] += int(c.get("calls", 0))
                row[1] += float(c.get("time_s", 0.0))
                row[2] += int(c.get("hops", 0))
        remote_tiers = [n for n in local if n in remote and remote[n][2]]
        # alternated, twice each: drift hits both transports alike
        floors = (
            [
                (kind, service.trivial_call_latencies(remote_tiers[0], 55, by_reference=kind == "object refs")[5:])
                for kind in ("object refs", "direct", "object refs", "direct")
            ]
            if remote_tiers
            else []
        )
    print(
        f"layout {args.layout}: wall in-process {wall['in-process']:.3f} s, "
        f"service {wall['service']:.3f} s, service / in-process throughput {wall['in-process'] / wall['service']:.2f}x"
    )
    for name in local:
        calls, t_local = local[name]
        _, t_remote, hops = remote.get(name, [0, 0.0, 0])
        extra = f"{1000 * (t_remote - t_local) / hops:.1f} ms extra per hop" if hops else "no hops"
        print(
            f"  {name:<6} calls {calls:>4}  in-process {t_local:.3f} s  service {t_remote:.3f} s"
            f"  hops {hops:>4}  {extra}"
        )
    for kind, floor in floors:
        floor = sorted(floor)
        print(
            f"trivial Serve handle call from the driver ({kind}): median {1000 * statistics.median(floor):.1f} ms, "
            f"p90 {1000 * floor[int(0.9 * len(floor))]:.1f} ms"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.bench.service_overhead`: the same as `cascade-service bench service-overhead`."""
    return tools.main("service_overhead", argv, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
