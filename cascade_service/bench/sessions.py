"""Sessions and shared prefixes through the standalone server, with and without the prefix cache.

    cascade-service bench sessions [--config configs/demo.yaml] [--turns 10]
        [--turn-tokens 170] [--new-tokens 16] [--shared 16] [--prefix 1000]

For each KV storage (`kv: pool`, the paged pool with its prefix cache; `kv: dynamic`, a cache per
request and no prefix cache: how every turn re-read its history before), one standalone server
(gRPC on loopback, an in-memory session store) in turn:

- conversations: `--sessions` sessions one after another, each of `--turns` turns adding about
  `--turn-tokens` tokens of code the zoo never trained on (the installed click, jinja2, packaging and
  tqdm sources: `zoo.evaluate`; each session its own) and streaming `--new-tokens` tokens back. Printed:
  the median over sessions of each turn's time to first token (turn 1, the middle, the last, and
  turns 1-3 against the last three), a session's length, per tier the tokens the last turn read
  (fed through the model) and found cached, and (pool storage) the last turn's time to first token
  against one target pass over its new tokens after a history as long (the physical floor);
- shared prefixes: `--shared` concurrent requests with one `--prefix`-token header and their own
  24-token suffixes, cold (they all arrive at once) and warm (after one request with the header
  alone). Printed: the context tokens the target read in them all against one header plus the
  suffixes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from ..client import CascadeClient
from ..config import Config, ModelTierConfig, load_config
from ..models.kvpool import BLOCK
from ..models.kvsize import kv_bytes_per_token
from ..standalone import start_standalone
from ..zoo.evaluate import eval_package_files
from . import tools

STORAGES = ("pool", "dynamic")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument(
        "--turns", type=int, default=10, help="turns a session (each adds --turn-tokens + --new-tokens)"
    )
    parser.add_argument("--sessions", type=int, default=3, help="conversations, each on its own text (medians)")
    parser.add_argument("--turn-tokens", type=int, default=170)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--shared", type=int, default=16, help="concurrent requests sharing one header")
    parser.add_argument("--prefix", type=int, default=1000, help="tokens in the shared header")
    parser.add_argument("--storages", default=",".join(STORAGES))


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    for kv in args.storages.split(","):
        if kv not in STORAGES:
            raise ValueError(f"--storages: {kv!r} is not one of {STORAGES}")
        print(f"== kv: {kv} ({'prefix cache' if kv == 'pool' else 'no prefix cache'})")
        server = start_standalone(_with_storage(config, kv), adapt_to_load=False)
        try:
            with CascadeClient(f"127.0.0.1:{server.port}", timeout_s=600) as client:
                per_session = args.turn_tokens * args.turns
                stream = _held_out_code(server.engine.encode, per_session * args.sessions + 3 * args.prefix)
                # A first request of its own: the server's first passes (allocations, warm-up) are not a turn's.
                client.generate(prompt_token_ids=stream[-64:], max_new_tokens=args.new_tokens)
                runs = []
                for s in range(args.sessions):  # each session on text of its own: none finds another's
                    text = stream[s * per_session : (s + 1) * per_session]
                    turns = [text[i * args.turn_tokens : (i + 1) * args.turn_tokens] for i in range(args.turns)]
                    runs.append(_conversation(client, turns, args.new_tokens))
                _report(runs, args.turn_tokens, args.new_tokens)
                if kv == "pool":  # the physical floor of the last turn's first token (issue 59 point 18)
                    # as long as the last turn's history: the session's tokens before its prompt and output
                    before = runs[-1][2] - args.turn_tokens - args.new_tokens
                    history = stream[:before]  # the stream holds every session: longer than one
                    floor = _one_pass(server.engine, history, stream[before : before + args.turn_tokens + 1])
                    last = statistics.median(firsts[-1] for firsts, _, _ in runs)
                    print(
                        f"  the last turn's time to first token {last:.3f} s against one target pass over its "
                        f"{args.turn_tokens + 1} new tokens after {len(history)} ({floor:.3f} s): "
                        f"x{last / floor:.2f} (goal <= 1.2)"
                    )
                if kv == "pool":
                    _memory(server.engine.models())
                rest = stream[per_session * args.sessions :]
                suffixes = [rest[2 * args.prefix + 24 * i :][:24] for i in range(args.shared)]
                name = server.engine.cascade.target.name
                for warm, header in ((False, rest[: args.prefix]), (True, rest[args.prefix : 2 * args.prefix])):
                    _shared(client, header, suffixes, name, warm)
        finally:
            server.stop()
    return 0


def _with_storage(config: Config, kv: str) -> Config:
    cascade = config.cascade
    target = replace(cascade.target, kv=kv)
    drafters = tuple(replace(d, kv=kv) if isinstance(d, ModelTierConfig) else d for d in cascade.drafters)
    return replace(config, cascade=replace(cascade, target=target, drafters=drafters))


def _held_out_code(encode, tokens: int) -> list[int]:
    """`tokens` tokens of code the zoo never trained on."""
    files = [p for paths in eval_package_files().values() for p in paths]
    stream: list[int] = []
    for path in files:
        stream += encode(Path(path).read_text(errors="replace"))
        if len(stream) >= tokens:
            return stream[:tokens]
    raise SystemExit(f"not enough held-out code for {tokens} tokens")


def _conversation(client: CascadeClient, turns: list[list[int]], new_tokens: int) -> tuple[list[float], dict, int]:
    """One session over `turns`: each turn's time to first token, the last turn's stats, the session's length."""
    session = client.create_session()
    firsts: list[float] = []
    stats: dict = {}
    length = 0
    for turn in turns:
        start = time.perf_counter()
        first = None
        for chunk in client.stream(session_id=session.session_id, prompt_token_ids=turn, max_new_tokens=new_tokens):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - start
            if chunk.stats:
                stats = chunk.stats
                length = chunk.session_length or length
        firsts.append(first if first is not None else time.perf_counter() - start)
    client.delete_session(session.session_id)
    return firsts, stats, length


