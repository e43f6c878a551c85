"""What every request's floor (engine.policies.floor) learns from and is bounded by: its settings, and the
evidence every request of an API key leaves at a load level and sampling kind: what a plain round
costs, what each source's drafting rounds earned, what catching up costs per token, how often to probe;
and the load itself (target rounds in flight, the machine's)."""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ...core.policy import SOURCES


@dataclass(frozen=True)
class FloorSettings:
    """The floor's knobs (engine.policies.floor and docs/algorithm.md say what each bounds)."""

    # The share of plain decoding's time a request's drafting may lose, and the plain steps it may lose
    # before its drafting has earned anything. Both are what finding out costs: with 1% and one step, a
    # couple of rejected lookups early in a 64-token request stopped every lookup for the rest of it,
    # and the default ran at 0.89x the fixed cascade on the family's own prompts and 0.99x plain on the
    # prompts where drafts disagree; with 3% and three steps, 0.95x and 1.04x (bench.floor_settings).
    epsilon: float = 0.03
    credit: float = 3.0
    margin: float = 0.02  # hysteresis around a gain ratio of 1
    # Within the bound a running source's estimate is taken this many standard errors optimistic
    # (Gain.ratio). At T = 1 on the real family the point estimate turned the 0.5B off after its first
    # unlucky rounds (1-2 tokens where the mean was 2.5) for two thirds of a request: 33% of rounds drafted,
    # 4.4 tok/s against the K-matrix's 5.4-5.9; at 0.5 or 1, 77-78%. On the shipped family at T = 1,
    # where drafting loses, 1 drafted 36-66% of rounds and ran 0.90x `ar`; 0.5 ran as the point estimate.
    confidence: float = 0.5
    prior_rounds: float = 2.0  # every request's rounds at this level count as this many of a new request's own
    # Per own round of a source: the estimate follows the text as it changes. A lookup's rounds are few
    # and all-or-nothing (a match copied whole, or rejected at once), so its memory is longer.
    own_decay: float = 0.9
    lookup_decay: float = 0.97
    probe_min: int = 4  # a source's rounds off between its probes, at least
    probe_max: int = 64  # and at most


DEFAULTS = FloorSettings()
EPSILON, CREDIT = DEFAULTS.epsilon, DEFAULTS.credit  # the bound's terms, as engine.policies.floor names them
POPULATION_DECAY = 1.0 - 1.0 / 64  # per round of a source at a level, over every request
SMOOTHING = 0.1  # EWMA of a plain round's cost, and of catching up per token
PLAIN_CEILING = 1.5  # a plain round counts in p at most this many times p (plain_ewma)
BEHIND = 16  # tokens a source may trail the committed sequence by and still be running (a lookup round's)
CALIBRATE = 128  # rounds at a level without a plain one: the next round there drafts nothing
STALE_WEIGHT = 0.5  # a calibration's plain round below p, in p's EWMA (FloorModel.plain)
LOAD_SMOOTHING = 0.1  # EWMA of the target rounds in flight
# At a level where drafting loses, one request in EXPLORE_EVERY explores (FloorModel.admit); each probe that
# fails there doubles that gap, up to one in EXPLORE_RARELY, and one that pays brings it back. An explorer
# runs the floor, 46 + 16 us a round at 64 streams against a resting request's 11-13 + 4, and at T = 1 on
# the disagree set a quarter of the requests were explorers whose probes kept failing.
EXPLORE_EVERY = 4
EXPLORE_RARELY = 64
# A source's rounds at a level (decayed) before its losing there lets requests rest (`admit`): under load,
# and alone (level 0). Only probes measure a source that is off, so with 8, at 16 streams at T = 1 the model
# had 5.8 rounds at its level after 100 requests, and requests ran the floor (45 us a round more than a
# resting one, ~5% of a token there) for most of a 20 s window; with 4 they rested from the 8th second.
# Alone a floor's round is ~1% of a token and drafting gains most: at one stream at T = 0.7 (the family's
# prompts) 4 unlucky rounds rested a whole block's requests (0.95x plain where the others ran 1.04-1.11x).
REST_EVIDENCE = 4.0
REST_EVIDENCE_ALONE = 8.0


class Admission(Enum):
    """How a request starts (FloorModel.admit)."""

    FLOOR = "floor"
    REST = "rest"
    EXPLORE = "explore"


FLOOR, REST, EXPLORE = Admission.FLOOR, Admission.REST, Admission.EXPLORE


