"""Encoder-decoder tiers on CUDA: the encoder output, the decoder cache and the cascade's reviews on the
GPU give the target's own greedy output there (transformers' generate() on the same device)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

from cascade_service.config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.inprocess import InProcess
from cascade_service.zoo.tiny import random_prompts

from .oracle import GPU

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs CUDA")]


def test_an_encoder_decoder_cascade_on_cuda_is_the_targets_greedy_output(tiny_family_factory):
    t5 = tiny_family_factory("t5")
    engine = InProcess(
        make_cascade(
            ModelTierConfig("target", str(t5["target"]), device="cuda"),
            [ModelTierConfig("close", str(t5["close"]), device="cuda"), MaGConfig()],
            [[3, 2], [0, 4]],
            1.5,
        )
    )
    assert engine.target.device.type == "cuda"
    model = AutoModelForSeq2SeqLM.from_pretrained(t5["target"], local_files_only=True).eval().to("cuda")
    for prompt in random_prompts(3, 10, seed=71):
        with torch.inference_mode():
            expected = model.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=20)
        got = engine.generate(prompt, GenerationConfig(max_new_tokens=20)).token_ids
        assert got == expected[0, 1:].tolist()
