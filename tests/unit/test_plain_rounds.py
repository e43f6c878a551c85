"""A round its policy lets nothing draft in (most rounds at T = 1, every round of a request the floor
rests) goes straight to the target's review: no drafter is asked, the policy is asked what the full
path asks and `drafted` is not called, and the round's figures are the ones the full path records
for an empty block (core.cascade.CascadeTier._block)."""

from __future__ import annotations

import torch

from cascade_service.core.cascade import Lookup, RequestState, build_cascade
from cascade_service.core.decode import decode
from cascade_service.core.local import local_tiers
from cascade_service.core.proposers.mag import BigramTable, MaxGram
from cascade_service.core.sampling import SamplingParams
from cascade_service.core.schedule import Schedule
from cascade_service.core.stats import CascadeStats

from ..helpers.toy_cascade import PROMPT, VOCAB, toy_tiers

NAMES = ["base", "small", "mag"]
K_MATRIX = [[1, 1, 2], [0, 1, 2], [0, 0, 2]]
MAX_NEW = 10


class Logged:
    """A block policy that logs each call. `allow`: what `allows` answers; `cap`: what `cap` returns
    (None: the ceiling)."""

    def __init__(self, allow: bool, cap: int | None = None):
        self.allow, self.capped = allow, cap
        self.log: list[tuple] = []

    def begin(self, committed: int = 0, remaining: int = 0) -> None:
        self.log.append(("begin",))

    def allows(self, source: str) -> bool:
        self.log.append(("allows", source))
        return self.allow

    def cap(self, source: str, offered: int, ceiling: int) -> int:
        self.log.append(("cap", source))
        return ceiling if self.capped is None else self.capped

    def drafted(self) -> None:
        self.log.append(("drafted",))

    def observe(self, drafted: int, accepted: int) -> None:
        self.log.append(("observe", drafted, accepted))


def run(policy: Logged, lookup: Lookup | None = None, temperature: float = 0.0) -> tuple[list[int], CascadeStats]:
    target, base, small = toy_tiers()
    bigram = BigramTable.from_tokens([0, 1, 2, 3, 0, 2, 1, 3, 3, 1], VOCAB)
    stats = CascadeStats("target")
    state = RequestState(SamplingParams(temperature), torch.Generator().manual_seed(3), stats, VOCAB, policy=policy)
    top, below = local_tiers(VOCAB, target, [base, small, MaxGram(bigram)])
    system = build_cascade(top, below, Schedule.parse(K_MATRIX, NAMES), 1.0, state, lookup)
    return [t for chunk in decode(system, PROMPT, MAX_NEW, state) for t in chunk], stats


def target_greedy() -> list[int]:
    target, _, _ = toy_tiers()
    tokens = list(PROMPT)
    for _ in range(MAX_NEW):
        tokens.append(int(target.row(tokens).argmax()))
    return tokens[len(PROMPT) :]


def test_a_round_nothing_may_draft_in_asks_no_drafter():
    policy = Logged(allow=False)
    out, stats = run(policy, Lookup(min_match=1, tokens=4))
    assert out == target_greedy()
    rounds = [("begin",), ("allows", "lookup"), ("allows", "model"), ("observe", 0, 0)]
    last = [("begin",), ("observe", 0, 0)]  # no room for a draft in the last token's round: nothing to ask
    assert policy.log == rounds * (MAX_NEW - 1) + last  # one token a round; neither cap nor drafted
    assert stats.target_calls == MAX_NEW
    assert not any(stats.tier(name).calls for name in NAMES)  # no drafter ran, not even MaG's lookup


def test_without_a_lookup_gate_only_the_row_is_asked():
    policy = Logged(allow=False)
    run(policy)
    assert ("allows", "lookup") not in policy.log  # the full path never asks for a gate there is none of
    assert policy.log.count(("allows", "model")) == MAX_NEW - 1


def test_it_records_what_the_full_path_records_for_an_empty_block():
    # Allowed but capped to nothing, a round takes the full path and ends with an empty block too.
    quick, full = Logged(allow=False), Logged(allow=True, cap=0)
    for temperature in (0.0, 1.0):
        out_quick, stats_quick = run(quick, temperature=temperature)
        out_full, stats_full = run(full, temperature=temperature)
        assert out_quick == out_full  # the same seeds drawn, so sampled outputs agree too
        assert stats_quick.reviews["target"] == stats_full.reviews["target"]
        assert stats_quick.reviews["target"].ended_by_drafter == {"base": MAX_NEW, "small": MAX_NEW, "mag": MAX_NEW}
    assert ("drafted",) in full.log and ("drafted",) not in quick.log
