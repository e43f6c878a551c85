"""Stopping rules: SpecDec++'s threshold on 1 - prod(predicted acceptance), and the confidence baseline."""

import math

import pytest
import torch

from cascade_service.core.adaptive import ConfidenceStopper, DraftStopper, SpecDecPPStopper

PROBS = torch.tensor([0.7, 0.2, 0.1])  # a drafter distribution; its values do not matter to SpecDec++


class FakeHead:
    """Predicts hidden[0] as the acceptance probability, and records what it was asked."""

    def __init__(self):
        self.seen: list[float] = []

    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        self.seen.append(float(hidden[0]))
        return hidden[0].clone()


def hid(accept: float) -> torch.Tensor:
    return torch.tensor([accept, 0.0, 0.0, 0.0])  # [H]


def drafted_until_stop(stopper: DraftStopper, hiddens: list[float], cap: int = 50) -> int:
    """Block length when the i-th call gets hidden hiddens[i - 1] (the last value repeats)."""
    stopper.start()
    for i in range(1, cap + 1):
        h = hiddens[min(i, len(hiddens)) - 1]
        if stopper.should_stop(0, PROBS, hid(h)):
            return i
    return cap


# --- SpecDec++ ---------------------------------------------------------------------------------


def test_stops_when_one_minus_product_of_predicted_acceptances_exceeds_threshold():
    head = FakeHead()
    stopper = SpecDecPPStopper(head, threshold=0.5)
    stopper.start()
    # Call i carries e_{i-1}: the context's hidden state (ignored), then the candidates' a_1, a_2, a_3.
    decisions = [stopper.should_stop(t, PROBS, hid(a)) for t, a in enumerate([0.01, 0.9, 0.8, 0.5])]
    assert decisions == [False, False, False, True]
    assert stopper.reject_prob == pytest.approx(1 - 0.9 * 0.8 * 0.5)
    assert head.seen == pytest.approx([0.9, 0.8, 0.5])  # the first call's hidden never reaches the head


def test_first_token_of_a_block_never_stops_it_so_blocks_have_at_least_two_tokens():
    stopper = SpecDecPPStopper(FakeHead(), threshold=0.01)
    assert drafted_until_stop(stopper, [0.0, 0.0]) == 2


def test_block_length_is_one_more_than_the_factors_needed_to_cross_the_threshold():
    # Constant a = 0.9, h = 0.5: 1 - 0.9^k > 0.5 first at k = 7, decided on the 8th drafted token (K = k + 1).
    k = math.ceil(math.log(0.5) / math.log(0.9))
    assert k == 7
    assert drafted_until_stop(SpecDecPPStopper(FakeHead(), 0.5), [1.0, 0.9]) == k + 1


def test_equality_with_threshold_does_not_stop_the_rule_is_strict():
    stopper = SpecDecPPStopper(FakeHead(), threshold=0.5)
    stopper.start()
    assert not stopper.should_stop(0, PROBS, hid(1.0))
    assert not stopper.should_stop(0, PROBS, hid(0.5))  # 1 - 0.5 == h exactly
    assert stopper.should_stop(0, PROBS, hid(0.999))


def test_higher_threshold_gives_longer_blocks():
    lengths = [drafted_until_stop(SpecDecPPStopper(FakeHead(), h), [1.0, 0.8]) for h in (0.1, 0.3, 0.5, 0.7, 0.9)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]


def test_start_resets_the_running_product():
    stopper = SpecDecPPStopper(FakeHead(), threshold=0.5)
    assert drafted_until_stop(stopper, [1.0, 0.1]) == 2
    stopper.start()
    assert stopper.accept_prob == 1.0 and stopper.reject_prob == 0.0
    assert not stopper.should_stop(0, PROBS, hid(0.0))  # a fresh block's first call again ignores the head


def test_perfect_acceptance_never_stops():
    assert drafted_until_stop(SpecDecPPStopper(FakeHead(), 0.01), [1.0], cap=30) == 30


def test_specdecpp_needs_the_hidden_state():
    stopper = SpecDecPPStopper(FakeHead(), 0.5)
    assert stopper.needs_hidden is True
    stopper.start()
    with pytest.raises(ValueError, match="hidden"):
        stopper.should_stop(0, PROBS, None)


# --- confidence baseline -----------------------------------------------------------------------


def test_confidence_stops_when_the_drafters_top_probability_is_below_threshold():
    stopper = ConfidenceStopper(threshold=0.5)
    stopper.start()
    assert not stopper.should_stop(0, torch.tensor([0.6, 0.3, 0.1]), None)
    assert stopper.should_stop(0, torch.tensor([0.4, 0.35, 0.25]), None)


def test_confidence_uses_the_max_probability_not_the_drafted_tokens():
    stopper = ConfidenceStopper(threshold=0.5)
    # A sampled token of probability 0.1 from a confident distribution does not stop the block.
    assert not stopper.should_stop(2, torch.tensor([0.8, 0.1, 0.1]), None)


def test_confidence_is_memoryless_and_needs_no_hidden_state():
    stopper = ConfidenceStopper(threshold=0.5)
    assert stopper.needs_hidden is False
    stopper.start()
    assert stopper.should_stop(0, torch.tensor([0.4, 0.3, 0.3]), None)
    assert not stopper.should_stop(0, torch.tensor([0.9, 0.05, 0.05]), None)  # no state carried over


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_thresholds_outside_the_open_unit_interval_are_rejected_by_name(bad):
    with pytest.raises(ValueError, match="threshold"):
        SpecDecPPStopper(FakeHead(), bad)
    with pytest.raises(ValueError, match="threshold"):
        ConfidenceStopper(bad)


def test_both_rules_satisfy_the_protocol():
    stoppers: list[DraftStopper] = [SpecDecPPStopper(FakeHead(), 0.7), ConfidenceStopper(0.3)]
    assert [s.needs_hidden for s in stoppers] == [True, False]
