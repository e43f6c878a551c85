"""Adaptive draft length in the real cascade: it changes how long blocks are, never the output.

- Greedy output with SpecDec++ or confidence stopping equals `transformers` greedy `generate()`.
- The stopping rule runs: a head that predicts rejection everywhere cuts blocks to two tokens (the
  rule's minimum), and a confident threshold of 0.999 cuts every block to one token.
- Through the service, with the drafter in its own deployment, the stopper runs in the replica and
  the output equals in-process.
- Config and CLI errors name the field / flag.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import yaml

from cascade_service.cli import main
from cascade_service.config import ConfigError, GenerationConfig, MaGConfig, ModelTierConfig, load_config, make_cascade
from cascade_service.core.adaptive import AdaptiveLength
from cascade_service.inprocess import InProcess
from cascade_service.models.acceptance_head import AcceptanceHead
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle

PROMPTS = random_prompts(2, 10, seed=51)
N = 20


def _head(tmp_path, hidden: int, bias: float) -> str:
    """A head whose prediction is sigmoid(bias) everywhere (zero weights): a controllable rule."""
    head = AcceptanceHead(hidden, depth=1)
    with torch.no_grad():
        for param in head.parameters():
            param.zero_()
        head.out.bias.fill_(bias)
    path = tmp_path / f"head-{bias}"
    head.save(path)
    return str(path)


def make_engine(family, k, adaptive=None):
    drafters = [ModelTierConfig("mid", str(family["mid"]))]
    cascade = make_cascade(ModelTierConfig("target", str(family["target"])), drafters, k, 1.0, None, adaptive)
    return InProcess(cascade)


def test_adaptive_stopping_keeps_greedy_output_exact(tiny_family, tmp_path):
    hidden = InProcess(
        make_cascade(ModelTierConfig("t", str(tiny_family["mid"])), [], None, 1.0)
    ).target.config.hidden_size
    settings = {
        "specdec": AdaptiveLength("specdec", 0.5, _head(tmp_path, hidden, 0.5)),
        "confidence": AdaptiveLength("confidence", 0.3),
    }
    for name, spec in settings.items():
        engine = make_engine(tiny_family, [[8]], {"mid": spec})  # sd:mid, at most 8 drafts
        for prompt in PROMPTS:
            assert engine.generate(prompt, GenerationConfig(max_new_tokens=N)).token_ids == oracle(
                tiny_family["target"], prompt, N
            ), name


def test_the_stopping_rule_sets_the_block_length(tiny_family, tmp_path):
    hidden = InProcess(
        make_cascade(ModelTierConfig("t", str(tiny_family["mid"])), [], None, 1.0)
    ).target.config.hidden_size
    fixed = make_engine(tiny_family, [[8]])
    pessimist = make_engine(tiny_family, [[8]], {"mid": AdaptiveLength("specdec", 0.5, _head(tmp_path, hidden, -5.0))})
    confident = make_engine(tiny_family, [[8]], {"mid": AdaptiveLength("confidence", 0.999)})
    gen = GenerationConfig(max_new_tokens=N, speculation="fixed")  # every round as scheduled: what the rule stops
    stats = {
        name: e.generate(PROMPTS[0], gen).stats
        for name, e in (("fixed", fixed), ("pessimist", pessimist), ("confident", confident))
    }
    drafted = {name: s.reviews["target"].drafted / s.reviews["target"].reviews for name, s in stats.items()}
    assert drafted["fixed"] > 6  # 8 per block but the last
    assert 1.5 < drafted["pessimist"] <= 2.0  # P(reject) > 0.5 from the second token on: blocks of 2
    assert drafted["confident"] <= 1.0 + 1e-9  # max q < 0.999 on every token: blocks of 1


def _hidden(family, tier: str) -> int:
    return InProcess(make_cascade(ModelTierConfig("t", str(family[tier])), [], None, 1.0)).target.config.hidden_size


def _mean_block(result) -> float:
    review = result.stats.reviews["target"]
    return review.drafted / review.reviews


def test_a_request_threshold_sets_the_block_length_of_a_lone_drafter(tiny_family, tmp_path):
    # The head predicts acceptance 0.5 for every token; SpecDec++ judges token i on tokens 1..i-1, so it
    # stops at the first i with 1 - 0.5**(i - 1) > h: blocks of 3 at h = 0.6, of 5 at h = 0.9.
    head = _head(tmp_path, _hidden(tiny_family, "mid"), 0.0)
    engine = make_engine(tiny_family, [[8]], {"mid": AdaptiveLength("specdec", 0.6, head)})
    expected = oracle(tiny_family["target"], PROMPTS[0], N)
    blocks = {}
    for h in (None, 0.6, 0.9):
        result = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=N, stop_threshold=h, speculation="fixed"))
        assert result.token_ids == expected, h
        blocks[h] = _mean_block(result)
    assert blocks[None] == blocks[0.6]  # unset: the configured threshold
    assert 2.0 < blocks[0.6] <= 3.0 and 4.0 < blocks[0.9] <= 5.0, blocks


def test_specdec_stops_a_reviewing_tier_part_and_keeps_the_output_exact(tiny_family, tmp_path):
    # close reviews mid's drafts (row [0, 3]) and owes the target 4 tokens a block. With an acceptance
    # head on close, its part ends where SpecDec++ says so, and the target reviews shorter blocks.
    drafters = [ModelTierConfig("close", str(tiny_family["close"])), ModelTierConfig("mid", str(tiny_family["mid"]))]
    target = ModelTierConfig("target", str(tiny_family["target"]))
    head = _head(tmp_path, _hidden(tiny_family, "close"), 0.0)
    fixed = InProcess(make_cascade(target, drafters, [[4, 0], [0, 3]], 1.0))
    adaptive = InProcess(
        make_cascade(target, drafters, [[4, 0], [0, 3]], 1.0, None, {"close": AdaptiveLength("specdec", 0.6, head)})
    )
    for prompt in PROMPTS:
        expected = oracle(tiny_family["target"], prompt, N)
        gen = GenerationConfig(max_new_tokens=N, speculation="fixed")  # every round as scheduled
        plain = fixed.generate(prompt, gen)
        short = adaptive.generate(prompt, gen)
        longer = adaptive.generate(prompt, replace(gen, stop_threshold=0.9))
        assert plain.token_ids == short.token_ids == longer.token_ids == expected
        assert _mean_block(plain) >= 4.0  # the quota, and the overshoot of close's last round
        assert _mean_block(short) <= 3.0 < _mean_block(plain)  # stopped at the third token at h = 0.6
        assert _mean_block(short) < _mean_block(longer) <= 5.0
        assert short.stats.to_dict()["tiers"]["mid"]["drafted"] > 0  # close still reviews mid


def test_adaptive_through_the_service_equals_in_process(tiny_family, tmp_path):
    from cascade_service.client import CascadeClient
    from cascade_service.serving.local import LocalService

    hidden = InProcess(
        make_cascade(ModelTierConfig("t", str(tiny_family["mid"])), [], None, 1.0)
    ).target.config.hidden_size
    raw = {
        "tiers": {
            "target": {"name": "target", "path": str(tiny_family["target"])},
            "drafters": [{"name": "mid", "path": str(tiny_family["mid"])}],
        },
        "schedule": {
            "k_matrix": [[8]],
            "adaptive": {"mid": {"rule": "specdec", "threshold": 0.5, "head": _head(tmp_path, hidden, -5.0)}},
        },
        "serving": {"torch_threads": 1},
    }
    path = tmp_path / "adaptive.yaml"
    path.write_text(yaml.safe_dump(raw))
    engine = InProcess(load_config(path).cascade)
    with LocalService(str(path), num_cpus=4) as service, CascadeClient(service.address, timeout_s=120) as client:
        for prompt in PROMPTS:
            # every round as scheduled on both sides: the floor decides from timings, which differ
            mine = engine.generate(prompt, GenerationConfig(max_new_tokens=N, speculation="fixed"))
            served = client.generate(prompt_token_ids=prompt, max_new_tokens=N, speculation="fixed")
            assert served.token_ids == mine.token_ids == oracle(tiny_family["target"], prompt, N)
            assert served.stats["target_calls"] == mine.stats.target_calls  # same (short) blocks remotely
            # The request's threshold reaches the replica where the stopper runs: with this head
            # (acceptance 0.0067) h = 0.999 stops at the third token instead of the second.
            mine = engine.generate(
                prompt, GenerationConfig(max_new_tokens=N, stop_threshold=0.999, speculation="fixed")
            )
            served = client.generate(
                prompt_token_ids=prompt, max_new_tokens=N, stop_threshold=0.999, speculation="fixed"
            )
            assert served.token_ids == mine.token_ids
            assert served.stats["target_calls"] == mine.stats.target_calls
            assert 2.0 < _mean_block(mine) <= 3.0
            assert served.stats["tiers"]["mid"]["drafted"] == mine.stats.to_dict()["tiers"]["mid"]["drafted"] > 0


def test_adaptive_config_and_cli_errors_name_the_field(tiny_family, tmp_path, capsys):
    drafters = [ModelTierConfig("mid", str(tiny_family["mid"])), MaGConfig()]
    target = ModelTierConfig("target", str(tiny_family["target"]))
    with pytest.raises(ConfigError, match="schedule.adaptive.mid: this tier reviews"):
        make_cascade(target, drafters, [[4, 0], [0, 4]], 1.0, None, {"mid": AdaptiveLength("confidence", 0.5)})
    with pytest.raises(ConfigError, match="schedule.adaptive.mag: not a model drafter"):
        make_cascade(target, drafters, [[4, 2], [0, 4]], 1.0, None, {"mag": AdaptiveLength("confidence", 0.5)})
    with pytest.raises(ValueError, match="threshold must be in"):
        AdaptiveLength("confidence", 1.5)
    with pytest.raises(ValueError, match="head"):
        AdaptiveLength("specdec", 0.5)
    args = [
        "generate",
        "--target",
        str(tiny_family["target"]),
        "--drafter",
        str(tiny_family["mid"]),
        "--k-matrix",
        "[[6]]",
        "--prompt",
        "abc",
        "--max-new-tokens",
        "8",
        "--json",
    ]
    assert main(args + ["--adaptive-length", "confidence", "--stop-threshold", "0.4"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"]
    for bad, flag in (
        (["--adaptive-length", "confidence"], "--stop-threshold"),
        (["--adaptive-length", "confidence", "--stop-threshold", "2"], "--stop-threshold"),
        (["--adaptive-length", "specdec", "--stop-threshold", "0.5"], "--head"),
        (["--stop-threshold", "0.5"], "--stop-threshold: no tier of this cascade has an acceptance head"),
        (["--stop-threshold", "1.5"], "--stop-threshold must be in (0, 1)"),
        (["--head", "x"], "--head and --adaptive-tier go with --adaptive-length"),
        (
            ["--adaptive-length", "specdec", "--stop-threshold", "0.5", "--head", str(tmp_path / "none")],
            "acceptance head",
        ),
    ):
        assert main(args + bad) == 2, bad
        assert flag in capsys.readouterr().err
