"""The floor under the speedup (engine.policies.floor), on simulated rounds with a clock of our own: a request
whose drafts do not pay falls back to plain decoding within a few rounds and loses no more than its
bound; one whose drafts pay keeps drafting; probes come at a bounded rate; what catching up costs is
the budget's, not the ratio's; the population's evidence starts a new request; load levels and sampling
kinds are judged apart; the inner policy's caps and vetoes stand."""

from __future__ import annotations

import itertools

import pytest

from cascade_service.core.policy import FIXED, OFF
from cascade_service.engine.policies import goodput as fl
from cascade_service.engine.policies.floor import CREDIT, EPSILON, PLAIN_SAMPLE, REST_ROUNDS, FloorModel, GoodputFloor
from tests.helpers.floors import BAD, GOOD, PLAIN_S, Clock, Request, at_load, run


def test_drafts_that_do_not_pay_fall_back_to_plain_within_a_few_rounds():
    request = run(Request(FloorModel()), 200)
    drafting = [i for i, s in enumerate(request.sources) if s is not None]
    assert drafting[:2] == [0, 2]  # the prompt's round drafts (nothing known), the next one measures p
    assert len([i for i in drafting if i < 20]) <= 4  # one losing round turned it off; probes follow
    # after that only probes: at most one stint per probe_min rounds off, and far fewer as they keep failing
    assert len([i for i in drafting if i >= 20]) <= 180 // fl.DEFAULTS.probe_min // 2


@pytest.mark.parametrize("catch_up", [0.0, 0.01])
def test_what_drafting_loses_stays_within_the_bound_plus_one_round(catch_up):
    request = run(Request(FloorModel()), 400, catch_up=catch_up)
    floor = request.floor
    worst_round = 1.6 + catch_up * 400 - PLAIN_S
    assert floor.loss <= CREDIT * PLAIN_S + EPSILON * floor.plain_equivalent + worst_round
    # and the clock agrees: the request took at most that much longer than plain decoding of its tokens
    assert request.clock.t <= request.plain_time() * (1 + EPSILON) + CREDIT * PLAIN_S + worst_round + 1.6


def test_drafts_that_pay_keep_drafting():
    request = run(Request(FloorModel()), 100, GOOD)
    assert request.sources.count("model") >= 97  # all but the calibration round
    assert request.floor.loss < 0  # it gained


# A sampled request's model rounds: 1 to 7 tokens at the same cost (2.5 plain steps), 3.35 a round on average
# (1.3x plain), its first judged rounds (the third on: the prompt's round and a plain one come first) a little
# unlucky, 2 tokens each. The K-matrix offers 6 drafts a round.
NOISY = [1, 1, 1, 5, 6, 1, 2, 4, 2, 0, 5, 1, 3, 0, 2, 6, 1, 0, 4, 2]


@pytest.mark.parametrize("confidence", [fl.DEFAULTS.confidence, 0.0])
def test_a_source_whose_rounds_pay_on_average_survives_its_unlucky_first_ones(confidence):
    request = Request(FloorModel(fl.FloorSettings(confidence=confidence)), greedy=False)
    for accepted in NOISY:
        request.round({"model": 2.5}, {"model": accepted}, k=6)
    share = request.sources.count("model") / len(request.sources)
    if confidence:
        assert share >= 0.9  # all but the round that measures p
        assert request.clock.t < request.plain_time() / 1.3
    else:  # the point estimate alone (the negative control): its first judged round turned it off
        assert share < 0.7
        assert request.clock.t > request.plain_time() / 1.25


def test_under_load_a_sources_estimate_is_not_taken_optimistic():
    # Its clock misses what its verification adds to the others' passes: the point estimate decides there.
    model = at_load(8)  # seven other requests stay in a round: level 3
    request = Request(model, greedy=False)
    for accepted in NOISY:  # no extra work (the charge for the others' wait is nil): the optimism alone decides
        request.round({"model": 2.5}, {"model": accepted}, k=6, work={"model": 0.125, None: 0.125})
    assert model.level() == 3
    assert request.sources.count("model") / len(request.sources) < 0.7  # as the point estimate alone


