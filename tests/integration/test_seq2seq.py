"""Encoder-decoder tiers (models.seq2seq): a cascade of T5 models is the target's own greedy output.

The oracle is plain `transformers` `generate()` of the tiny T5 target (encoder input = the prompt,
decoder from its start token), for vertical and horizontal cascades, with MaG, with leniency, and
with the batcher running concurrent requests.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

from cascade_service.config import ConfigError, GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.core.encdec import decoder_context
from cascade_service.inprocess import InProcess
from cascade_service.models.hf import HFModel
from cascade_service.models.seq2seq import Seq2SeqCache
from cascade_service.zoo.tiny import random_prompts

from ..helpers.threads import concurrently


@pytest.fixture(scope="module")
def t5(tiny_family_factory):
    return tiny_family_factory("t5")


def seq2seq_oracle(target_dir, prompt, max_new_tokens):
    model = AutoModelForSeq2SeqLM.from_pretrained(target_dir, local_files_only=True).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, 1:].tolist()  # after the decoder start token


def engine(family, names, k_matrix, leniency=1.0):
    drafters = [MaGConfig() if n == "mag" else ModelTierConfig(n, str(family[n])) for n in names]
    return InProcess(make_cascade(ModelTierConfig("target", str(family["target"])), drafters, k_matrix, leniency))


@pytest.mark.parametrize(
    "names, k_matrix, leniency",
    [
        (["close"], [[4]], 1.0),  # plain speculative decoding
        (["close", "mid"], [[3, 2], [0, 3]], 1.0),  # vertical and horizontal, two model drafters
        (["close", "mag"], [[2, 4], [0, 5]], 1.0),  # MaG at the bottom, copying from the input too
        (["close", "mid", "mag"], [[3, 1, 2], [0, 2, 3], [0, 0, 4]], 2.0),  # leniency at inner reviews
    ],
)
def test_an_encoder_decoder_cascade_is_the_targets_greedy_output(t5, names, k_matrix, leniency):
    cascade = engine(t5, names, k_matrix, leniency)
    assert cascade.target.encoder_decoder
    accepted = 0
    for prompt in random_prompts(3, 12, seed=4):
        out = cascade.generate(prompt, GenerationConfig(max_new_tokens=24))
        assert out.token_ids == seq2seq_oracle(t5["target"], prompt, 24)
        accepted += out.stats.reviews["target"].accepted
    assert accepted > 0  # drafts were taken: the decoder cache was extended by blocks and cropped


def test_the_encoder_runs_once_per_request_per_tier(t5, monkeypatch):
    from cascade_service.models import seq2seq

    calls: list[int] = []
    real = seq2seq.encode
    monkeypatch.setattr(seq2seq, "encode", lambda model, ids: calls.append(len(ids)) or real(model, ids))
    cascade = engine(t5, ["close", "mag"], [[2, 4], [0, 5]])
    prompt = random_prompts(1, 10, seed=8)[0]
    out = cascade.generate(prompt, GenerationConfig(max_new_tokens=20))
    assert out.token_ids == seq2seq_oracle(t5["target"], prompt, 20)
    assert calls == [10, 10]  # target and close, once each, over the prompt alone


def test_concurrent_encoder_decoder_requests_through_the_batcher_stay_exact(t5):
    cascade = engine(t5, ["close"], [[3]])
    prompts = [p[: 6 + i] for i, p in enumerate(random_prompts(6, 14, seed=12))]
    outputs: list[list[int]] = [[] for _ in prompts]
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait()
        outputs[i] = cascade.generate(prompts[i], GenerationConfig(max_new_tokens=16)).token_ids

    concurrently(len(prompts), run)
    for prompt, out in zip(prompts, outputs):
        assert out == seq2seq_oracle(t5["target"], prompt, 16)


def test_a_prompt_holding_the_decoder_start_token_is_refused(t5):
    cascade = engine(t5, ["close"], [[3]])
    with pytest.raises(ValueError, match="prompt: token 0 is the decoder start token"):
        cascade.generate([5, 0, 7], GenerationConfig(max_new_tokens=4))
    assert decoder_context([5, 7], 0) == [5, 7, 0] and decoder_context([5, 7], None) == [5, 7]


def test_a_cascade_mixing_encoder_decoder_and_decoder_only_tiers_is_refused(t5, tiny_family):
    mixed = make_cascade(
        ModelTierConfig("target", str(t5["target"]), key="tiers.target"),
        [ModelTierConfig("llama", str(tiny_family["close"]), key="tiers.drafters[0]")],
        [[3]],
        1.0,
    )
    with pytest.raises(ConfigError, match=r"tiers\.drafters\[0\]\.path \(tier 'llama'\): a decoder-only model"):
        InProcess(mixed)


def test_step_cost_of_an_encoder_decoder_tier_is_measured(t5):
    model = HFModel.load(t5["target"])
    assert isinstance(model.new_cache(), Seq2SeqCache)
    assert model.step_time_s(context_len=8, repeats=2) > 0


def test_sampled_encoder_decoder_cascade_has_the_targets_distribution(t5):
    # Two sampled tokens at temperature 1, many seeds: the counts fit the target's exact distribution
    # of them (from its own logits: P(a) P(b | a)).
    from ..helpers.toy import chi_square_rejects

    cascade = engine(t5, ["close", "mag"], [[2, 2], [0, 3]])
    prompt = random_prompts(1, 8, seed=21)[0]
    target = AutoModelForSeq2SeqLM.from_pretrained(t5["target"], local_files_only=True).eval()
    vocab = target.config.vocab_size
    with torch.inference_mode():
        enc = torch.tensor([prompt])
        first = target(input_ids=enc, decoder_input_ids=torch.tensor([[0]])).logits[0, -1].softmax(-1)
        pairs = torch.tensor([[0, a] for a in range(vocab)])
        second = target(input_ids=enc.expand(vocab, -1), decoder_input_ids=pairs).logits[:, -1].softmax(-1)
    joint = first[:, None] * second  # [a, b]
    expected = {(a, b): float(joint[a, b]) for a in range(vocab) for b in range(vocab) if joint[a, b] > 1e-7}
    samples = 1500
    counts: dict[tuple, int] = {}
    for seed in range(samples):
        out = cascade.generate(prompt, GenerationConfig(max_new_tokens=2, temperature=1.0, seed=seed)).token_ids
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert len(counts) > 10  # really sampled
    rejects, stat, crit = chi_square_rejects(counts, expected, samples)
    assert not rejects, f"chi-square {stat:.1f} > critical {crit:.1f}: not the target's distribution"


def test_the_service_sdk_and_openai_api_serve_an_encoder_decoder_cascade(t5):
    import openai

    from cascade_service.client import CascadeClient, errors
    from cascade_service.config import Config
    from cascade_service.standalone import start_standalone

    cascade = make_cascade(
        ModelTierConfig("target", str(t5["target"])),
        [ModelTierConfig("close", str(t5["close"])), MaGConfig()],
        [[2, 4], [0, 5]],
        1.0,
    )
    served = start_standalone(Config(cascade, GenerationConfig(max_new_tokens=16)), http_port=0)
    prompt = random_prompts(1, 10, seed=30)[0]
    try:
        with CascadeClient(f"127.0.0.1:{served.port}") as client:
            reply = client.generate(prompt_token_ids=prompt, max_new_tokens=16)
            assert reply.token_ids == seq2seq_oracle(t5["target"], prompt, 16)
            streamed = [
                t for chunk in client.stream(prompt_token_ids=prompt, max_new_tokens=16) for t in chunk.token_ids
            ]
            assert streamed == reply.token_ids
            with pytest.raises(errors.InvalidArgument, match="prompt: token 0 is the decoder start token"):
                client.generate(prompt_token_ids=[5, 0, 6], max_new_tokens=4)
            with pytest.raises(errors.InvalidArgument, match="session_id: sessions continue a decoder-only"):
                client.generate(prompt_token_ids=prompt, max_new_tokens=4, session_id="s1")
            with pytest.raises(errors.InvalidArgument, match="session_id: sessions continue a decoder-only"):
                client.create_session(prompt_token_ids=prompt)
        http = openai.OpenAI(base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key="none", max_retries=0)
        text = "def add(a, b):"
        completion = http.completions.create(model="target", prompt=text, max_tokens=12, temperature=0)
        ids = served.engine.encode(text)
        expected = served.engine.decode_text(seq2seq_oracle(t5["target"], ids, 12))
        assert completion.choices[0].text == expected
    finally:
        served.stop()


def test_encoder_decoder_tiers_on_a_tier_server_stay_exact(t5):
    # The drafter and then the target too on a real tier server: the split travels inside the context.
    from ..helpers.tier_servers import addressed, running, serve_group

    cascade = make_cascade(
        ModelTierConfig("target", str(t5["target"])),
        [ModelTierConfig("close", str(t5["close"])), MaGConfig()],
        [[2, 4], [0, 5]],
        1.0,
    )
    server = serve_group(cascade, ["target", "close"])
    prompt = random_prompts(1, 9, seed=31)[0]
    expected = seq2seq_oracle(t5["target"], prompt, 16)
    with running(server):
        for remote in ({"close": server}, {"close": server, "target": server}):
            out = InProcess(addressed(cascade, remote)).generate(prompt, GenerationConfig(max_new_tokens=16))
            assert out.token_ids == expected, sorted(remote)


def test_lossy_rules_and_hidden_states_run_on_encoder_decoder_tiers(t5):
    from cascade_service.core.types import Context
    from cascade_service.core.verify import Verification

    cascade = engine(t5, ["close", "mag"], [[2, 4], [0, 5]])
    prompt = random_prompts(1, 10, seed=33)[0]
    exact = cascade.generate(prompt, GenerationConfig(max_new_tokens=16)).token_ids
    for rule, alpha in (("token-v3", 0.5), ("fuzzy-tv", 0.6), ("lossy", 0.3)):
        out = cascade.generate(prompt, GenerationConfig(max_new_tokens=16, verification=Verification(rule, alpha)))
        assert out.stats.verification.startswith(rule) and 0 < len(out.token_ids) <= 16
        assert out.stats.off_target_tokens > 0 or out.token_ids == exact[: len(out.token_ids)]
    # What SpecDec++'s acceptance head reads: the decoder's final hidden states of the scored rows.
    scorer = HFModel.load(t5["close"]).scorer()
    scorer.keep_hidden = True
    rows = scorer.logits(Context([*prompt, 0, 7, 9], len(prompt) + 1), 2)
    assert rows.shape[0] == 2 and scorer.last_hidden is not None and tuple(scorer.last_hidden.shape) == (2, 64)


def test_bench_runs_an_encoder_decoder_family_exactly(t5, tmp_path):
    import json

    import yaml

    from ..helpers.bench import run_bench

    config = {
        "tiers": {
            "target": {"name": "target", "path": str(t5["target"])},
            "drafters": [
                {"name": "close", "path": str(t5["close"])},
                {"name": "mid", "path": str(t5["mid"])},
                {"kind": "mag"},
            ],
        },
        "schedule": {"k_matrix": [[3, 1, 0], [0, 2, 4], [0, 0, 4]], "leniency": 1.0},
    }
    (tmp_path / "t5.yaml").write_text(yaml.safe_dump(config))
    prompts = ["def parse_args(argv):\n", "for i in range(10):\n    print(i)\n"]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    methods = ["hf-ar", "ar", "hf-assisted:close", "sd:close", "csd:close+mid+mag"]
    args = ["methods", "--config", str(tmp_path / "t5.yaml"), "--prompts", str(tmp_path / "prompts.jsonl")]
    args += ["--max-new-tokens", "12", "--sd-k-sweep", "2", "--repeats", "1", "--out", str(tmp_path / "out")]
    assert run_bench(*args, "--methods", ",".join(methods)) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(results["methods"]) == methods
    for method, figures in results["methods"].items():
        assert figures["identical_to_hf_ar"] is True, method
        assert all(p["identical_to_hf_ar"] for p in figures["per_prompt"]), method
        assert figures["tokens_per_s"] > 0, method
    with pytest.raises(ValueError, match="prompt lookup does not keep an encoder-decoder"):
        run_bench(*args, "--methods", "hf-ar,hf-prompt-lookup")


def test_the_t5_zoo_preset_builds_a_family_the_cascade_serves_exactly(tmp_path):
    import json

    from cascade_service.cli.main import main

    out = tmp_path / "t5"
    assert main(["zoo", "build", "--preset", "t5-test", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["pairs"]["train"] > 100 and set(report["tiers"]) == {"large", "base", "small"}
    assert report["parameters"]["large"] > report["parameters"]["base"]
    assert report["loops"]["continuations"] == 4 and 0 <= report["loops"]["ending_in_a_loop"] <= 4
    prompts = [json.loads(line)["prompt"] for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 4 and all(p.startswith(("def ", "async def ")) for p in prompts)
    tune = [json.loads(line)["prompt"] for line in (out / "tune_prompts.jsonl").read_text().splitlines()]
    assert len(tune) == 2 and not set(tune) & set(prompts)
    family = {name: out / name for name in ("large", "base", "small")}
    cascade = InProcess(
        make_cascade(
            ModelTierConfig("large", str(family["large"])),
            [ModelTierConfig("base", str(family["base"])), ModelTierConfig("small", str(family["small"])), MaGConfig()],
            [[2, 1, 0], [0, 2, 3], [0, 0, 3]],
            1.0,
        )
    )
    for prompt in prompts[:2]:
        ids = cascade.encode(prompt)
        assert cascade.generate(ids, GenerationConfig(max_new_tokens=16)).token_ids == seq2seq_oracle(
            family["large"], ids, 16
        )


def test_specdec_and_confidence_stopping_on_an_encoder_decoder_drafter_stay_exact(t5, tmp_path):
    from cascade_service.core.adaptive import AdaptiveLength
    from cascade_service.models.acceptance_head import AcceptanceHead

    head = AcceptanceHead(64, depth=1)  # the drafter's d_model; weights zero: it predicts sigmoid(bias)
    with torch.no_grad():
        for param in head.parameters():
            param.zero_()
        head.out.bias.fill_(-5.0)  # a pessimist: stops after the first draft
    head.save(tmp_path / "head")
    prompt = random_prompts(1, 10, seed=41)[0]
    expected = seq2seq_oracle(t5["target"], prompt, 16)
    fixed = None
    for spec in (None, AdaptiveLength("specdec", 0.5, str(tmp_path / "head")), AdaptiveLength("confidence", 0.999)):
        cascade = InProcess(
            make_cascade(
                ModelTierConfig("target", str(t5["target"])),
                [ModelTierConfig("close", str(t5["close"]))],
                [[6]],
                1.0,
                None,
                {"close": spec} if spec else None,
            )
        )
        # "fixed": the configured schedule every round, so the blocks' lengths are the rule's alone (the
        # default's floor decides by measured time, which a loaded machine changes)
        out = cascade.generate(prompt, GenerationConfig(max_new_tokens=16, speculation="fixed"))
        assert out.token_ids == expected, spec
        drafted = out.stats.reviews["target"].drafted
        if spec is None:
            fixed = drafted
        else:
            assert fixed is not None and drafted < fixed, spec  # the rule shortened the blocks
