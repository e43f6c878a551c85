"""`cascade-service demo`: the main job on built-in defaults.

Uses the family shipped with the package (no training; `--preset demo` trains the 8-minute family
instead, `--preset grown` makes the cost-realistic one), starts the service on built-in defaults
(local Ray, every model tier in the coordinator's replica, in-cluster session store, gRPC on
loopback), and decodes prompts from code the family never trained on three ways, interleaved, over
several passes: the large model alone and the cascade in-process (both in a child process of their own),
and the cascade through the client SDK. Prints the outputs, a speed table, the service / in-process
throughput per pass and the service's orchestration overhead per target round. Only those lines reach
the terminal: Ray's, Serve's, gRPC's, torch's and transformers' output goes to a log file under the home,
named at the end (quiet.py), unless `--verbose`.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from .config import load_config
from .models.hf import load_tokenizer
from .prompts import read_prompts
from .quiet import log_path, third_party_output
from .zoo.demo import DEFAULT_LAYOUT, DEFAULT_PRESET, demo_config


def run_demo(
    max_new_tokens: int = 64,
    prompts: int = 4,
    preset: str = DEFAULT_PRESET,
    layout: str = DEFAULT_LAYOUT,
    passes: int = 3,
    verbose: bool = False,
    config: str | None = None,
) -> int:
    """Decode prompts from code the zoo never trained on three ways: large alone and the cascade in-process
    (in a child process of their own), and the cascade through the service (Ray Serve tiers, gRPC edge,
    client SDK). The terminal shows the demo's own lines; third-party output (Ray, Ray Serve, gRPC,
    torch, transformers) goes to a log under the home, named at the end, unless `verbose`. `config`: a
    config of the user's (a fetched real family) instead of a zoo preset; its own `serving` section is
    the layout, and the prompts are third-party code (bench/prompts/disagree.jsonl)."""
    log = None if verbose else log_path("demo")
    with third_party_output(log) as out:
        decode_three_ways(out, max_new_tokens, prompts, preset, layout, passes, config)
    if log is not None:
        print(f"\nthird-party logs: {log}", flush=True)
    return 0


def decode_three_ways(
    out: TextIO,
    max_new_tokens: int,
    prompts: int,
    preset: str,
    layout: str,
    passes: int,
    config: str | None = None,
) -> None:
    """The demo itself (run_demo's arguments): its lines go to `out`, whatever else is printed to the
    process's stdout and stderr."""
    from .bench.inprocess import InProcessWorker
    from .bench.prompt_sets import DISAGREE
    from .client import CascadeClient
    from .serving.local import LocalService
    from .zoo.families import family

    say = functools.partial(print, file=out, flush=True)
    threads: int | None
    if config is None:
        say(f"loading the {preset} family (shipped, or made on first use, offline)")
        config_path = str(demo_config(preset, layout))
        texts = read_prompts(str(family(preset)["prompts"]))[:prompts]
        threads = 1  # the in-process baseline is fastest so on the zoo's tiny models (ar 651 against 565 tok/s)
    else:
        config_path, layout = config, "the config's"
        texts = read_prompts(str(DISAGREE))[:prompts]
        threads = load_config(config).serving.torch_threads  # as the service's replica runs it
    tokenizer = load_tokenizer(load_config(config_path).cascade.target.path)  # the models load elsewhere
    say(f"starting the service ({layout} layout): local Ray, Ray Serve, gRPC on loopback")
    # The in-process runs live in a child process: timed in this (Ray driver) process they would share
    # the CPU with Ray's threads and the gRPC edge, an unfair and unstable baseline on a small machine.
    with (
        InProcessWorker(config_path, torch_threads=threads) as worker,
        LocalService(config_path) as service,
        CascadeClient(service.address, timeout_s=600) as client,
    ):
        say(f"service up at {service.address}")
        # The two sides' torch threads where their passes run (an unequal setting would explain a gap)
        say(f"torch threads: in-process {worker.thread_settings()}; service replica {service.thread_settings()}")
        runs = {
            "ar (large alone)": lambda ids: _local(worker, "ar", ids, max_new_tokens),
            "csd in-process": lambda ids: _local(worker, "csd", ids, max_new_tokens),
            "csd via service": lambda ids: _remote(client, ids, max_new_tokens),
        }
        ids_all = [list(tokenizer(t)["input_ids"]) for t in texts]
        for run in runs.values():  # equal warm-up: every path decodes the first prompt once, untimed
            run(ids_all[0])
        results: list[dict[str, list[_Run]]] = []
        names = list(runs)
        for p in range(passes):
            results.append({name: [] for name in names})
            order = names[p % len(names) :] + names[: p % len(names)]  # rotated: no path always goes first
            for ids in ids_all:
                for name in order:  # interleaved: machine drift hits all alike
                    results[p][name].append(runs[name](ids))
    for text, outcome in zip(texts, results[0]["csd via service"]):
        say(
            f"\n--- prompt (tail): ...{text[-120:]!r}\n"
            f"--- continuation: {tokenizer.decode(outcome.tokens, skip_special_tokens=True)!r}"
        )
    _print_table(results, say)


@dataclass
class _Run:
    tokens: list[int]
    seconds: float
    target_calls: int
    hops: int
    orchestration_s: float  # the engine's own time (outside model passes), from its accounting


def _local(worker, variant: str, ids: list[int], max_new_tokens: int) -> _Run:
    reply = worker.generate(variant, ids, max_new_tokens)
    return _Run(reply["tokens"], reply["seconds"], reply["target_calls"], 0, reply["orchestration_s"])


def _remote(client, ids: list[int], max_new_tokens: int) -> _Run:
    start = time.perf_counter()
    result = client.generate(prompt_token_ids=ids, max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - start
    stats = result.stats
    hops = sum(int(t.get("hops", 0)) for t in stats["tiers"].values())
    orchestration = float(stats.get("loop_s", 0.0)) + float(stats.get("waited_s", 0.0))
    return _Run(result.token_ids, seconds, int(stats["target_calls"]), hops, orchestration)


def _throughput(runs: list[_Run]) -> float:
    return sum(len(r.tokens) for r in runs) / sum(r.seconds for r in runs)  # all tokens / all seconds


def _print_table(passes: list[dict[str, list[_Run]]], say: Callable[..., None]) -> None:
    reference, local, remote = "ar (large alone)", "csd in-process", "csd via service"
    results = {name: [run for p in passes for run in p[name]] for name in passes[0]}
    speed = {name: statistics.median(len(run.tokens) / run.seconds for run in runs) for name, runs in results.items()}
    say(f"\n{'method':<18} {'tok/s (median)':>14} {'vs ar':>7} {'target calls/tok':>17} {'same tokens as ar':>18}")
    for name, runs in results.items():
        calls = sum(r.target_calls for r in runs) / max(1, sum(len(r.tokens) for r in runs))
        same = [r.tokens for r in runs] == [r.tokens for r in results[reference]]
        say(f"{name:<18} {speed[name]:>14.1f} {speed[name] / speed[reference]:>6.2f}x {calls:>17.3f} {same!s:>18}")
    hops = sum(r.hops for r in results[remote])
    ratios = [_throughput(p[remote]) / _throughput(p[local]) for p in passes]
    say(
        f"\nservice / in-process throughput (all tokens / all seconds), per pass: "
        f"{', '.join(f'{r:.2f}x' for r in ratios)}; median {statistics.median(ratios):.2f}x "
        f"({_throughput(results[remote]):.1f} / {_throughput(results[local]):.1f} tok/s over all passes)"
    )
    rounds = {name: sum(r.target_calls for r in results[name]) for name in (local, remote)}
    per_round = {name: 1000 * sum(r.orchestration_s for r in results[name]) / max(1, rounds[name]) for name in rounds}
    say(
        f"orchestration per target round, from the engine's accounting (wall time outside model passes): "
        f"{per_round[local]:.2f} ms in-process, {per_round[remote]:.2f} ms in the service "
        f"({hops / max(1, rounds[remote]):.2f} tier hops per round)"
    )