@dataclass
class Gain:
    """Decayed sums over rounds of one source: plain-equivalent seconds (n p), seconds spent (c), rounds;
    and, for how far the estimate may be off, each round's net (n p - c) squared and the weights squared
    (rounds^2 / weights2 is the effective count of rounds behind the sums)."""

    earned: float = 0.0
    cost: float = 0.0
    rounds: float = 0.0
    squares: float = 0.0
    weights2: float = 0.0

    def add(self, earned: float, cost: float, decay: float) -> None:
        net = earned - cost
        self.earned = self.earned * decay + earned
        self.cost = self.cost * decay + cost
        self.rounds = self.rounds * decay + 1.0
        self.squares = self.squares * decay + net * net
        self.weights2 = self.weights2 * decay * decay + 1.0

    def ratio(self, confidence: float = 0.0) -> float | None:
        """earned / cost; with `confidence` z > 0 its optimistic bound: the mean net per round raised by z
        standard errors (a sampled request's rounds yield 1 to k + 1 tokens at the same cost, so a few
        unlucky ones say little; a greedy request's, much alike, say much)."""
        if self.cost <= 0.0:
            return None
        bonus = confidence * self.rounds * self.standard_error() if confidence else 0.0
        return (self.earned + bonus) / self.cost

    def standard_error(self) -> float:
        """Of the mean net seconds per round, from the decayed sums (0 where there are none)."""
        if self.rounds <= 0.0 or self.weights2 <= 0.0:
            return 0.0
        mean = (self.earned - self.cost) / self.rounds
        variance = max(0.0, self.squares / self.rounds - mean * mean)
        return math.sqrt(variance * self.weights2) / self.rounds  # sqrt(variance / (rounds^2 / weights2))

    def mean_cost(self) -> float | None:
        return self.cost / self.rounds if self.rounds > 0.0 else None

    def prior(self, p: float, rounds: float) -> Gain:
        """A request's start from these rounds (every request's at its level), as `rounds` rounds' worth;
        where none were measured, one round that earned what it cost, give or take a plain step (a ratio of
        1: no opinion, but then a single round of its own does not decide alone)."""
        if self.rounds > 0.0:
            return self.scaled(rounds)
        return Gain(p, p, 1.0, p * p, 1.0)

    def not_losing(self) -> bool:
        """Whether these rounds earned at least what they cost (or there are none to say)."""
        ratio = self.ratio()
        return ratio is None or ratio >= 1.0

    def scaled(self, rounds: float) -> Gain:
        """The same means and spread, as `rounds` rounds' worth (of full weight each)."""
        if self.rounds <= 0.0:
            return Gain()
        f = rounds / self.rounds
        return Gain(self.earned * f, self.cost * f, rounds, self.squares * f, rounds)


def ewma(old: float | None, new: float, weight: float = SMOOTHING) -> float:
    return new if old is None else old + weight * (new - old)


def plain_ewma(old: float | None, new: float, weight: float = SMOOTHING) -> float:
    """`ewma` of plain rounds' costs (or work), each counted at most PLAIN_CEILING times the estimate.

    p is what a drafting round's tokens earn, so a p too high makes drafting look paying. A stall
    (a garbage collection, the host's other work) made one plain round 4-7x the others (19-32 ms
    against 4.4), which moved a level's p from 4.3-5.4 to 6.2-8.0 ms in one round; at one stream, while
    the requests then drafted every round, no plain round came to bring it down. At T = 1 on the
    disagree set model rounds keeping 1.8 tokens in 9.0 ms (0.90x plain's 4.4 ms a token) read as
    paying 1.28x, and 38% of rounds drafted. A cost rising for good (a longer context) is still
    followed: a round may move p up by the weight times half of p."""
    if old is not None:
        new = min(new, PLAIN_CEILING * old)
    return ewma(old, new, weight)


@dataclass
class Level:
    """Every request's evidence at one load level, for one sampling kind."""

    plain_s: float | None = None  # a round's cost when it drafted nothing (EWMA)
    plain_work_s: float | None = None  # and its work: the request's share of passes and its Python (EWMA)
    since_plain: int = 0  # rounds here since the last plain one
    stale: bool = False  # a calibration round is due or under way: p has not been measured for CALIBRATE rounds
    gains: dict[str, Gain] = field(default_factory=lambda: {s: Gain() for s in SOURCES})
    catch_up_s: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(SOURCES))  # per token behind
    interval: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, DEFAULTS.probe_min))
    explore_every: int = EXPLORE_EVERY  # one request in this many admitted here while it is dry explores
    until_explore: int = EXPLORE_EVERY  # dry admissions left before the next explorer


