"""Several choices of one prompt: do they decode together, or one after another?

    cascade-service bench choices [--config configs/demo.yaml] [--prompts 4] [--n 4]
        [--new-tokens 64] [--repeats 2]

The standalone gRPC server in this process over the config's cascade, its SDK client on loopback,
temperature 1, prompts from code the zoo never trained on (windows of held-out files, as
bench.prediction takes them). Per prompt and repeat: one `Generate` with `n` choices (they run as sibling
tasks of the engine loop: api.choices), then the same n choices as n calls one after another (seed + i
each). Printed: both times and their ratio per prompt, and the median ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from ..api.server import start_server
from ..client import CascadeClient
from ..config import GenerationConfig, load_config
from ..inprocess import InProcess
from ..sessions import MemoryStore
from . import tools
from .prediction import encoded_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)


def run(args: argparse.Namespace) -> int:
    engine = InProcess(load_config(args.config).cascade)
    server, port = start_server(engine.coordinator(MemoryStore(), GenerationConfig(max_new_tokens=args.new_tokens)))
    ratios = []
    print("prompt | repeat | n together (s) | one after another (s) | ratio")
    try:
        with CascadeClient(f"127.0.0.1:{port}", timeout_s=600) as client:
            for i, prompt in enumerate(encoded_prompts(engine, args.prompts, 120)):
                ask = {"prompt_token_ids": prompt, "max_new_tokens": args.new_tokens, "temperature": 1.0}
                client.generate(**ask | {"max_new_tokens": 4})  # the prompt's prefix cache, warm for both
                for repeat in range(args.repeats):
                    start = time.perf_counter()
                    together = client.generate(**ask, seed=repeat, n=args.n)
                    joint = time.perf_counter() - start
                    start = time.perf_counter()
                    apart = [client.generate(**ask, seed=repeat + c) for c in range(args.n)]
                    alone = time.perf_counter() - start
                    assert len(together.choices) == len(apart) == args.n
                    ratios.append(alone / joint)
                    print(f"{i} | {repeat} | {joint:.2f} | {alone:.2f} | {alone / joint:.2f}x")
    finally:
        server.stop(0)
    print(f"median: {args.n} choices together take {statistics.median(ratios):.2f}x less time than one after another")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.bench.choices`: the same as `cascade-service bench choices`."""
    return tools.main("choices", argv, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
