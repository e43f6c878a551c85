"""Speculation that adapts to load: each round's draft budget at the target, at one price for the batch.

Speculation buys tokens per target pass with extra verified positions. That pays while a pass costs
mostly its fixed part (reading the weights, launching kernels, Python) and stops paying once the batch
is large enough that a pass costs mostly per token (compute-bound): then every rejected draft is
wasted work that other requests wait for. CS Drafting's EWIF (paper §3.2) makes the trade explicit;
here its terms are measured instead of assumed. For a round with at most k drafts:

    E(k)    = tokens the round yields: 1 + the mean of min(accepted, k) over recent rounds that
              offered at least k drafts (this request's, weighted against every request's)
    cost(k) = row(k + 1) - row(1) + g k: the seconds its k drafts add to the batch's passes

where a target pass over B requests and T tokens takes F + q B + c T seconds (fitted from the target's
recent batched passes), row(n) is what a row of n new tokens adds to the passes it would meet: joined
to a recent pass where the batcher would join it (F / (B + 1) + q + c * padded length), alone where
not (F + q + c n), averaged over recent passes (PassTimer.row_seconds); g is the measured drafting
compute per drafted token. The budget is the k in [0, offered] that maximizes

    E(k) - G cost(k)

where G is the batch's goodput, measured: tokens committed per second over all requests in flight
(ArmTrial.goodput). A second added to a pass, or spent drafting on the loop, delays every request in
the batch, so it costs G tokens; a draft pays where the tokens it is expected to add exceed that.
That is one price for the whole batch, so the batch's verification budget goes to the requests whose
drafts are kept: a request whose drafts mostly fail stops drafting while the batch runs fast, one
whose drafts are kept goes on at the same load (a per-request ratio E(k) / cost(k) judged each
request by its own speed, so the worse its drafts, the cheaper its rounds' seconds looked to it).
It is Dinkelbach's method for the batch's tokens per second, sum E_i / sum seconds_i: at a price
equal to the best ratio the problem splits into one maximization per request, and each round's
measured goodput is the next price. k = 0 is plain decoding for that round. Before a round has been
measured, each request maximizes its own E(k) / (row(k + 1) + g k).

A round's drafts come from one of two sources, judged apart since they behave apart:
- "lookup": MaG's n-gram continuation (the target's lookup gate). It is found before the budget is
  asked (its cost is spent, g = 0), and is right as a whole or not at all;
- "model": the K-matrix's drafters; the budget caps the block before any drafter runs.

A request starts from every request's evidence (LoadModel keeps it), so it speculates at the level the
traffic supports from its first round; its own rounds take over as they come (PRIOR_WEIGHT). The
first WARMUP rounds of each source draft all they are offered, so that evidence covers every k: a
cautious start would only ever learn about short blocks.

That model is one of four arms (ARMS): the fixed K-matrix ("full"), the model's budget ("budget"),
MaG lookups only ("lookup") and no drafts ("plain"). Which one runs is decided by experiment
(engine.policies.trial.ArmTrial): all requests use one arm at a time, and each load level keeps the arm under
which requests measured the most tokens per second of round time. The model prices only what it
sees, and on a shared machine drafting costs the others more than that (see ArmTrial).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from ...core.policy import SOURCES
from ..clock import PassTimer, charged
from .trial import ARMS, ArmTrial, Round


class Evidence:
    """Decayed per-k sums over rounds: for each k, how many rounds offered >= k drafts (weight) and the
    sum of min(accepted, k) over them. A round offering `cap` drafts is evidence for every k <= cap,
    since a block capped at k is the first k drafts of the longer one. O(cap) per round, O(1) per read.
    """

    def __init__(self, size: int, decay: float):
        # (weights, accepted sums), replaced whole by `add`: readers need no lock, writers one
        self.table = ([0.0] * (size + 1), [0.0] * (size + 1))
        self.decay = decay

    def add(self, cap: int, accepted: int) -> None:
        d = self.decay
        weights, sums = self.table
        reach = min(cap, len(weights) - 1)
        self.table = (
            [w * d + (1.0 if k <= reach else 0.0) for k, w in enumerate(weights)],
            [a * d + (min(accepted, k) if k <= reach else 0.0) for k, a in enumerate(sums)],
        )

    def at(self, k: int) -> tuple[float, float]:
        """(weight, mean of min(accepted, k)); weight 0 where no round offered k drafts."""
        weights, sums = self.table
        if k >= len(weights) or weights[k] <= 0.0:
            return 0.0, 0.0
        return weights[k], sums[k] / weights[k]


class LoadModel:
    """What every request's budget consults: the target's pass cost and how its passes batch, the measured
    drafting cost, every request's recent rounds (the prior a new request starts from), and the trial
    of arms (how much to draft at all at this load)."""

    POPULATION_DECAY = 1.0 - 1.0 / 256  # every request's rounds: half-weight after ~180 rounds
    WARMUP = 32  # a source's first rounds draft all they are offered: evidence on every k to start from
    DRAFT_SMOOTHING = 0.05  # EWMA of drafting seconds per drafted token

    def __init__(
        self, timer: PassTimer, max_block: int, arms: Sequence[str] = ARMS, clock: Callable[[], float] = time.monotonic
    ):
        if max_block < 0:
            raise ValueError(f"max_block must be >= 0, got {max_block}")
        unknown = [a for a in arms if a not in ARMS]
        if unknown:
            raise ValueError(f"arms must be among {ARMS}, got {unknown}")
        self.timer = timer
        self.max_block = max_block
        self.trial = ArmTrial(arms, clock)  # arms=("budget",): the cost model alone decides
        self._lock = threading.Lock()
        self._population = {s: Evidence(max_block, self.POPULATION_DECAY) for s in SOURCES}
        self._draft_s_per_token = {s: 0.0 for s in SOURCES}  # 0 until measured: drafting looks free
        self._rounds = 0
        self._observed = {s: 0 for s in SOURCES}
        self.peers: list[LoadModel] = [self]  # the models whose rounds share the target's passes

    def budget(self) -> DraftBudget:
        return DraftBudget(self)

    def warming_up(self, source: str) -> bool:
        return self._observed[source] < self.WARMUP

    def population(self, source: str, k: int) -> tuple[float, float]:
        return self._population[source].at(k)

    def explore_now(self) -> bool:
        """True for one round in DraftBudget.EXPLORE across all requests (short requests explore too)."""
        with self._lock:
            self._rounds += 1
            return self._rounds % DraftBudget.EXPLORE == 0

    def draft_cost(self, source: str) -> float:
        return self._draft_s_per_token[source]

    def observe(self, source: str, drafted: int, accepted: int, draft_s: float) -> None:
        with self._lock:
            self._population[source].add(drafted, accepted)
            self._observed[source] += 1
            if drafted > 0:
                old, new = self._draft_s_per_token[source], draft_s / drafted
                self._draft_s_per_token[source] = new if old == 0.0 else old + self.DRAFT_SMOOTHING * (new - old)

    def goodput(self) -> float | None:
        """The batch's tokens per second (ArmTrial.goodput), greedy and sampled rounds together where
        BySampling shares the target's passes between two models; None before any round ended."""
        rates = [rate for rate in (model.trial.goodput() for model in self.peers) if rate is not None]
        return sum(rates) if rates else None

    def best_block(
        self,
        expected: Callable[[int], float] | float,
        offered: int,
        draft_s_per_token: float = 0.0,
        goodput: float | None = None,
    ) -> int:
        """The k in [0, offered] that maximizes E(k) - goodput * cost(k) (the module's docstring);
        without a goodput, the most tokens per second of its own row. `expected(k)` is the tokens a
        round with at most k drafts yields (a float: per-token acceptance, the geometric model)."""
        if not callable(expected):
            acceptance = expected
            expected = lambda k: expected_tokens(acceptance, k)  # noqa: E731
        if self.timer.cost() is None:  # nothing measured yet: speculate as configured
            return offered
        rows = [self.timer.row_seconds(k + 1) for k in range(offered + 1)]
        best, best_value = 0, 0.0
        for k, row_s in enumerate(rows):
            assert row_s is not None and rows[0] is not None  # a cost was fitted: every row is priced
            if goodput is None:
                seconds = row_s + draft_s_per_token * k
                value = expected(k) / seconds if seconds > 0 else float("inf")
            else:
                value = expected(k) - goodput * (row_s - rows[0] + draft_s_per_token * k)
            if k == 0 or value > best_value + 1e-9 * abs(best_value):
                best, best_value = k, value
        return best


