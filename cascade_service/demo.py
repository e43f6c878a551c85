"""`cascade-service demo`: the main job on embedded defaults.

Builds the demo zoo if it is missing (offline, <= 10 minutes on 2 cores; instant afterwards), then
decodes held-out prompts with the large model alone and with the cascade, side by side in one
process, and prints the outputs and a speed table.
"""

from __future__ import annotations

import statistics
import time

from .config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from .core.cascade import Lookup
from .engine import Engine
from .paths import zoo_dir
from .prompts import read_prompts

# Tuned on the zoo's tune prompts (`cascade-service tune`, see README "Benchmark").
DEMO_K_MATRIX = [[3, 0, 0], [0, 1, 0], [0, 0, 4]]  # = configs/demo.yaml
DEMO_LENIENCY = 2.0
DEMO_LOOKUP = Lookup(min_match=2, tokens=20)


def demo_engine(preset: str = "demo") -> tuple[Engine, list[str]]:
    from .models.zoo import build_zoo

    zoo = build_zoo(preset, zoo_dir(preset))
    target = ModelTierConfig("large", str(zoo["large"]))
    drafters = [ModelTierConfig("base", str(zoo["base"])), ModelTierConfig("small", str(zoo["small"])),
                MaGConfig(bigram=str(zoo["bigram"]))]
    engine = Engine(make_cascade(target, drafters, DEMO_K_MATRIX, DEMO_LENIENCY, DEMO_LOOKUP))
    return engine, read_prompts(str(zoo["prompts"]))


def run_demo(max_new_tokens: int = 64, prompts: int = 4, preset: str = "demo") -> int:
    print(f"loading the {preset} zoo (built on first use: up to 10 minutes, offline)", flush=True)
    cascade, texts = demo_engine(preset)
    methods = {"ar (large alone)": cascade.variant([]), "csd base+small+mag": cascade}
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    speeds: dict[str, list[float]] = {name: [] for name in methods}
    outputs: dict[str, list[list[int]]] = {name: [] for name in methods}
    calls: dict[str, list[float]] = {name: [] for name in methods}
    for text in texts[:prompts]:
        ids = cascade.encode(text)
        for name, engine in methods.items():  # interleaved: machine drift hits both alike
            start = time.perf_counter()
            result = engine.generate(ids, gen)
            speeds[name].append(len(result.token_ids) / (time.perf_counter() - start))
            outputs[name].append(result.token_ids)
            calls[name].append(result.stats.target_calls / max(1, result.stats.generated))
    reference = next(iter(methods))
    for text, ids in zip(texts[:prompts], outputs["csd base+small+mag"]):
        print(f"\n--- prompt (tail): ...{text[-120:]!r}\n--- continuation: {cascade.decode_text(ids)!r}")
    base = statistics.median(speeds[reference])
    print(f"\n{'method':<22} {'tok/s (median)':>14} {'speedup':>8} {'target calls/tok':>17} {'same tokens':>12}")
    for name in methods:
        speed = statistics.median(speeds[name])
        same = outputs[name] == outputs[reference]
        print(f"{name:<22} {speed:>14.1f} {speed / base:>7.2f}x {statistics.mean(calls[name]):>17.3f} {str(same):>12}")
    return 0
