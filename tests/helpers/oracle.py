"""The independent oracle (plain `transformers` greedy `generate()`) and an engine over the tiny family."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from cascade_service.config import MaGConfig, ModelTierConfig, make_cascade
from cascade_service.engine import Engine


def oracle(target_dir, prompt, max_new_tokens, eos_id=None, logit_bias=None):
    """`logit_bias` ({token: bias}): transformers' own SequenceBiasLogitsProcessor (generate's sequence_bias)."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True).eval()
    extra = {"sequence_bias": [[[t], float(b)] for t, b in logit_bias.items()]} if logit_bias else {}
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_id,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            **extra,
        )
    return out[0, len(prompt) :].tolist()


def make_engine(family, names, k_matrix, leniency, bigram=None, lookup=None, loopback=False):
    drafters = [MaGConfig(bigram=bigram) if n == "mag" else ModelTierConfig(n, str(family[n])) for n in names]
    cascade = make_cascade(ModelTierConfig("target", str(family["target"])), drafters, k_matrix, leniency, lookup)
    return Engine(cascade, loopback=loopback)
