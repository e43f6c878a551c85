"""A request admitted where drafting loses at its load runs plain from its first round (engine.policies.rest,
goodput.FloorModel.admit): only where every source's rounds lose and its probes failed until they come
as seldom as they may, or its ratio over enough rounds says so; one request in EXPLORE_EVERY explores (the
floor, probing soon), fewer while probes fail there; resting rounds count in the load. Under load, where no
round has measured a source at the level, only explorers let it read their context."""

from __future__ import annotations

from cascade_service.core.policy import FIXED
from cascade_service.engine.policies import floor_policies, goodput, rest
from cascade_service.engine.policies.floor import FloorModel, GoodputFloor
from cascade_service.engine.policies.rest import RestingFloor
from tests.helpers.floors import GOOD, Request, at_load, run
from tests.helpers.trials import Clock

LOSING_BOTH = ({"model": 1.6, "lookup": 1.6}, {"model": 0, "lookup": 0})
PAYING_LOOKUP = ({"model": 1.6, "lookup": 1.1}, {"model": 0, "lookup": 6})


def dried(model: FloorModel, greedy: bool = True) -> FloorModel:
    """Requests whose drafts never pay, until every source's probes come at probe_max."""
    here = model.at(greedy, 0)
    for _ in range(40):
        if all(here.interval[s] >= model.settings.probe_max for s in here.interval):
            return model
        run(Request(model, greedy=greedy), 200, LOSING_BOTH, hit=True)
    raise AssertionError(f"the probes never reached probe_max: {here.interval}")


def test_where_every_source_loses_and_probes_keep_failing_one_request_in_explore_rarely_explores():
    model = dried(FloorModel())
    policy = floor_policies(None, model=model)
    admitted = [policy(True) for _ in range(2 * goodput.EXPLORE_RARELY)]
    resting = [isinstance(p, RestingFloor) for p in admitted]
    assert sum(resting) == len(admitted) - 2
    explorers = [p for p in admitted if not isinstance(p, RestingFloor)]
    assert all(isinstance(p, GoodputFloor) and p.explores for p in explorers)


def test_explorers_come_one_in_four_until_probes_fail_and_again_once_one_pays():
    """An explorer runs the floor (46 + 16 us a round against a resting request's 11-13 + 4): where its
    probes keep failing, fewer are sent; a probe that pays brings them back to one in EXPLORE_EVERY."""
    model = FloorModel()
    here = model.at(True, 0)
    model.plain(here, 1.0, 0.8)
    while here.gains["model"].rounds < goodput.REST_EVIDENCE_ALONE:
        for source in goodput.SOURCES:
            model.drafted(here, source, 1.0, 1.5)

    def explorers(n: int) -> int:
        return [model.admit(True) for _ in range(n)].count(goodput.EXPLORE)

    assert explorers(8 * goodput.EXPLORE_EVERY) == 8
    model.probed(here, "lookup", paid=False)
    model.probed(here, "lookup", paid=False)
    assert explorers(8 * goodput.EXPLORE_EVERY) == 2  # one in 16
    for _ in range(8):
        model.probed(here, "lookup", paid=False)
    assert explorers(4 * goodput.EXPLORE_RARELY) == 4  # at most one in EXPLORE_RARELY
    model.probed(here, "lookup", paid=True)
    assert explorers(8 * goodput.EXPLORE_EVERY) == 8


def test_an_explorer_probes_from_probe_min_where_a_plain_floor_waits_the_levels_interval():
    model = dried(FloorModel())
    explorer, ordinary = Request(model), Request(model)
    explorer.floor.explores = True
    run(explorer, 40, LOSING_BOTH, hit=True)
    run(ordinary, 40, LOSING_BOTH, hit=True)
    assert sum(s is not None for s in ordinary.sources) == 0  # the level's interval: 64 rounds off
    assert sum(s is not None for s in explorer.sources) >= 2  # both sources probed within 40 rounds


def test_a_resting_request_drafts_nothing_and_counts_in_the_load():
    model = dried(FloorModel())
    resting = [RestingFloor(model) for _ in range(16)]
    for floor in resting:
        floor.begin(100, 64)
    assert not any(floor.allows(s) for floor in resting for s in ("lookup", "model"))
    assert all(floor.cap("model", 8, 8) == 0 for floor in resting)
    for i in range(200):  # sixteen requests, each in a round but for the moment between two
        resting[i % 16].observe(0, 0)
        resting[i % 16].begin(100, 64)
    assert model.level() == 4


