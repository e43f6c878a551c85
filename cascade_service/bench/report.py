"""results.md (markdown tables) and the PNG plots, from results.json's content."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display; set before pyplot is imported
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from .costs import markdown as cost_table

COLUMNS = (
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("speedup vs hf-ar", "speedup_vs_hf_ar", "{:.2f}x"),
    ("vs ar (plain, same load)", "speedup_vs_ar", "{:.2f}x"),
    # decoding apart from the prompt's read (prefill or a prefix-cache hit decides a short request's tok/s)
    ("decode tok/s", "decode_tokens_per_s", "{:.2f}"),
    ("decode vs hf-ar", "decode_speedup_vs_hf_ar", "{:.2f}x"),
    ("decode vs ar", "decode_speedup_vs_ar", "{:.2f}x"),
    ("TTFT s", "ttft_s", "{:.2f}"),
    ("rounds that drafted", "drafted_round_share", "{:.0%}"),
    ("SWI (params)", "swi_params", "{:.2f}"),
    ("SWI (measured)", "swi_measured", "{:.2f}"),
    ("target calls/token", "target_calls_per_token", "{:.3f}"),
    ("mean accepted length", "mean_accepted_length", "{:.2f}"),
    ("orchestration ms/round", "orchestration_per_round_ms", "{:.3f}"),
    ("identical to hf-ar", "identical_to_hf_ar", "{}"),
)


def markdown(results: dict) -> str:
    """One row per method, then one sweep table per SD method, then what a user tunes a schedule by:
    each tier's step cost, the predicted speedup beside the measured one, acceptance by position."""
    lines = [_header("method", *(title for title, _, _ in COLUMNS), "setup")]
    for name, figures in results["methods"].items():
        lines.append(_row(_label(name, figures), *_cells(figures), _setup(figures)))
    for name, figures in results["methods"].items():
        if "sweep" in figures:
            lines += ["", f"SD sweep for `{name}` (best k = {figures['best_k']}):", ""]
            lines.append(_header("k", *(title for title, _, _ in COLUMNS)))
            lines += [_row(k, *_cells(f)) for k, f in figures["sweep"].items()]
    if "tier_costs" in results:
        lines += ["", "Step cost per tier (64 cached tokens, medians; 16 rows: one batched pass):", ""]
        lines.append(cost_table(results["tier_costs"]).rstrip("\n"))
    lines += _predicted(results["methods"])
    lines += _acceptance(results["methods"])
    lines += _entries(results["methods"])
    return "\n".join(lines) + "\n"


def _predicted(methods: dict) -> list[str]:
    """Predicted speedup over the target alone (SWI with measured step costs, i.e. EWIF realised on the
    run's own acceptance) beside the measured one, against `ar` where it ran (the same decode loop)."""
    base_name = "ar" if "ar" in methods else "hf-ar"
    base = methods[base_name]["tokens_per_s"]
    rows = [
        _row(_label(n, f), f"{f['swi_measured']:.2f}x", f"{f['tokens_per_s'] / base:.2f}x" if base else "-")
        for n, f in methods.items()
        if f.get("acceptance_by_position")
    ]
    if not rows:
        return []
    head = ["", "Predicted (SWI on measured step costs) and measured speedup:", ""]
    return [*head, _header("method", "predicted vs target alone", f"measured vs `{base_name}`"), *rows]


def _acceptance(methods: dict, positions: int = 8) -> list[str]:
    rows = [
        _row(_label(n, f), f"`{reviewer}`", *(f"{a:.2f}" for a in rates[:positions]), *["-"] * (positions - len(rates)))
        for n, f in methods.items()
        for reviewer, rates in f.get("acceptance_by_position", {}).items()
    ]
    if not rows:
        return []
    head = ["", f"Acceptance by draft position (first {positions}), per reviewing tier:", ""]
    return [*head, _header("method", "reviewer", *(str(i + 1) for i in range(positions))), *rows]


def _entries(methods: dict) -> list[str]:
    """Each K-matrix entry's part of its row's blocks (invariant 7), per cascade method."""
    rows = [
        _row(
            _label(n, f),
            f"`{reviewer}`",
            f"`{drafter}`",
            f"{e['blocks']} / {row['blocks'] - row['gated'] - e['ended']}",
            f"{e['share']:.1%}",
            e["ended"],
            row["gated"],
            e["tokens"],
        )
        for n, f in methods.items()
        for reviewer, row in f.get("rows", {}).items()
        for drafter, e in row["entries"].items()
    ]
    if not rows:
        return []
    head = ["", "K-matrix entries: blocks the drafter ran in / blocks that left it room, per reviewing tier:", ""]
    titles = ("method", "reviewer", "drafter", "ran / room", "share", "ended before", "gated", "tokens added")
    return [*head, _header(*titles), *rows]


def _label(name: str, figures: dict) -> str:
    """The method as it ran (only tiers that drafted); the name asked for when that differs."""
    label = figures.get("label", name)
    return f"`{label}`" if label == name else f"`{label}` (asked: `{name}`)"


def _cells(figures: dict) -> list[str]:
    return ["-" if figures.get(key) is None else fmt.format(figures[key]) for _, key, fmt in COLUMNS]


def _setup(figures: dict) -> str:
    setup = figures.get("setup", {})
    if "best_k" in figures:
        return f"K = [[{figures['best_k']}]]"
    if setup.get("drafters"):
        floor = ", under the floor" if setup.get("speculation") == "auto" else ""
        return f"K = {setup['k_matrix']}, leniency {setup['leniency']:g}{floor}"
    if "assistant" in setup:
        return f"assistant {setup['assistant']}"
    return ""


def _header(*titles: str) -> str:
    return _row(*titles) + "\n" + _row(*("---" for _ in titles))


def _row(*cells: str) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def plot_speedup(results: dict, path: Path) -> None:
    names = list(results["methods"])
    speedups = [results["methods"][n]["speedup_vs_hf_ar"] for n in names]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names)), 4.5))
    bars = ax.bar(range(len(names)), speedups, color=["#888888" if n.startswith("hf-") else "#1f77b4" for n in names])
    ax.bar_label(bars, fmt="%.2fx", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup vs hf-ar (tokens/s ratio)")
    ax.set_title(f"Greedy decoding, {results.get('max_new_tokens', '?')} new tokens (grey: transformers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance(results: dict, path: Path) -> None:
    """One panel per cascade method (SD at its best k): acceptance rate by draft position, per reviewer."""
    panels = [
        (n, f["acceptance_by_position"]) for n, f in results["methods"].items() if f.get("acceptance_by_position")
    ]
    cols = min(3, max(1, len(panels)))
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.5 * rows), squeeze=False)
    for ax, (name, by_reviewer) in zip(axes.flat, panels):
        for reviewer, rates in by_reviewer.items():
            ax.plot(range(1, len(rates) + 1), rates, marker="o", markersize=3, label=f"{reviewer} reviews")
        ax.set_title(name, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft position in block")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if not panels:
        axes.flat[0].text(0.5, 0.5, "no sd/csd methods in this run", ha="center", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
