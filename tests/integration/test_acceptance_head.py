"""SpecDec++ acceptance head: hidden-state capture, training data, training, storage, the CLI."""

import argparse

import pytest
import torch

from cascade_service.cli import train_head as train_head_cli
from cascade_service.core.adaptive import SpecDecPPStopper
from cascade_service.core.types import Context
from cascade_service.models.acceptance_head import AcceptanceHead
from cascade_service.models.hf import HFModel
from cascade_service.zoo import train_head as th
from cascade_service.zoo.tiny import random_prompts


@pytest.fixture(scope="module")
def models(tiny_family):
    return HFModel.load(tiny_family["target"], name="target"), HFModel.load(tiny_family["mid"], name="mid")


@pytest.fixture(scope="module")
def data(models):
    target, drafter = models
    prompts = torch.tensor(random_prompts(6, 8, seed=3))
    return th.build_data(target.module, drafter.module, prompts, 12, views=2, mix=0.3, seed=0)


def plain_hidden(model: HFModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        out = model.module(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    return out.hidden_states[-1][0]  # [S, H]


# --- HFScorer.keep_hidden -----------------------------------------------------------------------


def test_keep_hidden_rows_match_a_plain_forward_with_output_hidden_states(models):
    _, drafter = models
    tokens = random_prompts(1, 10, seed=1)[0]
    scorer = drafter.scorer()
    scorer.keep_hidden = True
    scorer.logits(Context(tokens[:7], 7), 3)  # prefill
    assert torch.allclose(scorer.last_hidden, plain_hidden(drafter, tokens[:7])[-3:], atol=1e-5)
    scorer.logits(Context(tokens, 7), 1)  # incremental, through the KV cache
    assert scorer.last_hidden.shape == (1, drafter.config.hidden_size)
    assert torch.allclose(scorer.last_hidden, plain_hidden(drafter, tokens)[-1:], atol=1e-5)


def test_hidden_capture_is_off_by_default_and_does_not_change_logits(models):
    _, drafter = models
    ctx = Context(random_prompts(1, 9, seed=2)[0], 9)
    plain, capturing = drafter.scorer(), drafter.scorer()
    capturing.keep_hidden = True
    assert torch.equal(plain.logits(ctx, 2), capturing.logits(ctx, 2))
    assert plain.last_hidden is None and capturing.last_hidden.shape == (2, drafter.config.hidden_size)


# --- training data --------------------------------------------------------------------------------


def test_labels_are_min_one_p_over_q_recomputed_independently(models, data):
    target, drafter = models
    assert data.labels.min() >= 0 and data.labels.max() <= 1 and data.labelled.any()
    checked = 0
    for row, i in [(0, 0), (1, 5), (4, 11), (7, 3), (11, 8)]:
        prefix = data.prompts[row].tolist() + data.target_tokens[row, :i].tolist()  # prompt + X_<i
        y = int(data.draft_tokens[row, i])
        target_probs = torch.softmax(target.full_logits(prefix)[-1], -1)
        draft_probs = torch.softmax(drafter.full_logits(prefix)[-1], -1)
        expected = min(1.0, float(target_probs[y] / draft_probs[y]))
        assert float(data.labels[row, i]) == pytest.approx(expected, abs=1e-4)
        checked += 1
    assert checked == 5


def test_views_of_a_response_share_its_target_tokens_and_draw_their_own_drafts(data):
    assert torch.equal(data.target_tokens[0], data.target_tokens[1])
    assert torch.equal(data.prompts[2], data.prompts[3])
    assert not torch.equal(data.draft_tokens[0], data.draft_tokens[1])


def test_mixing_labels_only_drafted_positions_and_features_are_the_drafters_hidden_state_there(models, data):
    _, drafter = models
    labelled = data.labelled
    assert torch.equal(data.mixed[labelled], data.draft_tokens[labelled])
    from_target = data.mixed == data.target_tokens
    assert (labelled | from_target).all()  # every position holds Y (labelled) or X
    assert 0.1 < float((~labelled).float().mean()) < 0.6  # mix = 0.3 (loose: 144 draws)
    row = 5
    hidden = plain_hidden(drafter, data.prompts[row].tolist() + data.mixed[row].tolist())  # [P+N, H]
    # No shift: the feature at response position i is the hidden state at the position holding Z_i.
    assert torch.allclose(data.features[row], hidden[data.prompts.shape[1] :], atol=1e-4)


def test_greedy_labels_are_argmax_agreement(models):
    target, drafter = models
    greedy = th.build_data(
        target.module, drafter.module, torch.tensor(random_prompts(2, 6, seed=4)), 8, mix=0.0, temperature=0.0, seed=0
    )
    row, i = 1, 5
    prefix = greedy.prompts[row].tolist() + greedy.target_tokens[row, :i].tolist()
    assert int(greedy.target_tokens[row, i]) == int(target.full_logits(prefix)[-1].argmax())
    assert int(greedy.draft_tokens[row, i]) == int(drafter.full_logits(prefix)[-1].argmax())
    agree = (greedy.draft_tokens == greedy.target_tokens).float()  # with mix 0 every position is labelled
    assert torch.equal(greedy.labels, agree)


def test_positions_after_an_eos_carry_no_label(models):
    target, drafter = models
    prompts = torch.tensor(random_prompts(2, 6, seed=5))
    eos = int(th.build_data(target.module, drafter.module, prompts, 8, mix=0.0, seed=1).target_tokens[0, 3])
    d = th.build_data(target.module, drafter.module, prompts, 8, mix=0.0, seed=1, eos_ids=[eos])
    first = int((d.target_tokens[0] == eos).nonzero()[0])
    assert d.labelled[0, : first + 1].all() and not d.labelled[0, first + 1 :].any()


# --- training and storage -------------------------------------------------------------------------


def test_a_few_training_steps_lower_the_weighted_bce(data):
    x, y, _, _ = data.rows(slice(0, 6))
    torch.manual_seed(0)
    head = AcceptanceHead(x.shape[1], depth=2)
    with torch.no_grad():
        before = float(th.weighted_bce(head(x), y, 6.0))
    losses = th.fit(head, x, y, steps=60, batch=64, lr=3e-3, w_rej=6.0, seed=0)
    with torch.no_grad():
        after = float(th.weighted_bce(head(x), y, 6.0))
    assert len(losses) == 60 and after < before - 0.05


def test_weighted_bce_is_minimised_at_the_w_rej_shifted_probability():
    # Notes Sec. 5.4: p* = P / (P + w_rej (1 - P)); with P = 0.8, w_rej = 6: 0.8 / 2.0 = 0.4.
    logits = torch.linspace(-3, 3, 601, requires_grad=False)
    losses = torch.stack([th.weighted_bce(l.reshape(1), torch.tensor([0.8]), 6.0) for l in logits])
    assert float(torch.sigmoid(logits[losses.argmin()])) == pytest.approx(0.4, abs=0.01)


@pytest.mark.parametrize("tie", [False, True])
def test_save_load_round_trip_gives_identical_predictions(tmp_path, tie):
    torch.manual_seed(1)
    head = AcceptanceHead(16, depth=3, tie_blocks=tie, meta={"drafter": {"name": "d"}})
    for p in head.parameters():  # not the default init, so a load that kept defaults would differ
        p.data.normal_()
    head.save(tmp_path)
    loaded = AcceptanceHead.load(tmp_path)
    x = torch.randn(5, 16)
    assert torch.equal(head.predict(x), loaded.predict(x))
    assert loaded.meta == {"drafter": {"name": "d"}} and (loaded.depth, loaded.tie_blocks) == (3, tie)
    assert len(loaded.blocks) == (1 if tie else 3)  # tied: one block applied D times


def test_depth_zero_is_a_single_linear_layer():
    head = AcceptanceHead(8, depth=0)
    assert sum(p.numel() for p in head.parameters()) == 9
    assert head.predict(torch.zeros(8)).shape == ()


def test_loading_a_directory_without_a_head_fails(tmp_path):
    with pytest.raises(FileNotFoundError):
        AcceptanceHead.load(tmp_path)


def test_stopper_with_a_head_reads_the_hidden_state_of_the_previous_candidate(models):
    # Drafting with keep_hidden: call i hands the stopper e_{i-1}; the product must equal the head's
    # predictions on the candidates' hidden states from one plain forward over context + block.
    _, drafter = models
    torch.manual_seed(2)
    head = AcceptanceHead(drafter.config.hidden_size, depth=1)
    stopper = SpecDecPPStopper(head, threshold=0.999999)
    scorer = drafter.scorer()
    scorer.keep_hidden = True
    ctx = random_prompts(1, 6, seed=6)[0]
    block: list[int] = []
    stopper.start()
    for _ in range(4):
        probs = torch.softmax(scorer.logits(Context(ctx + block, len(ctx)), 1)[0], -1)
        block.append(int(probs.argmax()))
        stopper.should_stop(block[-1], probs, scorer.last_hidden[0])
    candidates = plain_hidden(drafter, ctx + block)[len(ctx) : len(ctx) + 3]  # e_1..e_3 (e_4 not yet seen)
    assert stopper.accept_prob == pytest.approx(float(head.predict(candidates).prod()), rel=1e-5)


# --- the CLI entry point on the trained test zoo --------------------------------------------------


def test_train_head_cli_on_the_test_zoo_writes_a_loadable_head(test_zoo_home, tmp_path, monkeypatch, capsys):
    from cascade_service.cli import main

    monkeypatch.setenv("CASCADE_SERVICE_HOME", str(test_zoo_home))
    out = tmp_path / "head"
    assert main(["train-head", "--preset", "test", "--drafter", "small", "--out", str(out), "--steps", "30"]) == 0
    head = AcceptanceHead.load(out)
    small = HFModel.load(test_zoo_home / "zoo" / "test" / "small")
    assert head.hidden_size == small.config.hidden_size and head.depth == 3
    assert head.meta["drafter"]["name"] == "small"
    summary = head.meta["training"]
    assert summary["recipe"]["steps"] == 30 and summary["examples"]["train"] > 0
    assert 0 <= summary["eval"]["mean_label"] <= 1 and '"eval"' in capsys.readouterr().out
    p = head.predict(torch.randn(3, head.hidden_size))
    assert ((p >= 0) & (p <= 1)).all()


def test_train_head_for_a_drafter_under_base_is_labelled_by_base(test_zoo_home, tmp_path, monkeypatch, capsys):
    """--reviewer base: the head predicts base's acceptance of small's tokens (small drafting under base)."""
    from cascade_service.cli import main

    monkeypatch.setenv("CASCADE_SERVICE_HOME", str(test_zoo_home))
    out = tmp_path / "head"
    assert (
        main(
            [
                "train-head",
                "--preset",
                "test",
                "--drafter",
                "small",
                "--reviewer",
                "base",
                "--out",
                str(out),
                "--steps",
                "5",
            ]
        )
        == 0
    )
    head = AcceptanceHead.load(out)
    assert (head.meta["training"]["target"], head.meta["drafter"]["name"]) == ("base", "small")
    assert main(["train-head", "--preset", "test", "--drafter", "base", "--reviewer", "base"]) == 2
    assert "--reviewer base reviews only small, not 'base'" in capsys.readouterr().err


def test_cli_rejects_bad_values_by_argument():
    parser = argparse.ArgumentParser()
    train_head_cli.add_arguments(parser)
    for bad in (["--steps", "0"], ["--depth", "-1"], ["--w-rej", "0"], ["--temperature", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
