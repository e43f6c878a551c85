"""Plain decoding's cost p under stalls (engine.policies.goodput.plain_ewma): a plain round that lost
time to something else (a garbage collection, the host's other work) counts at most 1.5x p, in a level's
p and in a request's own, so drafting that loses is not read as paying after it; a cost rising for good
is still followed."""

from __future__ import annotations

from cascade_service.engine.policies.floor import FloorModel
from tests.helpers.floors import Request

# A model round keeping 1 of its drafts: 2 tokens for 2.2 plain steps (0.91x plain).
LOSING = ({"model": 2.2}, {"model": 1})


def test_a_stalled_plain_round_moves_a_levels_p_by_a_twentieth_at_most():
    model = FloorModel()
    here = model.at(True, 0)
    for _ in range(30):
        model.plain(here, 1.0, 0.8)
    model.plain(here, 25.0, 24.8)  # a stall: 25 plain rounds' time in one
    assert here.plain_s is not None and here.plain_work_s is not None
    assert here.plain_s <= 1.05 + 1e-9 and here.plain_work_s <= 0.84 + 1e-9
    for _ in range(40):  # plain rounds dearer for good (a longer context, a slower host): followed
        model.plain(here, 2.0, 1.6)
    assert here.plain_s > 1.9 and here.plain_work_s > 1.5


def _model_rounds_after(stall: float) -> int:
    """Model rounds in the 40 rounds after a request's first plain round past its 60th, which `stall`ed."""
    request = Request(FloorModel())
    for _ in range(60):
        request.round(*LOSING)
    while request.round(*LOSING, stall=stall) is not None:
        pass
    return sum(request.round(*LOSING) == "model" for _ in range(40))


def test_after_a_stalled_plain_round_a_losing_source_stays_off():
    calm = _model_rounds_after(0.0)
    assert calm <= 4  # its probes
    assert _model_rounds_after(20.0) <= calm + 1


def _stale(model: FloorModel, p: float):
    """A level whose p was measured as `p`, then CALIBRATE rounds drafted (no plain round) until a
    calibration round is due."""
    here = model.at(True, 0)
    model.plain(here, p, 0.8 * p)
    while not model.calibrating(here):
        pass
    return here


def test_a_calibration_below_a_stale_p_moves_it_halfway():
    model = FloorModel()
    here = _stale(model, 6.5)  # the server's first plain rounds
    model.plain(here, 4.3, 3.4)
    assert here.plain_s is not None and abs(here.plain_s - 5.4) < 1e-9  # a tenth of the way: 6.28
    model.plain(here, 4.3, 3.4)  # the rounds after it count as ever
    assert abs(here.plain_s - 5.29) < 1e-9


def test_a_calibration_above_a_stale_p_counts_as_any_plain_round():
    model = FloorModel()
    here = _stale(model, 4.3)
    model.plain(here, 5.3, 4.2)  # perhaps a stall: dearer is the side that makes drafting look paying
    assert here.plain_s is not None and abs(here.plain_s - 4.4) < 1e-9