def test_under_load_a_round_is_charged_the_wait_its_extra_work_gives_the_others():
    # GOOD's rounds: 4 tokens for 1.6 plain steps of the request's own wait, 2.5x for itself. At 8 streams a
    # plain round's own work (its share of the pass, its Python) is a fraction of its wait; if 0.6 of a
    # plain step is the drafting round's extra work (drafter steps, the verification's extra positions),
    # each of the 7 others waits that long too: 4 tokens for 1.6 + 7 x 0.6 plain steps, 0.69x. (Explorers: at a
    # level nothing has measured, only they try a source.)
    loaded = Request(at_load(8), explores=True)
    for _ in range(60):
        loaded.round(*GOOD, work={"model": 0.725, None: 0.125})
    assert loaded.sources[-50:].count("model") <= 10  # probes only
    # where its extra work was 0.1 (its wait mostly the others' passes): 4 tokens for 2.3, so it drafts on
    shared = Request(at_load(8), explores=True)
    for _ in range(60):
        shared.round(*GOOD, work={"model": 0.225, None: 0.125})
    assert shared.sources[-50:].count("model") >= 48
    alone = Request(FloorModel())  # alone its wait is the only one: the round's work does not decide
    for _ in range(60):
        alone.round(*GOOD, work={"model": 0.725, None: 0.125})
    assert alone.sources[-50:].count("model") == 50


def test_under_load_other_work_in_a_rounds_wait_does_not_excuse_its_own_extra_work():
    # Its wait holds 2 plain steps of the others' work (a prefill) besides its own 0.3 of extra work: 4 tokens
    # for 3.3 steps of its own wait, but each of the 7 others waited 0.3 for it too: 5.4 steps.
    request = Request(at_load(8))
    for _ in range(60):
        request.round({"model": 3.3}, {"model": 3}, work={"model": 0.425, None: 0.125})
    assert request.sources[-50:].count("model") <= 10  # probes only


def test_a_gains_standard_error_is_the_spread_of_its_rounds_over_root_n():
    gain = fl.Gain()
    nets = [1.0, -2.0, 0.5, 3.0, -1.0]
    for net in nets:
        gain.add(2.0 + net, 2.0, decay=1.0)
    mean = sum(nets) / len(nets)
    spread = (sum((x - mean) ** 2 for x in nets) / len(nets)) ** 0.5
    assert gain.standard_error() == pytest.approx(spread / len(nets) ** 0.5)
    assert gain.ratio(1.0) == pytest.approx((gain.earned + len(nets) * spread / len(nets) ** 0.5) / gain.cost)
    scaled = gain.scaled(2.0)  # two rounds' worth: the same mean and spread, over two rounds
    assert scaled.ratio() == pytest.approx(gain.ratio())
    assert scaled.standard_error() == pytest.approx(spread / 2**0.5)


def test_a_request_that_starts_paying_is_found_by_a_probe_and_drafts_again():
    request = run(Request(FloorModel()), 40)
    assert request.sources[-8:].count("model") <= 1
    run(request, 80, GOOD)
    assert request.sources[-30:].count("model") >= 28


def test_a_catch_up_round_counts_in_the_budget_but_not_in_the_ratio():
    # drafting pays 2.5x once running, but its first round after a long rest reads 2,000 tokens
    model = FloorModel()
    request = Request(model, prompt=2000)
    request.floor.begin(2000, 10_000)  # the prompt's round: its drafters did not read the prompt
    request.clock.t += 50.0
    request.floor.observe(0, 0)
    run(request, 60, GOOD, catch_up=0.002)
    assert request.sources[-20:].count("model") >= 18  # the catch-up (4 plain steps) did not turn it off
    level = model.at(True, 0)
    assert level.gains["model"].ratio() == pytest.approx(4 / 1.6)  # judged rounds only
    # per token behind: its 2,001 tokens at 0.002, beyond a running round's cost (p before any ran: the
    # round's own 0.6 above p counts as catching up too)
    assert level.catch_up_s["model"] == pytest.approx((4.0 + 0.6) / 2001)


def test_a_source_that_must_catch_up_drafts_only_where_the_request_has_tokens_left_to_pay_it_back():
    def prompt_round(request: Request) -> None:  # its drafters did not read the prompt (a lookup filled it, say)
        request.floor.begin(request.committed, request.end - request.committed)
        request.clock.t += 50.0
        request.floor.observe(0, 0)
        request.committed += 1

    model = FloorModel()
    first = Request(model, prompt=2000)
    prompt_round(first)
    run(first, 40, ({"model": 1.6}, {"model": 1}), catch_up=0.002)  # 2 tokens for 1.6 steps: 1.25x
    assert model.at(True, 0).catch_up_s["model"] is not None
    # 1.25x saves 0.2 of a plain step a token: reading 2,000 tokens (4 steps) takes 20 tokens to pay back
    short = Request(model, prompt=2000, budget=12)
    long = Request(model, prompt=2000, budget=400)
    for request in (short, long):
        prompt_round(request)
        run(request, 10, ({"model": 1.6}, {"model": 1}), catch_up=0.002)
    assert short.sources.count("model") == 0 and long.sources.count("model") >= 8