def test_nothing_rests_before_the_evidence_says_so():
    fresh = FloorModel()
    assert not any(fresh.admit(True) != goodput.FLOOR for _ in range(8))  # no plain round measured yet
    model = FloorModel()
    run(Request(model), 40, LOSING_BOTH, hit=True)  # losing, but its probes are still frequent
    assert model.at(True, 0).interval["model"] < model.settings.probe_max
    assert not any(model.admit(True) != goodput.FLOOR for _ in range(8))


def test_a_paying_probe_ends_the_rest_and_each_kind_and_key_rests_apart():
    model = dried(FloorModel())
    assert not any(model.admit(False) != goodput.FLOOR for _ in range(8))  # sampled requests: no evidence of their own
    assert not any(model.admit(True, "alice") != goodput.FLOOR for _ in range(8))  # another key's evidence is its own
    assert goodput.FLOOR not in [model.admit(True) for _ in range(4)]
    explorer = Request(model)
    run(explorer, 400, PAYING_LOOKUP, hit=True)  # an explorer whose lookups now pay
    assert explorer.sources.count("lookup") > 0
    assert all(model.admit(True) == goodput.FLOOR for _ in range(8))


def test_resting_rounds_keep_the_levels_plain_cost_current():
    """Where most requests rest, they are most of the level's plain rounds: their rounds are timed into
    its plain cost (the prompt's round aside), so p does not stay at what plain rounds cost long ago."""
    model = dried(FloorModel())
    here = model.at(True, 0)
    here.plain_s, here.plain_work_s = 3.0, 2.5  # measured when the machine was slower
    resting = floor_policies(None, model=model)(True)
    while not isinstance(resting, RestingFloor):  # one request in EXPLORE_EVERY explores instead
        resting = floor_policies(None, model=model)(True)
    clock, work = Clock(), Clock()
    reads = []
    resting.clock, resting.compute = lambda: reads.append(1) or clock(), work
    for i in range(160):
        resting.begin(100 + i, 200 - i)
        clock.t += 50.0 if i == 0 else 1.0  # the prompt's round reads the prompt
        work.t += 40.0 if i == 0 else 0.8
        resting.observe(0, 0)
        assert here.plain_s <= 3.0  # the prompt's round is no plain round's cost
    assert abs(here.plain_s - 1.0) < 0.1 and abs(here.plain_work_s - 0.8) < 0.1
    # one round in PLAIN_SAMPLE is timed (its begin and the next's), the others read no clock; the last
    # timed round waits for a next round that never came
    assert len(reads) == 2 * (160 // rest.PLAIN_SAMPLE) - 1
    assert not model.calibrating(here)  # a plain round was measured lately: no calibration round due
    assert model.at(False, 0).plain_s is None  # a greedy request's rounds are greedy evidence only


def test_a_level_whose_every_source_loses_rests_by_its_ratio_even_while_a_probe_paid_lately():
    """A lookup probe that paid on a rare match halves the level's interval; the level's ratio over every
    request's rounds still says the lookup loses there, so requests rest (they ran the floor, 46 + 16 us
    a round against 11-13 + 4, while the interval climbed back)."""
    model = FloorModel()
    here = model.at(True, 0)
    model.plain(here, 1.0, 0.8)
    while here.gains["model"].rounds < goodput.REST_EVIDENCE_ALONE:
        for source in goodput.SOURCES:
            model.drafted(here, source, 1.0, 1.5)  # each round earned two thirds of what it cost
    model.probed(here, "lookup", paid=True)
    assert here.interval["lookup"] < model.settings.probe_max
    assert [model.admit(True) for _ in range(8)].count(goodput.REST) == 6  # and one in EXPLORE_EVERY explores
    # (the paying probe above set that)
    thin = FloorModel()
    there = thin.at(True, 0)
    thin.plain(there, 1.0, 0.8)
    for source in goodput.SOURCES:
        thin.drafted(there, source, 1.0, 1.5)  # losing, but one round of each: not evidence enough
    assert all(thin.admit(True) == goodput.FLOOR for _ in range(8))
    while there.gains["model"].rounds < goodput.REST_EVIDENCE_ALONE:
        thin.drafted(there, "lookup", 2.0, 1.0)  # the lookup pays at this level
        thin.drafted(there, "model", 1.0, 1.5)
    assert all(thin.admit(True) == goodput.FLOOR for _ in range(8))


def test_while_load_adaptation_runs_its_plain_arm_a_request_rests_and_still_counts_in_the_trial():
    """Under the trial's "plain" arm a floor's rounds decide nothing (nothing may draft) yet ran its
    bookkeeping: at 64 streams, T = 1, in process, every request ran the floor (no drafting round ever
    gave the evidence to rest by), 21 + 7 us a round. A request admitted then rests from its first round;
    its rounds still begin and end in the trial, so the trial's load and epochs count them."""
    from cascade_service.engine.clock import PassTimer
    from cascade_service.engine.policies.load import DraftBudget, load_policies

    inner = load_policies(PassTimer(), 8, arms=("plain",))
    policy = floor_policies(inner, model=FloorModel())
    resting = [policy(True) for _ in range(16)]  # a fresh FloorModel: admit() alone would say FLOOR
    assert all(isinstance(p, RestingFloor) and isinstance(p.inner, DraftBudget) for p in resting)
    trial = resting[0].inner.model.trial
    for p in resting:
        p.begin(100, 64)
    assert trial._in_flight == 16  # every resting round is in flight in the trial
    assert not any(p.allows(s) for p in resting for s in ("lookup", "model"))
    for p in resting:
        p.observe(0, 0)
    assert trial._in_flight == 0
    # Where the trial's arm lets a source draft, the admission is the floor's as before.
    drafting = floor_policies(load_policies(PassTimer(), 8, arms=("budget",)), model=FloorModel())
    assert isinstance(drafting(True), GoodputFloor)


# GOOD's model rounds keep 3 of 4 drafts for 1.6 plain steps of the request's wait, of which 0.1 more of its own
# work than a plain round's: they pay at 8 rounds in flight too (test_floor's charge for the others' wait).
SHARED = {"model": 0.225, None: 0.125}


def test_under_load_only_explorers_let_a_source_nothing_measured_read_their_context():
    # At 8 rounds in flight (level 3) no round has measured either source. A request's first drafting round
    # would read its whole context (100 tokens) into the drafters: only an explorer's does; in a burst the
    # others had all read their prompts into drafters that then lost (64 streams at T = 1).
    cautious = run(Request(at_load(8)), 30, GOOD, work=SHARED)
    assert cautious.sources == [None] * 30
    explorer = run(Request(at_load(8), explores=True), 30, GOOD, work=SHARED)
    assert explorer.sources[0] == "model" and explorer.sources.count("model") >= 28  # all but the calibration
    alone = run(Request(FloorModel()), 30, GOOD)  # alone (level 0): the benefit of the doubt, as before
    assert alone.sources[0] == "model"


def test_once_an_explorers_rounds_measured_a_source_that_pays_the_cautious_requests_draft_it():
    model = at_load(8)
    cautious = run(Request(model), 5, GOOD, work=SHARED)
    assert cautious.sources == [None] * 5
    run(Request(model, explores=True), 10, GOOD, work=SHARED)
    assert model.at(True, 3).gains["model"].ratio() > 1.0
    run(cautious, 20, GOOD, work=SHARED)
    assert cautious.sources[-10:] == ["model"] * 10  # caught up, and drafting on
    assert run(Request(model), 5, GOOD, work=SHARED).sources[0] == "model"  # a new request's prompt round


def test_beside_other_rounds_where_nothing_was_measured_explorers_come_at_gaps_that_double():
    # A burst into a new server: the first explores, then one after 4, 8, 16, 32 more (EXPLORE_EVERY, doubling).
    model = at_load(8)
    admitted = [model.admit(True) for _ in range(64)]
    explorers = [i for i, start in enumerate(admitted) if start == goodput.EXPLORE]
    assert explorers == [0, 4, 12, 28, 60] and set(admitted) == {goodput.EXPLORE, goodput.FLOOR}
    assert [model.admit(False) for _ in range(2)] == [goodput.EXPLORE, goodput.FLOOR]  # each kind its own
    assert {FloorModel().admit(True) for _ in range(8)} == {goodput.FLOOR}  # alone: every request tries


def test_a_level_nothing_measured_takes_the_nearest_measured_levels_evidence():
    # Level 3 has no rounds; level 2's say the model pays (or loses): a request at level 3 drafts in its prompt's
    # round (or does not), as it would on its own level's evidence, without an explorer having to find out.
    for earned, drafts in ((2.5, True), (0.5, False)):
        model = at_load(8)
        for _ in range(3):
            model.drafted(model.at(True, 2), "model", earned, 1.0)
        request = run(Request(model), 1, GOOD, work=SHARED)
        assert (request.sources[0] == "model") is drafts
        assert model.at(True, 4).gains["model"].rounds == 0  # borrowed, not copied


def test_beside_another_round_at_level_0_a_request_is_as_cautious_as_under_load():
    # The level lags a burst (4 of a 64-stream burst were admitted at level 0): another round in flight is enough.
    model = FloorModel()
    other = GoodputFloor(model, True, FIXED, clock=Clock())
    other.begin(10)
    assert model.level() == 0
    assert run(Request(model), 1, GOOD).sources == [None]
    other.observe(0, 0)  # it ended: alone again
    assert run(Request(model), 1, GOOD).sources == ["model"]


def test_under_load_fewer_losing_rounds_let_requests_rest_than_alone():
    # Under load a floor's round costs every request its bookkeeping and only probes measure a source that is
    # off: REST_EVIDENCE rounds of losing evidence rest a request. Alone, where drafting gains most, it takes
    # REST_EVIDENCE_ALONE.
    for model, level in ((at_load(8), 3), (FloorModel(), 0)):
        here = model.at(True, level)
        model.plain(here, 1.0, 0.8)
        while here.gains["model"].rounds < goodput.REST_EVIDENCE:
            for source in goodput.SOURCES:
                model.drafted(here, source, 1.0, 1.5)
        assert here.gains["model"].rounds < goodput.REST_EVIDENCE_ALONE
        admitted = [model.admit(True) for _ in range(8)]
        assert (goodput.REST in admitted) is (level > 0)


def test_under_load_one_sources_full_evidence_carries_the_others_thin_evidence_to_a_rest():
    # At 64 streams at T = 1 the lookup lost on 62 rounds while the model, off, never had 4 rounds at the level
    # (only probes measure it): every request ran the floor. Under load that now rests, unless the thin source
    # pays (and alone, where drafting gains most, both need full evidence).
    for model, level, model_earned, rests in (
        (at_load(8), 3, 0.5, True),
        (at_load(8), 3, 2.0, False),
        (FloorModel(), 0, 0.5, False),
    ):
        here = model.at(True, level)
        model.plain(here, 1.0, 0.8)
        while here.gains["lookup"].rounds < goodput.REST_EVIDENCE_ALONE:
            model.drafted(here, "lookup", 1.0, 1.5)
        model.drafted(here, "model", model_earned, 1.0)  # one round
        admitted = [model.admit(True) for _ in range(8)]
        assert (goodput.REST in admitted) is rests, (level, model_earned)


def test_a_higher_levels_evidence_is_not_lent_to_a_lower_one():
    # Drafting gains less the more rounds share the passes: a loss at 64 streams says nothing at 16. Lent down,
    # a 64-stream warm-up's losing rounds rested every request at 4 and 16 streams for the whole level (the
    # family's prompts, greedy: 0% of rounds drafted, 0.95x plain), and resting rounds measure nothing: the level
    # starts as a new server's does. A loss at a lower level is one here.
    for losing, rests in ((6, False), (2, True)):
        model = at_load(16)  # level 4
        assert model.level() == 4
        model.plain(model.at(True, 4), 1.0, 0.8)
        there = model.at(True, losing)
        while there.gains["model"].rounds < 2 * goodput.REST_EVIDENCE_ALONE:
            for source in goodput.SOURCES:
                model.drafted(there, source, 1.0, 1.5)
        assert (model.evidence(True, 4, "model") is there.gains["model"]) is rests
        admitted = [model.admit(True) for _ in range(8)]
        assert (goodput.REST in admitted) is rests, losing
        if not rests:  # nothing known at or below level 4: as on a new server, the first admitted explores
            assert admitted[0] == goodput.EXPLORE


def test_level_0_and_the_levels_under_load_lend_each_other_no_evidence():
    # After a burst, level 0 may have no rounds of its own, and the levels under load lose. Borrowed, their
    # rounds rested lone requests or kept their floors from drafting (the family's prompts at T = 0.7, one
    # stream after 16: 0-14% of rounds drafted, 1.00x plain). Alone a request starts as on a new server; and
    # a level under load takes nothing from level 0's, where drafting gains most.
    lone = FloorModel()
    lone.drafted(lone.at(True, 0), "model", 2.0, 1.0)
    assert lone.evidence(True, 0, "model") is not None and lone.evidence(True, 2, "model") is None
    model = FloorModel()
    model.plain(model.at(True, 0), 1.0, 0.8)
    busy = model.at(True, 4)
    while busy.gains["model"].rounds < 2 * goodput.REST_EVIDENCE_ALONE:
        for source in goodput.SOURCES:
            model.drafted(busy, source, 1.0, 1.5)
    assert model.level() == 0
    assert model.evidence(True, 0, "model") is None and model.evidence(True, 6, "model") is busy.gains["model"]
    assert all(model.admit(True) == goodput.FLOOR for _ in range(8))
    assert run(Request(model), 1, GOOD).sources == ["model"]  # its prompt's round drafts, as on a new server
    here = model.at(True, 0)
    while here.gains["model"].rounds < goodput.REST_EVIDENCE_ALONE:  # its own rounds lose as well: it rests
        for source in goodput.SOURCES:
            model.drafted(here, source, 1.0, 1.5)
    assert goodput.REST in [model.admit(True) for _ in range(8)]
