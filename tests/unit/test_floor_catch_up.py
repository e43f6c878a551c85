"""A source that catches up on a long prompt crosses the floor's bound (engine.policies.floor): its next
rounds are judged past it, one for a greedy request (its rounds' yields are much alike), SAMPLED_STINT
for a sampled one, whose yield varies from 1 to k + 1 tokens at one cost: judged on one round, a drafter
that pays on average was off for the rest of the request when that round was unlucky."""

from __future__ import annotations

import pytest

from cascade_service.engine.policies.floor import CREDIT, EPSILON, SAMPLED_STINT, FloorModel
from tests.helpers.floors import PLAIN_S, Request

PROMPT = 2000
CATCH_UP = 0.003  # per token behind: reading the prompt costs 6 plain steps, twice the credit of 3


def _prompt_round(request: Request) -> None:
    """The prompt's round, whose drafters did not read the prompt (a lookup filled its block, say)."""
    request.floor.begin(request.committed, request.end - request.committed)
    request.clock.t += 50.0
    request.floor.observe(0, 0)
    request.committed += 1


def _rounds(request: Request, accepts: list[int], rounds: int) -> None:
    """`rounds` rounds whose model rounds keep accepts[0], accepts[1], ... of 4 drafts (the last for the rest)
    at 1.6 plain steps each, past catching up."""
    seen = 0
    for _ in range(rounds):
        accept = accepts[min(seen, len(accepts) - 1)]
        if request.round({"model": 1.6}, {"model": accept}, catch_up=CATCH_UP) == "model":
            seen += 1


@pytest.mark.parametrize("greedy", [False, True])
def test_after_a_catch_up_a_sampled_request_judges_three_rounds_not_one(greedy):
    # The catch-up round, then one unlucky judged round (1 token for 1.6 steps), then rounds of 4 tokens:
    # 2.5x. A sampled request's three judged rounds pay on the whole (9 tokens for 4.8 steps) and it drafts
    # on; a greedy one's single round decides (on its old code, a sampled one's too: then 0 of the last 30).
    request = Request(FloorModel(), greedy=greedy, prompt=PROMPT)
    _prompt_round(request)
    _rounds(request, [3, 0, 3], 40)
    late = request.sources[-30:].count("model")
    if greedy:
        assert late <= 3  # off, probes aside: the bound was crossed and its own round did not pay
    else:
        assert late >= 28
        assert request.floor.loss < 0  # the catch-up paid back


@pytest.mark.parametrize("greedy", [False, True])
def test_what_drafting_loses_after_a_catch_up_stays_within_the_bound_plus_the_judged_rounds(greedy):
    # Nothing pays (1 token for 1.6 steps every round): past the bound, the catch-up round and its judged
    # rounds (one, or SAMPLED_STINT) are all it loses.
    request = Request(FloorModel(), greedy=greedy, prompt=PROMPT)
    _prompt_round(request)
    _rounds(request, [0], 400)
    floor = request.floor
    judged = 1 if greedy else SAMPLED_STINT
    catch_up_round = 1.6 + CATCH_UP * PROMPT - PLAIN_S
    assert request.sources.count("model") >= 1 + judged  # it caught up and was judged
    assert floor.loss <= CREDIT * PLAIN_S + EPSILON * floor.plain_equivalent + catch_up_round + judged * 0.6


def test_a_sampled_probes_catch_up_is_judged_on_one_round():
    # A probe only asks whether the source pays again: where nothing pays, each probe of a source that
    # fell behind is its catch-up and one judged round, as a greedy request's (not SAMPLED_STINT of them).
    request = Request(FloorModel(), greedy=False)
    _rounds(request, [0], 400)
    runs, current = [], 0
    for source in request.sources[10:] + [None]:
        if source == "model":
            current += 1
        elif current:
            runs, current = runs + [current], 0
    assert len(runs) >= 3  # probes came
    assert max(runs) <= 2, runs
