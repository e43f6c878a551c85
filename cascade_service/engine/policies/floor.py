"""A floor under the speedup: each request drafts only while its own measured rounds say drafting beats
plain decoding, and what it may lose finding that out is bounded (docs/algorithm.md "The floor under the
speedup" states the rules and the guarantee; this is their code).

A round's cost c is the wall time the request took from the start of one target round to the next
(`clock.waited`: its waits for others' passes included), its yield n the tokens it committed; plain
decoding's cost per token p is measured the same way from rounds that drafted nothing (the request's
own once it has had two, else every request's at this load level; none measured lately: a calibration
round drafts nothing). A drafting round earns n p, its gain ratio n p / c; under load (N rounds in
flight) c also counts (N - 1)(w - w_p), the others' wait for its work beyond a plain round's (`charged`).
Per source ("lookup": the MaG lookup gate; "model": the K-matrix's drafters) a request keeps decayed sums
of n p and c, started from every request's at its level (its key's, greedy and sampled apart) as
`prior_rounds` rounds' worth; a source drafts while its ratio is at least 1 (`margin` of hysteresis;
alone and within the bound, a running source's ratio is taken `confidence` standard errors optimistic).
A round belongs to the source that filled its block. A source that rested is behind: its first round
back pays a catch-up (reading the tokens committed meanwhile), counted in the budget but not its ratio,
and is let back only where the tokens the request has left can pay that back.

The budget: L = sum over drafting rounds of (c - n p) stays within CREDIT p + EPSILON (plain time of
its tokens), plus one round: a source not shown to pay drafts only as a probe whose expected loss fits
under the bound; past it only a source the request's own rounds showed to pay drafts. A probe is one
stint (its catch-up round, one judged round) every `interval` rounds off, tuned by every request's
probes within [probe_min, probe_max], doubled for the request at each failed one; one that paid decides
alone (no past locks a source out); a veto of the inner policy ends a stint. Outside the bound, on
purpose (docs/algorithm.md): the prompt's round, not judged; a level's catch-ups before a rate is
measured, not priced; the judged rounds after a catch-up that crossed it (one; a sampled request three).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ...core.policy import SOURCES, BlockPolicy
from ..clock import waited, work_clock
from . import goodput
from .goodput import BEHIND, CREDIT, DEFAULTS, EPSILON, FloorModel, FloorSettings, Gain, Level
from .rest import PLAIN_SAMPLE

__all__ = ["BEHIND", "CREDIT", "DEFAULTS", "EPSILON", "FloorModel", "FloorSettings", "GoodputFloor"]

# A probe's stint ends after its judged round, or after this many rounds: a lookup's is judged only where
# MaG found a match (a miss drafts nothing), so it waits longer.
PROBE_ROUNDS = {"lookup": 8, "model": 3}
# Rounds a request kept plain may stay plain without deciding again, while its load level holds and no
# probe falls due: deciding costs every round a lock, the level's evidence and both sources' estimates
# (docs/algorithm.md). Every request's evidence reaches a resting request this many rounds late at most.
REST_ROUNDS = 8
# Judged rounds after a sampled request's catch-up, past the bound if need be (a greedy request's, or a probe's,
# which only asks whether the source pays again: 1), where the evidence let the source draft. A sampled
# round's yield varies (1 to k + 1 tokens at one cost): on Qwen2.5-Coder at T = 1 a 0.5B paying 1.44x kept 1
# token in its one judged round after reading a 315-token prompt and was off for that request and the next.
SAMPLED_STINT = 3
PROBE_HOPE = 2.0  # a probe is worth its catch-up only if a source earning this ratio would pay it back
OWN_PLAIN_SMOOTHING = 0.3  # EWMA of the request's own plain rounds: its context grows, its p with it


class GoodputFloor:
    """One request's floor (see the module's docstring): a block policy over `inner` (the K-matrix as
    configured, or load adaptation), which caps the sources the floor lets draft."""

    def __init__(
        self,
        model: FloorModel,
        greedy: bool,
        inner: BlockPolicy,
        clock: Callable[[], float] = waited,
        scope: str = "",
        compute: Callable[[], float] | None = None,
    ):
        self.model, self.greedy, self.inner, self.clock, self.scope = model, greedy, inner, clock, scope
        self.compute = work_clock(clock, compute)
        self.settings = model.settings
        self.rounds = 0  # target rounds begun
        self.drafting_rounds = 0  # of them, rounds whose block a source filled
        self.loss = 0.0  # L: seconds its drafting rounds lost against plain decoding
        self.plain_equivalent = 0.0  # plain decoding's time for the tokens of its judged rounds
        self._own: dict[str, Gain] | None = None  # from the prior, at its first judged round
        self._unpriced: set[str] = set()  # sources whose prior had no rounds behind it (`_decide`)
        self._own_plain: float | None = None
        self._own_plain_rounds = 0
        self._own_plain_work: float | None = None  # the work (compute clock) of its plain rounds, EWMA
        self._on = set(SOURCES)
        self._read = dict.fromkeys(SOURCES, 0)  # committed tokens each source has read
        self._waited = dict.fromkeys(SOURCES, 0)
        self._interval: dict[str, int] = {}
        self.explores = False  # admitted to explore where drafting loses (FloorModel.admit): probes soon
        self._rest = 0  # rounds it stays plain without deciding again (REST_ROUNDS)
        self._resting: tuple[str, ...] = ()  # the sources whose wait for a probe goes on meanwhile
        self._rest_level = -1  # the load level it decided at: another level decides again
        self._probing: dict[str, int] = {}  # source -> rounds of its probe's stint so far
        self._stint: dict[str, int] = {}  # sources that caught up -> judged rounds they may still run past the bound
        self._vetoed: set[str] = set()  # sources the inner policy refused this round
        self._mine = {s: Gain() for s in SOURCES}  # its own judged rounds per source, the prior aside
        # the round under way: its level, p, committed length, the sources let draft, the one that did
        self._level: Level | None = None
        self._p: float | None = None
        self._committed = 0
        self._remaining = 0
        self._allowed: frozenset[str] = frozenset()
        self._source: str | None = None
        self._read_now: set[str] = set()  # the sources asked this round (they read the committed tokens)
        self._began = 0.0
        self._began_work = 0.0
        self._timed = True  # the round under way is judged at the next one's begin (`_quiet`)
        self._in_flight = 1.0  # target rounds in flight as this one began, its own included (smoothed)
        self._pending: tuple[str | None, int, int] | None = None  # (source, tokens, behind): judged next round

    # --- the block policy ------------------------------------------------------------------------

    def begin(self, committed: int = 0, remaining: int = 0) -> None:
        now, work = self.clock(), None
        if self._pending is not None:  # the last round ran from its begin to this one's
            work = self.compute()
            self._judge(*self._pending, now - self._began, work - self._began_work)
            self._pending = None
        self._committed, self._remaining = committed, remaining
        self.inner.begin(committed, remaining)
        self.model.started(self)
        self.rounds += 1
        self._timed = True
        level = self.model.level()
        self._in_flight = self.model.in_flight() if level > 0 else 1.0  # alone: its own wait is the test
        self._source = None
        self._read_now = set()
        if self._rest > 0 and level == self._rest_level and self._level is not None:
            self._rest -= 1  # plain again, as decided (REST_ROUNDS); its probes' wait goes on
            for source in self._resting:
                self._wait(source)  # never due meanwhile: the rest ends the round before the first is
            self._quiet(now, work)
            return
        self._rest = 0
        if self._level is None or level != self._rest_level:
            self._level = self.model.at(self.greedy, level, self.scope)
        self._rest_level = level
        inner = self.inner
        if self.rounds > 1 and not (inner.allows("lookup") or inner.allows("model")):
            # The inner policy lets nothing draft (load adaptation's "plain" arm): nothing to decide. A probe
            # or stint under way ends, as a veto ends it; a probe falling due is skipped and waits its interval
            # again (a wait held until the arm changed made every request probe at once after a "plain" epoch:
            # at T = 1 on the disagree set, 64 streams, 2.7-5.4% of rounds drafted, 0.87x the code before).
            if self._probing or self._stint:
                self._vetoed.update(self._probing, self._stint)
            for source in SOURCES:
                if source not in self._on and source not in self._probing and source not in self._stint:
                    if self._wait(source):
                        self._waited[source] = 0  # skipped: it waits its interval again
            self._quiet(now, work)
            return
        self._began, self._began_work = now, work if work is not None else self.compute()
        self._allowed = self._decide(self._level, alone=level == 0)

    def _quiet(self, now: float, work: float | None) -> None:
        """A round plain with nothing to decide (a rest, or the "plain" arm): timed into p one round in
        PLAIN_SAMPLE, as a resting request's are (judging every one was a third of the policies' 38 us a
        round at 64 streams at T = 1, where every request ran the floor under the "plain" arm)."""
        assert self._level is not None
        self._p = self._plain(self._level)
        self._allowed = frozenset()
        self._timed = self.rounds % PLAIN_SAMPLE == 0
        if self._timed:
            self._began, self._began_work = now, work if work is not None else self.compute()

    def allows(self, source: str) -> bool:
        if source not in self._allowed:
            return False
        if not self.inner.allows(source):
            self._vetoed.add(source)  # load adaptation said no: a probe or a catch-up's stint of it ends
            return False
        if source == "lookup":
            self._read_now.add(source)  # asked, MaG reads the committed tokens whether it finds a match or not
        return True

    def cap(self, source: str, offered: int, ceiling: int) -> int:
        if source not in self._allowed:
            return 0
        k = self.inner.cap(source, offered, ceiling)
        if k == 0 and offered > 0:
            self._vetoed.add(source)
        if k > 0:
            self._source = source  # the block is this source's (a later cap of 0 keeps it so)
            self._read_now.add(source)
        return k

    def drafted(self) -> None:
        self.inner.drafted()

    def observe(self, drafted: int, accepted: int) -> None:
        """The review is in; the round is judged at the next one's begin (see the module's docstring)."""
        self.model.ended(self)
        self.inner.observe(drafted, accepted)
        source = self._source if drafted > 0 else None
        behind = self._behind(source) if source is not None else 0
        for asked in self._read_now:
            self._read[asked] = self._committed + accepted + 1  # it read up to the block it drafted
        if source is None and drafted > 0:
            return  # the request's prediction or its grammar's forced tokens filled it: not the floor's to judge
        if source is not None:
            self.drafting_rounds += 1
        elif not self._timed:  # a quiet round not timed (`_quiet`): its tokens count in plain time all the same
            if self._p is not None and self.rounds > 1:
                self.plain_equivalent += (accepted + 1) * self._p
            return
        self._pending = (source, accepted + 1, behind)

    # --- what a round taught ---------------------------------------------------------------------

    def _judge(self, source: str | None, tokens: int, behind: int, cost: float, work: float) -> None:
        here, p = self._level, self._p
        if self.rounds == 1 or here is None:  # the prompt's prefill is in it: no evidence of a round's cost
            return
        if source is None:
            self._own_plain = goodput.plain_ewma(self._own_plain, cost, OWN_PLAIN_SMOOTHING)
            self._own_plain_work = goodput.plain_ewma(self._own_plain_work, work, OWN_PLAIN_SMOOTHING)
            self._own_plain_rounds += 1
            self.model.plain(here, cost, work)
            if p is not None:
                self.plain_equivalent += tokens * p
            return
        assert p is not None and self._own is not None  # a source drafts only where p is known
        # Under load every other request in flight waits for this round's extra work as well. Where they
        # draft too, its wait already holds theirs, and this counts it again: stricter than throughput
        # needs, on purpose (the larger of its wait and p + N (w - w_p), exact there, drafted more at 4
        # streams on the real family and ran 0.94 / 0.91x plain against 0.98 / 1.01x: shares miss part
        # of what a drafting row adds to a pass).
        cost += (self._in_flight - 1.0) * self._extra_work(here, work)
        earned = tokens * p
        self.loss += cost - earned
        self.plain_equivalent += earned
        own = self._own[source]
        if behind > BEHIND:  # a catch-up: the budget's, and what catching up costs per token, not the ratio's
            running = here.gains[source].mean_cost() or p  # what the round would have cost without it
            self.model.caught_up(here, source, max(0.0, cost - running) / behind)
            # Its next rounds are judged, whatever the budget says: it paid to get there (SAMPLED_STINT).
            self._stint[source] = 1 if self.greedy or source in self._probing else SAMPLED_STINT
            return
        if self._stint.get(source, 0) > 1:
            self._stint[source] -= 1
        else:
            self._stint.pop(source, None)
        decay = self.settings.lookup_decay if source == "lookup" else self.settings.own_decay
        self._mine[source].add(earned, cost, decay)
        own.add(earned, cost, decay)
        self.model.drafted(here, source, earned, cost)
        if source in self._probing:
            del self._probing[source]
            paid = earned >= cost
            if paid:  # its own round paid: that, not every request's past, decides now (a prior cannot lock it out)
                self._own[source] = replace(self._mine[source])
            settings = self.settings
            self._interval[source] = settings.probe_min if paid else min(settings.probe_max, 2 * self._interval[source])
            self.model.probed(here, source, paid)

    # --- the decision ----------------------------------------------------------------------------

    def _decide(self, here: Level, alone: bool) -> frozenset[str]:
        """The sources that may draft this round (`alone`: it began at load level 0)."""
        if self.rounds == 1:  # the prefill round: draft where every request's rounds here say it pays
            self._p = None
            p = self._plain(here)
            tried = [s for s in SOURCES if not self._untried(here, s)]
            return frozenset(s for s in tried if self._gains(here, s).not_losing() and self._pays_back(here, s, p))
        calibrate = self.model.calibrating(here)
        self._p = p = self._plain(here)
        if p is None or calibrate:
            return frozenset()
        if self._own is None:
            self._own = {s: self._gains(here, s).prior(p, self.settings.prior_rounds) for s in SOURCES}
            self._unpriced = {s for s in SOURCES if here.gains[s].rounds <= 0.0}
            self._interval = dict(here.interval)
            if self.explores:
                self._interval = dict.fromkeys(SOURCES, self.settings.probe_min)
        settings = self.settings
        bound = settings.credit * p + settings.epsilon * self.plain_equivalent
        over = self.loss > bound  # then only what its own rounds showed to pay drafts
        allowed = set()
        waiting = []  # sources off, waiting for their next probe
        for source in SOURCES:
            if source in self._vetoed:  # the inner policy refused it last round: its stint ends there
                self._probing.pop(source, None)
                self._stint.pop(source, None)
            if source in self._probing:  # a probe's stint goes on until it has a judged round
                self._probing[source] += 1
                if self._probing[source] <= PROBE_ROUNDS[source]:
                    allowed.add(source)
                    continue
                del self._probing[source]
            if source in self._stint:  # caught up: judged rounds, to know what it earns
                allowed.add(source)
                continue
            if source in self._unpriced and here.gains[source].rounds > 0.0:  # evidence came: the prior it lacked
                self._unpriced.discard(source)
                if self._mine[source].rounds <= 0.0:
                    self._own[source] = here.gains[source].prior(p, settings.prior_rounds)
            if self._untried(here, source):
                continue  # off, and not waiting for a probe: the explorers' rounds will say
            # Within the bound the estimate decides (every request's prior in it); past it, only the
            # request's own rounds: a source they show to pay earns the loss back.
            # Within the bound a running source's estimate is taken optimistic where the request runs
            # alone (the bound pays for rounds that prove it wrong: a sampled round's yield varies
            # widely). Not under load: there a round's clock misses what its verification adds to the
            # others' passes, and at 8 streams on the real family drafting rarely pays (the fixed
            # K-matrix ran 0.61x plain). A source off comes back on its point estimate.
            confidence = settings.confidence if source in self._on and alone else 0.0
            ratio = self._mine[source].ratio() if over else self._own[source].ratio(confidence)
            if over and ratio is None:
                ratio = 0.0
            if ratio is None or ratio >= 1.0 + (-settings.margin if source in self._on else settings.margin):
                if self._pays_back(here, source, p, ratio):  # a source running is never behind: it pays nothing
                    allowed.add(source)
                continue
            if over:
                continue
            probe_due = self._wait(source)
            waiting.append(source)
            # A probe must fit under the bound on its own: what the other source earned does not pay for it
            # (a model probe that must read a long context costs several plain steps, and rarely pays).
            if (
                probe_due
                and max(self.loss, 0.0) + self._probe_loss(here, source, p) <= bound
                and self._pays_back(here, source, p, PROBE_HOPE)
            ):
                allowed.add(source)
                self._probing[source] = 1
                self._waited[source] = 0
        self._on = {s for s in allowed if s not in self._probing}
        self._vetoed = set()
        if not allowed and not self._probing and not self._stint:
            # Plain until the first probe falls due (its wait ends), REST_ROUNDS at most.
            due = min((self._interval[s] - self._waited[s] for s in waiting), default=REST_ROUNDS + 1)
            self._rest = max(0, min(REST_ROUNDS, due - 1))
            self._resting = tuple(waiting)
        return frozenset(allowed)

    def _wait(self, source: str) -> bool:
        """A round with `source` off: its wait for a probe runs on. Whether that probe is due."""
        self._waited[source] += 1
        return self._waited[source] >= self._interval[source]

    def _plain(self, here: Level) -> float | None:
        """p: the request's own plain rounds once it has had two, else every request's at this level."""
        return self._own_plain if self._own_plain_known() else here.plain_s

    def _own_plain_known(self) -> bool:
        """Whether the request's own plain rounds (two at least) stand for plain decoding, its cost and work."""
        return self._own_plain_rounds >= 2

    def _extra_work(self, here: Level, work: float) -> float:
        """What a round's work (its shares of the passes and its Python: drafter steps, the verification's
        extra positions, reviews) came to beyond a plain round's, w - w_p (w_p the request's own plain
        rounds' once it has had two, else every request's at the level)."""
        plain = self._own_plain_work if self._own_plain_known() else here.plain_work_s
        return max(0.0, work - plain) if plain is not None else 0.0

    def _gains(self, here: Level, source: str) -> Gain:
        """Every request's rounds of `source` at its level, else at the nearest lower level that has some."""
        if here.gains[source].rounds > 0.0:
            return here.gains[source]
        return self.model.evidence(self.greedy, self._rest_level, source, self.scope) or here.gains[source]

    def _untried(self, here: Level, source: str) -> bool:
        """Whether `source` stays off for now: beside other rounds, behind (its first round would read the
        whole context), where no round it may borrow (`FloorModel.evidence`) measured it, unless it explores.
        At 64 streams at T = 1 the first 45 requests of a burst, admitted at levels nothing had measured,
        read their prompts into the drafters; the explorers (FloorModel.admit) find out for the rest."""
        if self.explores or self._behind(source) <= BEHIND or self._gains(here, source).rounds > 0.0:
            return False
        return self.model.crowded()

    def _behind(self, source: str) -> int:
        """Committed tokens `source` has not read (the whole context if it never drafted)."""
        return self._committed - self._read[source]

    def _pays_back(self, here: Level, source: str, p: float | None, ratio: float | None = None) -> bool:
        """Whether a source that must first catch up (read the tokens committed while it rested: the whole
        prompt if it never drafted) can earn that back in the tokens the request has left: at gain ratio
        r a token saves p (1 - 1/r). The first catch-up at a level (no rate measured yet), and a ratio
        or p not known, are given the benefit of the doubt."""
        behind = self._behind(source)
        rate = here.catch_up_s[source]
        if behind <= BEHIND or rate is None or p is None:
            return True
        if ratio is None:
            ratio = here.gains[source].ratio()
        if ratio is None:
            return True
        return self._remaining * p * (1.0 - 1.0 / max(ratio, 1e-9)) >= rate * behind

    def _probe_loss(self, here: Level, source: str, p: float) -> float:
        """What a probe of `source` loses if it earns no more than plain decoding: one running round's
        expected cost less p, twice where it is behind (its catch-up round, and one judged round), plus
        catching up (every request's rate per token behind, times the tokens)."""
        assert self._own is not None
        running = max(0.0, (self._own[source].mean_cost() or p) - p)
        behind = self._behind(source)
        if behind <= BEHIND:
            return running
        return 2 * running + (here.catch_up_s[source] or 0.0) * behind