def _one_pass(engine, history: list[int], new: list[int], repeats: int = 5) -> float:
    """Median seconds of the target's one pass over `new` after a cache of `history` (built untimed), on
    the engine loop's thread as the server runs its passes: the least a turn's first token can take
    (its prompt read in one pass, its history cached)."""
    import torch

    target = next(m for m in engine.models() if m.name == engine.cascade.target.name)

    def timed() -> float:
        times = []
        with torch.inference_mode():
            for _ in range(repeats + 1):
                cache = target.new_cache("bench-floor")  # a salt of its own: nothing found in the prefix cache
                for start in range(0, len(history), 512):
                    target.forward_now(history[start : start + 512], cache, 1)
                began = time.perf_counter()
                target.forward_now(new, cache, 1)
                times.append(time.perf_counter() - began)
                if target.kv == "pool":
                    target.kv_pool.truncate(cache, 0)
        return statistics.median(times[1:])  # the first is a warm-up

    return engine.core.run(timed)


def _report(runs: list[tuple[list[float], dict, int]], turn_tokens: int, new_tokens: int) -> None:
    """Per turn the median over the conversations (each on text of its own)."""
    per_turn = [statistics.median(times) for times in zip(*(firsts for firsts, _, _ in runs))]
    n, (_, stats, length) = len(per_turn), runs[-1]
    first3, last3 = statistics.median(per_turn[:3]), statistics.median(per_turn[-3:])
    print(
        f"conversation ({len(runs)} sessions, medians per turn): {n} turns, {length} tokens in a session at the end; "
        f"time to first token turn 1 {per_turn[0]:.3f} s, turn {n // 2} {per_turn[n // 2 - 1]:.3f} s, turn {n} "
        f"{per_turn[-1]:.3f} s (x{per_turn[-1] / per_turn[0]:.2f} of turn 1); turns {n - 2}-{n} {last3:.3f} s, "
        f"x{last3 / first3:.2f} of turns 1-3"
    )
    reads = ", ".join(
        f"{name} read {int(t.get('tokens_processed', 0))} cached {int(t.get('tokens_cached', 0))}"
        for name, t in stats.get("tiers", {}).items()
        if "tokens_processed" in t
    )
    print(f"  last turn (+{turn_tokens} tokens, {new_tokens} out): {reads}")


def _memory(models) -> None:
    """Per model: the pool's bytes over the tokens its cached blocks hold, against the model's KV
    bytes per token (every request has ended: each block it holds is a full one of the prefix cache)."""
    for model in models:
        pool = model.kv_pool
        tokens = (pool.held + len(pool.cached)) * BLOCK
        per_token = kv_bytes_per_token(model.config, model.dtype)
        if tokens:
            print(
                f"  {model.name}: {pool.nbytes / 2**20:.1f} MiB for {tokens} cached tokens: "
                f"{pool.nbytes / tokens:.0f} bytes per token, x{pool.nbytes / tokens / per_token:.2f} of the "
                f"model's {per_token} (budget {pool.max_blocks} blocks, {pool.counters.evictions} evictions)"
            )


def _shared(client: CascadeClient, header: list[int], suffixes: list[list[int]], target: str, warm: bool) -> None:
    if warm:
        client.generate(prompt_token_ids=header, max_new_tokens=1)  # the header alone, first

    def one(suffix: list[int]) -> dict:
        return client.generate(prompt_token_ids=header + suffix, max_new_tokens=1).stats

    with ThreadPoolExecutor(len(suffixes)) as pool:
        stats = list(pool.map(one, suffixes))
    cached = [int(s["tiers"][target].get("tokens_cached", 0)) for s in stats]
    read = sum(len(header) + len(s) for s in suffixes) - sum(cached)
    ideal = len(header) + sum(len(s) for s in suffixes)
    print(
        f"shared header ({'after the header alone' if warm else 'cold'}): {len(suffixes)} concurrent requests of "
        f"{len(header)} + {len(suffixes[0])} tokens; the target read {read} context tokens, "
        f"x{read / ideal:.2f} of one header + the suffixes ({ideal}); cached per request: "
        f"median {statistics.median(cached)}, min {min(cached)}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.bench.sessions`: the same as `cascade-service bench sessions`."""
    return tools.main("sessions", argv, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