class FloorModel:
    """What every request's floor consults and feeds: plain rounds' cost and every request's drafting
    rounds, by API key (a request learns only from its own key's: invariant 8, neither content nor
    timing crosses tenants), load level and sampling kind; and the load itself (target rounds in
    flight, the machine's). The least recently used keys' evidence goes past SCOPES keys."""

    SCOPES = 1024

    def __init__(self, settings: FloorSettings = DEFAULTS) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._levels: OrderedDict[str, dict[tuple[bool, int], Level]] = OrderedDict()
        self._in_round: weakref.WeakSet[Any] = weakref.WeakSet()  # a request that dies mid-round leaves
        self._load = 1.0
        # per key and sampling kind while some source has no round at any level: [admissions crowded by
        # other rounds left before the next explorer, the gap after it] (`admit`)
        self._dark: dict[tuple[str, bool], list[int]] = {}

    def level(self) -> int:
        """The load level: log2 of the target rounds in flight (smoothed), rounded."""
        return max(0, round(math.log2(max(self._load, 1.0))))

    def in_flight(self) -> float:
        """Target rounds in flight (smoothed, at least 1): the requests a round's extra work delays."""
        return max(1.0, self._load)

    def at(self, greedy: bool, level: int, scope: str = "") -> Level:
        with self._lock:
            levels = self._levels.get(scope)
            if levels is None:
                levels = self._levels[scope] = {}
                while len(self._levels) > self.SCOPES:
                    gone, _ = self._levels.popitem(last=False)
                    self._dark.pop((gone, True), None)
                    self._dark.pop((gone, False), None)
            else:
                self._levels.move_to_end(scope)
            found = levels.get((greedy, level))
            if found is None:
                found = levels[(greedy, level)] = Level(interval=dict.fromkeys(SOURCES, self.settings.probe_min))
            return found

    def started(self, floor: Any) -> None:
        with self._lock:
            self._in_round.add(floor)
            self._load += LOAD_SMOOTHING * (len(self._in_round) - self._load)

    def ended(self, floor: Any) -> None:
        with self._lock:
            self._in_round.discard(floor)

    def crowded(self) -> bool:
        """Whether a round begun now shares the machine: a load level above 0, or another round in flight
        (the level lags a burst: 4 of a 64-stream burst were admitted at level 0)."""
        with self._lock:
            return self._crowded(self.level(), len(self._in_round) - 1)

    @staticmethod
    def _crowded(level: int, others: int) -> bool:
        return level > 0 or others > 0

    def evidence(self, greedy: bool, level: int, source: str, scope: str = "") -> Gain | None:
        """Every request's rounds of `source` at `level`, or where none were measured there the nearest lower
        level's that has some; None where none has any. Drafting gains less the more rounds share the passes,
        so a loss at a lower load is a loss here, and a higher level's says nothing about this one: lent down,
        the 64-stream warm-up's losing rounds rested every request at 4 and 16 streams for the whole level
        (`bench load --concurrency 1,4,16,64`, the family's prompts, greedy: 0% of rounds drafted, 0.97 /
        0.95x plain, where with the warm-up at 16 streams 19% drafted, 1.08x), and resting rounds measure
        nothing that would end it. Level 0 (a request alone) and the levels under load lend each other
        nothing: drafting gains most alone and loses most under load. After a burst the levels under load kept
        lone requests from drafting (the family's prompts at T = 0.7, one stream after 16: 0-14% of rounds
        drafted and 1.00x plain, against 33-37% and 1.09x); the family's greedy prompts ran 1.51 / 1.00x plain
        at 1 / 16 streams with level 0 lending to the levels under load, 1.57 / 1.02x without."""
        with self._lock:
            return self._nearest(self._levels.get(scope, {}), greedy, level, source)

    @staticmethod
    def _nearest(levels: dict[tuple[bool, int], Level], greedy: bool, level: int, source: str) -> Gain | None:
        measured = [
            n
            for (g, n), here in levels.items()
            if g == greedy and here.gains[source].rounds > 0 and (level > 0) == (n > 0) and n <= level
        ]
        return levels[(greedy, max(measured))].gains[source] if measured else None

    def admit(self, greedy: bool, scope: str = "") -> Admission:
        """How a request admitted now starts: FLOOR, as every request did; REST, plain from its first round (a
        `RestingFloor`), where at the load level and sampling kind it starts in every source loses: its ratio
        over every request's rounds is below 1, with REST_EVIDENCE rounds of it behind that (alone
        REST_EVIDENCE_ALONE; under load one source's carries the other's thinner or borrowed evidence), or with
        its probes failed until they come as seldom as they may (probe_max). There a request's floor would draft
        nothing and only cost its rounds its bookkeeping: at 64 streams at T = 1 a floor's round took 46 + 16 us
        against a resting one's 11-13 + 4, of the ~690 us a token the server had (2-core host). Its ratio, not
        its probes' interval: a lookup probe that paid on a rare match halved the interval, and while it climbed
        back most requests were admitted to the floor (366 of 634 in one run) at a level where the lookup lost.
        EXPLORE, one request in EXPLORE_EVERY there (fewer while probes fail there: `probed`): the floor, its
        probes due from probe_min on rather than the level's interval, so that a level where drafting pays again
        finds out (its paying rounds raise the level's ratio, and the rest ends). Beside other rounds, where a
        source has no round measured at any level (a burst into a new server): FLOOR, but EXPLORE for the first
        such admission and then after gaps doubling from EXPLORE_EVERY to EXPLORE_RARELY (explorers alone let
        such a source read their context: GoodputFloor._untried; with one in four at each level, 14 of a
        64-stream burst read their prompts)."""
        level = self.level()
        here = self.at(greedy, level, scope)
        with self._lock:
            # every request's rounds of each source here, else at the nearest lower level that has some
            gains = {source: self._nearest(self._levels[scope], greedy, level, source) for source in SOURCES}
            if self._crowded(level, len(self._in_round)) and None in gains.values():
                dark = self._dark.setdefault((scope, greedy), [1, EXPLORE_EVERY])
                dark[0] -= 1
                if dark[0] > 0:
                    return FLOOR
                dark[0], dark[1] = dark[1], min(EXPLORE_RARELY, 2 * dark[1])
                return EXPLORE
            if here.plain_s is None:
                return FLOOR
            evidence = REST_EVIDENCE if level > 0 else REST_EVIDENCE_ALONE
            thin = 0  # sources losing on fewer rounds than that (or on a lower level's)
            for source, gain in gains.items():
                if gain is None or gain.not_losing():
                    return FLOOR
                if gain.rounds < evidence and here.interval[source] < self.settings.probe_max:
                    thin += 1
            # Under load one source's full evidence may carry the other's thin one: a source that is off gains
            # rounds only from probes, and at 64 streams at T = 1 the model never had 4 at its level, so every
            # request there ran the floor (~45 us a round more than resting) while the lookup lost on 62 rounds.
            if thin and (level == 0 or thin == len(SOURCES)):
                return FLOOR
            here.until_explore -= 1
            if here.until_explore > 0:
                return REST
            here.until_explore = here.explore_every
            return EXPLORE

    def calibrating(self, here: Level) -> bool:
        """Whether this round at `here` must draft nothing: no plain round measured there, or none lately."""
        with self._lock:
            if here.plain_s is not None and here.since_plain < CALIBRATE:
                here.since_plain += 1
                return False
            here.since_plain = 0  # this round is the calibration: the others go on drafting meanwhile
            here.stale = here.plain_s is not None
            return True

    def plain(self, here: Level, cost: float, work: float) -> None:
        """A plain round's cost and work at `here`. After CALIBRATE rounds without one (every request
        drafting), a cost below p counts STALE_WEIGHT: p from before that stretch may be the
        machine's of then (here, the server's first plain rounds). At one stream at T = 1 p stayed at the 6.5 ms
        of the server's first plain rounds while plain rounds cost 4.3 ms, each calibration moving it a
        tenth of the way (6.49, 6.27, 6.06, 5.91 over ~500 rounds), and model rounds losing (1.8 tokens
        in 8.4 ms) read as paying. Only downwards: a p too low makes drafting look dearer, the safe side."""
        with self._lock:
            here.since_plain = 0
            stale, here.stale = here.stale, False
            weight = STALE_WEIGHT if stale and here.plain_s is not None and cost < here.plain_s else SMOOTHING
            here.plain_s = plain_ewma(here.plain_s, cost, weight)
            here.plain_work_s = plain_ewma(here.plain_work_s, work, weight)

    def drafted(self, here: Level, source: str, earned: float, cost: float) -> None:
        with self._lock:
            here.gains[source].add(earned, cost, POPULATION_DECAY)

    def caught_up(self, here: Level, source: str, per_token: float) -> None:
        with self._lock:
            here.catch_up_s[source] = ewma(here.catch_up_s[source], per_token)

    def probed(self, here: Level, source: str, paid: bool) -> None:
        """A probe of `source` at `here` paid or did not: the level's probe interval and how often a request
        admitted while it is dry explores (EXPLORE_EVERY, doubled a failed probe up to EXPLORE_RARELY)."""
        with self._lock:
            step = here.interval[source] // 2 if paid else here.interval[source] * 2
            here.interval[source] = min(self.settings.probe_max, max(self.settings.probe_min, step))
            here.explore_every = EXPLORE_EVERY if paid else min(EXPLORE_RARELY, 2 * here.explore_every)
            here.until_explore = min(here.until_explore, here.explore_every)
