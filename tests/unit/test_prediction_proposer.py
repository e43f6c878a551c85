"""core.proposers.prediction.PredictionProposer on its own: it follows the output through the prediction, grows its
blocks while they are kept and shrinks them when not, waits when the output leaves the prediction, and
takes it up again where the output's last tokens occur in it."""

from __future__ import annotations

from cascade_service.core.proposers.prediction import FIRST_BLOCK, MAX_BLOCK, PredictionProposer
from cascade_service.core.types import Context

PROMPT = [900, 901, 902]


def _ctx(output: list[int]) -> Context:
    tokens = PROMPT + output
    return Context(tokens, len(tokens))


def test_a_right_prediction_is_followed_with_blocks_that_double():
    prediction = list(range(200))
    proposer = PredictionProposer(prediction)
    output: list[int] = []
    sizes = []
    while len(output) < 150:
        block = proposer.propose(_ctx(output), 1000)
        assert block == prediction[len(output) : len(output) + len(block)]
        sizes.append(len(block))
        output += block + [prediction[len(output) + len(block)]]  # all kept, and the target's next token
    assert sizes[:3] == [FIRST_BLOCK, 2 * FIRST_BLOCK, MAX_BLOCK]


def test_a_rejected_block_shrinks_to_what_was_kept_and_the_edit_is_skipped():
    prediction = list(range(100))
    proposer = PredictionProposer(prediction)
    assert proposer.propose(_ctx([]), 1000) == prediction[:FIRST_BLOCK]
    # The target kept 5 and then wrote 555 where the prediction says 5 (a replaced token).
    output = prediction[:5] + [555]
    assert proposer.propose(_ctx(output), 1000) == []  # lost: the round drafts without the prediction
    output += [6]  # the output goes on as predicted: its last token, just ahead, takes it up again
    assert proposer.propose(_ctx(output), 1000) == prediction[7:13]  # 5 kept: blocks of 6 now (at least MIN_BLOCK)


def test_an_inserted_stretch_is_resynced_by_the_outputs_last_tokens():
    prediction = list(range(100))
    proposer = PredictionProposer(prediction)
    proposer.propose(_ctx([]), 1000)
    output = prediction[:10] + [500, 501, 502, 503, 504, 505, 506, 507, 508, 509] + prediction[40:43]
    assert proposer.propose(_ctx(output), 1000)[:3] == prediction[43:46]  # three tokens found far ahead


def test_the_end_of_the_prediction_and_the_budget_bound_a_proposal():
    proposer = PredictionProposer([1, 2, 3])
    assert proposer.propose(_ctx([]), 2) == [1, 2]  # k bounds it
    assert proposer.propose(_ctx([1, 2, 3]), 10) == []  # nothing left to propose
    assert PredictionProposer([]).propose(_ctx([]), 10) == []