def test_a_new_request_starts_from_every_requests_evidence():
    model = FloorModel()
    for _ in range(3):
        run(Request(model), 30)
    fresh = run(Request(model), 12)
    assert fresh.sources[0] is None  # the prompt's round: every request's rounds here said model drafting loses
    assert fresh.sources.count("model") <= 1


def test_what_one_api_key_taught_never_reaches_another_keys_requests():
    # invariant 8: a request starts from its own key's evidence only (timing must not cross tenants)
    model = FloorModel()
    for _ in range(3):
        request = Request(model)
        request.floor.scope = "alice"
        run(request, 30)  # alice's drafts never pay
    alice, bob = Request(model), Request(model)
    alice.floor.scope, bob.floor.scope = "alice", "bob"
    run(alice, 1), run(bob, 1)
    assert alice.sources == [None] and bob.sources == ["model"]  # bob's first round drafts, nothing known


def test_greedy_and_sampled_requests_learn_apart():
    model = FloorModel()
    for _ in range(3):
        run(Request(model, greedy=False), 30)  # sampled: drafts never pay
    for _ in range(3):
        run(Request(model, greedy=True), 30, GOOD)
    greedy = run(Request(model, greedy=True), 10, GOOD)
    assert greedy.sources[0] == "model" and greedy.sources.count("model") >= 8


def test_load_levels_follow_the_rounds_in_flight():
    model = FloorModel()
    floors = [GoodputFloor(model, True, FIXED, clock=Clock()) for _ in range(16)]
    for floor in floors:
        floor.begin(10)
    for i in range(200):  # 16 requests, each always in a round but for the moment between two
        floors[i % 16].observe(0, 0)
        floors[i % 16].begin(10)
    assert model.level() == 4
    assert floors[0]._level is model.at(True, 4)
    for floor in floors[1:]:
        floor.observe(0, 0)
    for _ in range(60):  # now alone
        floors[0].observe(0, 0)
        floors[0].begin(10)
    assert model.level() == 0


class LookupsOnly(type(FIXED)):  # type: ignore[misc]
    def allows(self, source: str) -> bool:
        return source == "lookup"


def test_a_lookup_that_finds_nothing_is_a_plain_round():
    request = Request(FloorModel(), inner=LookupsOnly())
    request.round({}, {}, hit=False)
    request.round({}, {}, hit=False)
    floor = request.floor
    floor.begin(request.committed)
    assert floor.allows("lookup")
    request.clock.t += 1.05
    floor.observe(0, 0)  # it drafted nothing
    floor.begin(request.committed + 1)
    assert floor.drafting_rounds == 0 and floor.loss == 0.0
    assert floor._own_plain_rounds == 2  # the calibration round and the lookup's miss


def test_the_inner_policys_veto_and_caps_stand():
    request = run(Request(FloorModel(), inner=OFF), 20, GOOD)
    assert request.sources == [None] * 20  # OFF lets nothing draft, so the floor drafts nothing either


def test_an_unknown_plain_cost_makes_the_round_plain_and_a_stale_one_is_measured_again():
    model = FloorModel()
    request = run(Request(model), 3, GOOD)
    assert request.sources[1] is None  # no plain round measured at this level: a calibration
    run(request, fl.CALIBRATE + 2, GOOD)
    assert request.sources[3:].count(None) == 1  # one more after CALIBRATE rounds without a plain one


class Switch(type(FIXED)):  # type: ignore[misc]
    """The inner policy (load adaptation) lets every source draft while `on`, none while off."""

    on = True

    def allows(self, source: str) -> bool:
        return self.on


def probing(inner: Switch) -> Request:
    """A request under `inner` in the first round of a probe of model drafting, which loses at its level."""
    model = FloorModel()
    for _ in range(3):
        run(Request(model), 30)  # model drafting loses here: a new request drafts it only as probes
    request = Request(model, inner=inner)
    request.round(*BAD)  # the prompt's round: every request's rounds here say model drafting loses
    while request.round(*BAD) != "model":  # the probe's first round: catching up on the prompt
        assert len(request.sources) < 40
    return request


