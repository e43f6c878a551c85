"""Lossy final verification through the real engine (tiny random-weight Llama family).

- Every rule at its strict end gives `transformers` greedy `generate()`'s tokens (the oracle).
- The accounting is checked against the target model run independently: a teacher-forced pass over
  the produced sequence finds every position where the output differs from the target's argmax, and
  their count must equal `off_target_tokens`.
- The CLI takes --verify/--alpha/--beta and reports the accounting; bad knobs exit 2 naming the flag.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from cascade_service.cli import main
from cascade_service.config import GenerationConfig
from cascade_service.core.verify import RULES, STRICT_ALPHA, Verification
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import make_engine, oracle

PROMPTS = random_prompts(2, 12, seed=41)
N = 20


@pytest.fixture(scope="module")
def engine(tiny_family):
    return make_engine(tiny_family, ["close", "mid", "mag"], [[3, 2, 0], [0, 2, 4], [0, 0, 4]], 2.0)


@pytest.mark.parametrize("rule", [r for r in RULES if r != "exact"])
def test_each_rule_at_its_strict_end_reproduces_the_oracle(tiny_family, engine, rule):
    gen = GenerationConfig(speculation="fixed", max_new_tokens=N, verification=Verification(rule, STRICT_ALPHA[rule]))
    for prompt in PROMPTS:
        result = engine.generate(prompt, gen)
        assert result.token_ids == oracle(tiny_family["target"], prompt, N)
        assert result.stats.off_target_tokens == 0 and result.stats.tv_deviation == 0.0


@pytest.mark.parametrize("rule,alpha", [("token-v3", 0.6), ("chow", 0.6), ("diff", 0.3), ("fuzzy-tv", 0.7)])
def test_off_target_count_matches_an_independent_teacher_forced_target(tiny_family, engine, rule, alpha):
    model = AutoModelForCausalLM.from_pretrained(tiny_family["target"], local_files_only=True).eval()
    off_total = 0
    for prompt in PROMPTS:
        result = engine.generate(
            prompt, GenerationConfig(speculation="fixed", max_new_tokens=N, verification=Verification(rule, alpha))
        )
        sequence = prompt + result.token_ids
        with torch.inference_mode():
            logits = model(torch.tensor([sequence])).logits[0]
        best = logits[len(prompt) - 1 : len(sequence) - 1].argmax(dim=-1).tolist()
        differs = sum(a != b for a, b in zip(result.token_ids, best))
        assert result.stats.off_target_tokens == differs
        assert result.stats.tv_deviation == pytest.approx(differs)
        assert result.stats.verification == f"{rule} (alpha {alpha:g})"
        off_total += differs
    assert off_total > 0  # the setting is lossy enough to exercise the count


def test_cli_generate_with_a_lossy_rule_reports_the_accounting(tiny_family, capsys):
    args = [
        "generate",
        "--target",
        str(tiny_family["target"]),
        "--drafter",
        str(tiny_family["mid"]),
        "mag",
        "--k-matrix",
        "[[4,2],[0,4]]",
        "--prompt",
        "hello world",
        "--max-new-tokens",
        "12",
        "--json",
    ]
    assert main(args + ["--verify", "token-v3", "--alpha", "0.5"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["verification"] == "token-v3 (alpha 0.5)"
    assert isinstance(stats["off_target_tokens"], int) and stats["tv_deviation"] >= 0
    assert main(args + ["--verify", "lossy", "--alpha", "0.2", "--beta", "tuned"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["verification"] == "lossy (alpha 0.2, beta tuned)"
    for bad, flag in (
        (["--verify", "token-v9"], "--verify"),
        (["--verify", "token-v3", "--alpha", "2"], "--alpha"),
        (["--alpha", "0.1"], "--alpha"),
        (["--verify", "lossy", "--alpha", "0.5", "--beta", "0.1"], "--beta"),
        (["--verify", "lossy", "--beta", "x"], "--beta"),
    ):
        assert main(args + bad) == 2
        assert flag in capsys.readouterr().err
