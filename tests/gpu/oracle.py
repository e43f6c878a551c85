"""The greedy oracle on a GPU: `transformers` `generate()` on the target's own device and dtype.

On a GPU a pass's arithmetic depends on its shape (other kernels for a block of k + 1 tokens than for
one token), so two tokens whose logits tie within the dtype's rounding may come out in either order.
Greedy identity is therefore checked as: equal to generate() up to the first position where the two
part, parting only at such a tie, and every emitted token ties the maximum of the target's own
uncached logits. Anything else (a wrong token, a wrong device, a crash) fails.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

GPU = torch.cuda.is_available()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load(target_dir: str | Path, device: str, dtype: str):
    model = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True, dtype=DTYPES[dtype])
    return model.eval().to(device)


def generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=device),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
        )
    return out[0, len(prompt) :].tolist()


def tolerance(model, value: float) -> float:
    """Two rounding steps of the model's dtype at `value` (float32: a generous 1e-4 relative)."""
    dtype = next(model.parameters()).dtype
    bits = {torch.bfloat16: 8, torch.float16: 11}.get(dtype)
    if bits is None:
        return 1e-4 * max(1.0, abs(value))
    return 2 * 2.0 ** (math.floor(math.log2(max(abs(value), 1e-30))) - bits + 1)


def logits(model, tokens: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.inference_mode():
        return model(torch.tensor([tokens], device=device)).logits[0].float().cpu()  # [S, V]


def assert_greedy(model, prompt: list[int], got: list[int], max_new_tokens: int) -> None:
    """`got` is the model's greedy continuation of `prompt` up to ties (see the module docstring)."""
    expected = generate(model, prompt, max_new_tokens)
    assert len(got) == len(expected)
    part = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if part is not None:
        row = logits(model, prompt + got[:part])[-1]
        gap = abs(float(row[got[part]] - row[expected[part]]))
        assert gap <= tolerance(model, float(row.max())), f"parted from generate() at {part} without a tie"
    rows = logits(model, prompt + got)[len(prompt) - 1 : -1]  # [len(got), V]
    for i, (row, token) in enumerate(zip(rows, got)):
        best = float(row.max())
        assert best - float(row[token]) <= tolerance(model, best), f"token {i} is not the target's argmax"
