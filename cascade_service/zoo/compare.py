"""`cascade-service zoo evaluate`: measure any built family the way a fresh build reports itself.

Families with different tokenizers are compared on the same texts: the same prompt strings, the same
held-out and evaluation sources (losses per token, and per character, which does not depend on the
tokenizer). Used to put an older build beside a new one.
"""

from __future__ import annotations

import json
from pathlib import Path

from cascade_service.models.hf import load_tokenizer
from cascade_service.prompts import read_prompts
from cascade_service.zoo.build import TIERS, held_out_modules, read_text_file
from cascade_service.zoo.evaluate import context_rows, eval_package_files, eval_source_versions, evaluate_sources


def evaluate_dir(zoo: str | Path, prompts_path: str | Path | None = None, steps: int = 64, windows: int = 16) -> dict:
    """Evaluate the family in `zoo` (large, base, small dirs) on `prompts_path` (default: its own
    prompts.jsonl) and on the held-out and evaluation sources of this machine."""
    root = Path(zoo).expanduser()
    paths = {name: root / name for name in TIERS}
    missing = [str(p) for p in paths.values() if not p.is_dir()]
    if missing:
        raise FileNotFoundError(f"not a zoo directory (missing {', '.join(missing)})")
    prompts = read_prompts(str(prompts_path or root / "prompts.jsonl"))
    tokenizer = load_tokenizer(paths["large"])
    packages = eval_package_files()
    sources = {
        "heldout": [read_text_file(p) for p in held_out_modules()],
        "external": [read_text_file(p) for files in packages.values() for p in files],
    }
    report = evaluate_sources(paths, TIERS, tokenizer, sources, prompts, steps=steps, windows=windows)
    report["evaluation"] = {
        "zoo": str(root),
        "prompts": str(prompts_path or root / "prompts.jsonl"),
        "packages": eval_source_versions(list(packages)),
        "vocab_size": len(tokenizer),
    }
    return report


def format_evaluation(report: dict) -> str:
    rows = [
        f"{report['evaluation']['zoo']} (vocab {report['evaluation']['vocab_size']}), "
        f"prompts {report['evaluation']['prompts']}",
        f"{'tier':6} {'params':>8} {'step ratio 2t':>13} {'greedy':>7} "
        f"{'heldout nats/tok':>16} {'bits/char':>9} {'external nats/tok':>17} {'bits/char':>9}",
    ]
    for name, t in report["tiers"].items():
        rows.append(
            f"{name:6} {t['params'] / 1e6:7.2f}M {t['step_ratio']['threads_2']:13.2f} {t['greedy_agreement']:7.3f} "
            f"{t['heldout_loss']:16.3f} {t['heldout_bits_per_char']:9.3f} "
            f"{t['external_loss']:17.3f} {t['external_bits_per_char']:9.3f}"
        )
    rows += context_rows(report)
    loops = report["loops"]
    rows.append(
        f"large's greedy continuations ending in a loop: {loops['ending_in_a_loop']}/{loops['continuations']} "
        f"({loops['tokens']} tokens each)"
    )
    return "\n".join(rows)


def main_evaluate(zoo: str, prompts: str | None, out: str | None) -> int:
    report = evaluate_dir(zoo, prompts)
    print(format_evaluation(report))
    if out:
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return 0
