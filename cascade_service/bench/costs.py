"""What each tier's step costs, alone and batched, relative to the target's: the table behind a schedule.

A drafter is worth its place in a K-matrix when what it saves the target outweighs its own steps
(EWIF, core.ewif), so a user tuning a schedule needs every tier's step time beside the acceptance.
A step is measured at 1 row (one request decoding) and at 16 rows (one batched pass of 16 requests'
single-token steps, models.batching), over a 64-token cache, after warm-up; medians of 7.
For a drafter that runs on another backend than transformers' (models.lean), the transformers step
is measured too, so the gain of the backend is read off the same table.
"""

from __future__ import annotations

from ..models.hf import HFModel, pass_time_s

ROWS = (1, 16)


def tier_costs(target: HFModel, drafters: dict[str, HFModel], plain: dict[str, HFModel]) -> dict[str, dict]:
    """{tier: {"backend", "params", "step_ms": {rows: ms}, "vs_target": {rows: ratio}, "hf_step_ms"?}}.

    `plain`: for drafters on another backend, the same weights on transformers' forward.
    """
    target_ms = {rows: _step_ms(target, rows) for rows in ROWS}
    out: dict[str, dict] = {}
    for name, model in {target.name: target, **drafters}.items():
        step = target_ms if model is target else {rows: _step_ms(model, rows) for rows in ROWS}
        entry: dict = {
            "backend": model.backend,
            "params": model.num_parameters,
            "step_ms": {str(r): ms for r, ms in step.items()},
            "vs_target": {str(r): ms / target_ms[r] for r, ms in step.items()},
        }
        if name in plain:
            entry["hf_step_ms"] = {str(r): _step_ms(plain[name], r) for r in ROWS}
        out[name] = entry
    return out


def _step_ms(model: HFModel, rows: int) -> float:
    # One row: the model's cached step time, which the SWI costs already measured in the same run.
    return 1e3 * (model.step_time_s() if rows == 1 else pass_time_s(model, rows))


def markdown(costs: dict[str, dict]) -> str:
    """The tier cost table of results.md."""
    lines = [
        "| tier | backend | params | step, 1 row | vs target | step, 16 rows | vs target | on transformers, 1 / 16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in costs.items():
        step, rel = c["step_ms"], c["vs_target"]
        plain = c.get("hf_step_ms")
        was = f"{plain['1']:.3f} / {plain['16']:.3f} ms" if plain else "same"
        lines.append(
            f"| `{name}` | {c['backend']} | {c['params'] / 1e6:.2f}M | {step['1']:.3f} ms | {rel['1']:.2f} "
            f"| {step['16']:.3f} ms | {rel['16']:.2f} | {was} |"
        )
    return "\n".join(lines) + "\n"