class BySampling:
    """One LoadModel for greedy requests and one for sampled ones, over the same target passes.

    Greedy and sampled traffic accept differently (at temperature 1 a draft survives less often) and
    the best way to draft flips with the load for sampled traffic first, so each keeps its own
    evidence and its own trial of arms; a mix of the two is then served as each would be alone.
    `budget(greedy)` is the coordinator's per-request policy factory.
    """

    def __init__(self, make: Callable[[], LoadModel]):
        self.models = {True: make(), False: make()}
        for model in self.models.values():
            model.peers = list(self.models.values())

    def budget(self, greedy: bool) -> DraftBudget:
        return self.models[greedy].budget()


class DraftBudget:
    """One request's budget: `__call__(source, offered)` gives this round's cap, `observe` learns from
    the review. The arm the model's ArmTrial picks for the round comes first: "full" drafts all that is
    offered, "plain" nothing, "lookup" no model drafts; under "budget" (and for lookups under "lookup")
    the cap is this request's own.

    E(k) blends this request's rounds (decayed, DECAY per round) with every request's (PRIOR_WEIGHT
    rounds' worth): blocks are not geometric (a MaG lookup that copies the prompt is accepted whole or
    not at all), so measured means beat a per-token acceptance; the geometric model with a neutral
    acceptance fills in for k no round has offered yet. One round in EXPLORE (counted over all
    requests) that would draft less drafts all it is offered, so evidence on long blocks keeps coming
    while the load keeps the budget short.
    """

    DECAY = 0.9  # per round: the estimate follows the text as it changes (half-weight after ~7 rounds)
    PRIOR_WEIGHT = 2.0  # every request's evidence counts as this many of this request's rounds
    NEUTRAL = 0.5  # per-token acceptance assumed where nothing was measured
    EXPLORE = 16

    def __init__(self, model: LoadModel):
        self.model = model
        self.own = {s: Evidence(model.max_block, self.DECAY) for s in SOURCES}
        self.chosen: list[int] = []  # the cap of each round (what a benchmark reads)
        self._source: str | None = None  # of the round asked for and not yet observed
        self._round: Round | None = None  # the trial's round under way
        self._start: float | None = None  # the request's compute clock when its round was first let draft
        self._draft_s = 0.0

    def begin(self, committed: int = 0, remaining: int = 0) -> None:
        """A round starts (the target's draft is asked for): its arm is fixed. Its drafting time runs from
        the first source let draft (`allows`): nothing of the request's runs between, and a round its
        arm keeps plain (most rounds at high load) then never reads the clock."""
        self._round = self.model.trial.start_round()
        self._source = None
        self._start = None

    def keeps_plain(self) -> bool:
        """Whether a round begun now would draft nothing: the trial's epoch under way runs the "plain" arm
        (engine.policies.floor admits a request then as a resting one that still counts in the trial)."""
        return self.model.trial.arm == "plain"

    def allows(self, source: str) -> bool:
        """Whether this round's arm lets `source` draft at all ("plain" lets nothing, "lookup" only the
        lookup): an arm that keeps a source from drafting keeps it from costing anything too."""
        if self._round is None:
            self.begin()
        assert self._round is not None
        if not _drafts(self._round.arm, source):
            return False
        if self._start is None:
            self._start = charged()  # this thread's clock: the lookup and the drafting are part of the round
        return True

    def cap(self, source: str, offered: int, ceiling: int) -> int:
        """The block policy's cap (core.policy.BlockPolicy): this round's budget for `offered` drafts.
        A budget of everything offered leaves the ceiling as the fixed schedule does: a drafter that
        is itself a cascade may return more than its quota (its accepted tokens and its bonus), and
        cutting that to the quota made "full" draft less than the K-matrix (0.492 against 0.426
        target calls per token in the demo at one stream)."""
        wanted = min(offered, ceiling)
        k = self(source, wanted)
        return ceiling if k >= wanted else k

    def drafted(self) -> None:
        """Drafting is over: its cost is this request's share of the drafters' batched passes and its
        thread's own CPU (`charged`). Remote drafters' work is not in it: load adaptation is for
        in-process tiers."""
        self._draft_s = charged() - self._start if self._start is not None else 0.0

    def expected(self, source: str, k: int) -> float:
        weight, mean = self.own[source].at(k)
        prior_weight, prior = self.model.population(source, k)
        if prior_weight > 0.0:
            prior_weight = self.PRIOR_WEIGHT
        else:
            prior, prior_weight = expected_tokens(self.NEUTRAL, k) - 1.0, 1.0
        return 1.0 + (weight * mean + prior_weight * prior) / (weight + prior_weight)

    def __call__(self, source: str, offered: int) -> int:
        """This round's cap for `offered` drafts from `source` ("lookup" or "model")."""
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        offered = max(0, min(offered, self.model.max_block))
        if self._round is None:
            self.begin()
        assert self._round is not None
        if self._start is None:  # asked without `allows` first (a caller of the budget alone)
            self._start = charged()
        arm = self._round.arm
        self._source = source
        if not _drafts(arm, source):
            k = 0
        elif arm == "full" or self.model.warming_up(source):  # nothing to go on yet: speculate as configured
            k = offered
        else:
            draft_cost = 0.0 if source == "lookup" else self.model.draft_cost(source)
            expected = lambda k: self.expected(source, k)  # noqa: E731
            k = self.model.best_block(expected, offered, draft_cost, self.model.goodput())
            if k < offered and self.model.explore_now():
                k = offered
        self.chosen.append(k)
        return k

    def observe(self, drafted: int, accepted: int, draft_s: float | None = None) -> None:
        """The round's review: `drafted` tokens reached the target (fewer than the cap where a drafter
        stopped early), `accepted` of them kept; `draft_s` seconds were spent drafting them (None: as
        measured between `begin` and `drafted`)."""
        draft_s = self._draft_s if draft_s is None else draft_s
        source, self._source = self._source, None
        round_, self._round = self._round, None
        if round_ is not None:
            self.model.trial.end_round(round_, accepted + 1)
        # A round its arm kept from drafting is no evidence on E(k), nor part of the warm-up.
        if source is not None and round_ is not None and _drafts(round_.arm, source):
            self.own[source].add(drafted, accepted)
            self.model.observe(source, drafted, accepted, draft_s)


def _drafts(arm: str, source: str) -> bool:
    """Whether `arm` lets `source` draft ("plain" lets nothing, "lookup" only the MaG lookup)."""
    return arm in ("full", "budget") or (arm == "lookup" and source == "lookup")


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round yields with k drafts each accepted with probability `acceptance` until the first
    rejection, plus the target's own token: sum_{i=0..k} a^i."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


BudgetFactory = Callable[[], DraftBudget]


def load_policies(timer: PassTimer, max_block: int, arms: Sequence[str] = ARMS) -> Callable[..., DraftBudget]:
    """The coordinator's policy per request, given whether it is greedy (and its scope, unused: the load
    and the target's passes are the machine's): load adaptation over the target's passes (`timer`),
    greedy and sampled traffic judged apart (BySampling)."""
    by_sampling = BySampling(lambda: LoadModel(timer, max_block, arms))
    return lambda greedy, scope="": by_sampling.budget(greedy)
