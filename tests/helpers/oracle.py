"""The independent oracle (plain `transformers` greedy `generate()`) and an engine over the tiny family."""

from __future__ import annotations

from collections import Counter

import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList

from cascade_service.config import MaGConfig, ModelTierConfig, make_cascade
from cascade_service.inprocess import InProcess

# One position's float32 log-probability differs between target passes of different shapes (a plain step,
# the review of a block of two or of four drafts, beside other rows): a CPU matmul's rounding depends on the
# shape. Seen up to 5e-6 on the tiny family; tokens and their order are compared exactly, values to this.
LOGPROB_TOLERANCE = 1e-4


class OpenAIPenalties:
    """OpenAI's presence and frequency penalties as a transformers LogitsProcessor, written here from the
    API's definition (logit -= frequency * count + presence * [count > 0], counts over the output only)."""

    def __init__(self, prompt_length: int, presence: float, frequency: float):
        self.start, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids):
            for token, count in Counter(ids[self.start :].tolist()).items():
                scores[row, token] -= self.frequency * count + self.presence
        return scores


def oracle(target_dir, prompt, max_new_tokens, eos_id=None, logit_bias=None, repetition_penalty=None, penalties=None):
    """`logit_bias` ({token: bias}): transformers' own SequenceBiasLogitsProcessor (generate's sequence_bias);
    `repetition_penalty`: generate's own; `penalties` (presence, frequency): OpenAIPenalties."""
    extra: dict = {"sequence_bias": [[[t], float(b)] for t, b in logit_bias.items()]} if logit_bias else {}
    if repetition_penalty is not None:
        extra["repetition_penalty"] = repetition_penalty
    if penalties is not None:
        extra["logits_processor"] = LogitsProcessorList([OpenAIPenalties(len(prompt), *penalties)])
    out = greedy_generate(target_dir, prompt, max_new_tokens, eos_token_id=eos_id, **extra)
    return out[0, len(prompt) :].tolist()


def greedy_generate(target_dir, prompt, max_new_tokens, **options):
    """The target's plain greedy `generate()` over one prompt, with `options` (processors, scores) as given."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True).eval()
    with torch.inference_mode():
        return model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            **options,
        )


def make_engine(family, names, k_matrix, leniency, bigram=None, lookup=None, loopback=False):
    drafters = [MaGConfig(bigram=bigram) if n == "mag" else ModelTierConfig(n, str(family[n])) for n in names]
    cascade = make_cascade(ModelTierConfig("target", str(family["target"])), drafters, k_matrix, leniency, lookup)
    return InProcess(cascade, loopback=loopback)
