"""`cascade-service demo`: the main job on embedded defaults.

Builds the tiny zoo if it is missing, then decodes a few prompts with the target alone and with the
cascade, side by side in one process, and prints the outputs and a speed table.
"""

from __future__ import annotations

import statistics
import time

from .config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from .engine import Engine
from .paths import zoo_dir

PROMPTS = [
    "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "for i in range(10):\n    print(i)\n",
]


def demo_engines(preset: str = "tiny") -> dict[str, Engine]:
    from .models.tiny import build_family

    family = build_family(zoo_dir(preset))
    target = ModelTierConfig("target", str(family["target"]))
    tiers = [ModelTierConfig("close", str(family["close"])), ModelTierConfig("mid", str(family["mid"])), MaGConfig()]
    return {
        "ar (target alone)": Engine(make_cascade(target, [], None, 1.0)),
        "csd close+mid+mag": Engine(make_cascade(target, tiers, [[4, 2, 0], [0, 2, 6], [0, 0, 6]], 1.5)),
    }


def run_demo(max_new_tokens: int = 48) -> int:
    print("building/loading the tiny zoo (random weights: the text is gibberish; exactness is the point)")
    engines = demo_engines()
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    rows = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    for prompt in PROMPTS:
        for name, engine in engines.items():  # interleaved: machine drift hits both alike
            ids = engine.encode(prompt)
            start = time.perf_counter()
            result = engine.generate(ids, gen)
            elapsed = time.perf_counter() - start
            outputs[name].append(result.token_ids)
            rows[name].append((len(result.token_ids) / elapsed, result.stats))
    reference = next(iter(engines))
    first = engines[reference]
    for i, prompt in enumerate(PROMPTS):
        print(f"\n--- prompt {i}: {prompt!r}\n{first.decode_text(outputs[reference][i])!r}")
    print(f"\n{'method':<22} {'tok/s (median)':>14} {'speedup':>8} {'target calls/tok':>17} {'identical':>10}")
    base_speed = statistics.median(speed for speed, _ in rows[reference])
    for name, runs in rows.items():
        speed = statistics.median(s for s, _ in runs)
        calls = sum(st.target_calls for _, st in runs) / max(1, sum(st.generated for _, st in runs))
        same = outputs[name] == outputs[reference]
        print(f"{name:<22} {speed:>14.1f} {speed / base_speed:>7.2f}x {calls:>17.3f} {str(same):>10}")
    return 0