def test_a_probe_the_inner_policy_vetoes_ends_and_waits_its_interval_again():
    inner = Switch()
    request = probing(inner)
    inner.on = False
    assert request.round(*BAD) is None  # vetoed: the stint ends here
    inner.on = True
    after = [request.round(*BAD) for _ in range(fl.DEFAULTS.probe_min - 1)]
    assert after == [None] * (fl.DEFAULTS.probe_min - 1)  # not the rest of a stint: a new wait


def test_a_round_the_inner_policy_keeps_plain_is_not_decided_and_a_probe_under_way_ends():
    inner = Switch()
    request = probing(inner)
    decided = counting_decisions(request)
    inner.on = False  # load adaptation's "plain" arm: nothing may draft
    floor = request.floor
    timed, plain_time = floor._own_plain_rounds, floor.plain_equivalent
    quiet = 3 * fl.DEFAULTS.probe_min
    assert [request.round(*BAD) for _ in range(quiet)] == [None] * quiet
    assert decided == []  # nothing was decided: there was nothing to decide
    # One round in PLAIN_SAMPLE was timed into p, as a resting request's are; every round's token counts in
    # the request's plain time (the bound's EPSILON term), and so does the probe's round before them.
    assert abs(floor._own_plain_rounds - timed - quiet / PLAIN_SAMPLE) <= 1
    assert quiet <= (floor.plain_equivalent - plain_time) / PLAIN_S <= quiet + 1
    inner.on = True
    after = [request.round(*BAD) for _ in range(fl.DEFAULTS.probe_min - 1)]
    assert after == [None] * (fl.DEFAULTS.probe_min - 1)  # the probe's stint ended with the veto


LOSING_BOTH = ({"model": 1.6, "lookup": 1.6}, {"model": 0, "lookup": 0})  # neither source keeps a draft


def counting_decisions(request: Request) -> list[int]:
    """The rounds (1-based) at which the request's floor decided; the rest it stayed plain as decided."""
    decided: list[int] = []
    decide = request.floor._decide

    def counted(here, alone):
        decided.append(request.floor.rounds)
        return decide(here, alone)

    request.floor._decide = counted  # type: ignore[method-assign]
    return decided


def where_nothing_pays() -> FloorModel:
    """A model whose level holds three requests' rounds in which neither source kept a draft."""
    model = FloorModel()
    for _ in range(3):
        run(Request(model), 40, LOSING_BOTH, hit=True)
    return model


def test_a_request_kept_plain_decides_again_only_when_a_probe_falls_due_or_rest_rounds_pass():
    model = where_nothing_pays()
    request = Request(model)
    decided = counting_decisions(request)
    run(request, 200, LOSING_BOTH, hit=True)
    assert request.sources.count(None) > 180  # plain, but for probes
    gaps = [b - a for a, b in itertools.pairwise(decided)]
    assert max(gaps) <= REST_ROUNDS + 1  # every request's evidence reaches it this late at most
    assert len(decided) < 200 / 2  # most rounds did not decide at all
    # and it probed as often as a request that decides every round
    eager = Request(model)
    eager_decide = eager.floor._decide

    def no_rest(here, alone):
        allowed = eager_decide(here, alone)
        eager.floor._rest = 0
        return allowed

    eager.floor._decide = no_rest  # type: ignore[method-assign]
    run(eager, 200, LOSING_BOTH, hit=True)
    probes = sum(s is not None for s in request.sources)
    assert abs(probes - sum(s is not None for s in eager.sources)) <= 1


def test_a_resting_request_decides_again_when_the_load_level_moves():
    model = where_nothing_pays()
    request = run(Request(model), 30, LOSING_BOTH, hit=True)
    decided = counting_decisions(request)
    model._load = 8.0  # seven more rounds in flight: level 3, evidence of its own
    request.round(*LOSING_BOTH, hit=True)
    assert decided == [request.floor.rounds]


def test_a_probe_falling_due_while_the_inner_policy_keeps_rounds_plain_is_skipped_and_waits_again():
    inner = Switch()
    request = run(Request(where_nothing_pays(), inner=inner), 30, LOSING_BOTH, hit=True)
    floor = request.floor
    inner.on = False
    waits = []
    for _ in range(3 * max(floor._interval.values())):
        assert request.round(*LOSING_BOTH, hit=True) is None
        waits.append(dict(floor._waited))
    # Every source was off and waiting: its wait ran on, and where it reached the interval it started over,
    # so no probe is owed when the arm changes (every request probing at once after a "plain" epoch).
    for source in ("lookup", "model"):
        ran = [w[source] for w in waits]
        assert max(ran) < floor._interval[source] and any(b < a for a, b in itertools.pairwise(ran)), source
