"""A lookup that finds nothing is the lookup's round (engine.policies.floor.GoodputFloor.observe): its cost
against one plain token, not a plain round. Judged as plain, what asking cost went into p, every match then
looked worth more plain time than it was, and the lookup stayed on where asking cost more than matches saved."""

from __future__ import annotations

from cascade_service.engine.policies.floor import CREDIT, EPSILON, FloorModel
from tests.helpers.floors import PLAIN_S, Request

MATCH = (
    {"lookup": 1.6, "model": 1.6},
    {"lookup": 3, "model": 0},
)  # a match: 4 tokens for 1.6 plain steps; model drafts lose


def serve(miss: float, rounds: int = 400, every: int = 10) -> Request:
    """One request whose lookup matches one round in `every` and otherwise finds nothing, at `miss` plain
    steps more than a plain round."""
    request = Request(FloorModel())
    for i in range(rounds):
        if i % every == every - 1:
            request.round(*MATCH, hit=True)
        else:
            request.round(*MATCH, miss=miss)
    return request


def test_a_lookup_whose_misses_cost_more_than_its_matches_save_stops_being_asked():
    # Per ten rounds: a match earns 4 plain steps for 1.6, nine misses 9 for 9 x 1.4: 13 for 14.2 spent. As
    # plain rounds the misses made p 1.4, a match then earned 5.6 for 1.6, and asking went on every round.
    request = serve(miss=0.4)
    late = request.asked - serve(miss=0.4, rounds=200).asked
    assert late < 30  # of the last 200 rounds, ~180 would ask if it stayed on
    worst = 1.6 + 0.4  # one round's misestimate: the bound's "plus one round"
    assert request.clock.t <= request.plain_time() * (1 + EPSILON) + CREDIT * PLAIN_S + worst


def test_a_lookup_whose_misses_cost_nothing_stays_on_and_its_matches_pay():
    request = serve(miss=0.0)
    late = request.asked - serve(miss=0.0, rounds=200).asked
    assert late > 150
    assert request.clock.t < 0.9 * request.plain_time()
