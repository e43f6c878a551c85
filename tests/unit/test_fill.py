"""What the K-matrix says is what runs, block by block (invariant 7).

Each reviewer's blocks are logged as the reviewer saw them (the tiers that contributed each token),
and every positive entry of its row must have contributed to every block that left it room, under
the default fill ("entry"). Blocks leave an entry no room only at the end of the token budget, so
the check is: an entry missing from a block => that block ends where the budget lets it end. The
authors' running total ("total") fails the same check on the overshoot shapes of issue 37 (a
negative control), and the per-entry counters in the stats agree with the log.
"""

from __future__ import annotations

import pytest
import torch

from cascade_service.core.cascade import Lookup, RequestState, build_cascade
from cascade_service.core.decode import decode
from cascade_service.core.local import local_tiers
from cascade_service.core.proposers.mag import BigramTable, MaxGram
from cascade_service.core.sampling import SamplingParams
from cascade_service.core.schedule import Schedule
from cascade_service.core.stats import CascadeStats
from cascade_service.core.tier import ReviewRequest

from ..helpers.toy import ToyScorer

VOCAB = 6
PROMPT = [0, 1, 2, 3, 4, 5, 0, 2, 4]
NAMES = ["base", "small", "mag"]


class Logged:
    """A tier that logs every block it reviews: (reviewer, where the block starts, its origins)."""

    def __init__(self, tier, log: list):
        self.inner, self.log = tier, log
        self.name, self.system = tier.name, tier.system

    def draft(self, request):
        return self.inner.draft(request)

    def review(self, request: ReviewRequest):
        self.log.append((self.name, len(request.context.tokens), list(request.block.origins)))
        return self.inner.review(request)

    def release(self, request):
        self.inner.release(request)


def _family():
    # Drafters that agree with the target often enough to overshoot their quotas (a system returns its
    # kept drafts plus a bonus token), and MaG's bigram table read off the target's own greedy text.
    target = ToyScorer("target", VOCAB, seed=11)
    base = ToyScorer("base", VOCAB, seed=111, base=target, noise=0.5)
    small = ToyScorer("small", VOCAB, seed=211, base=target, noise=0.6)
    text = [0, 1]
    for _ in range(64):
        text.append(int(target.row(text).argmax()))
    return target, base, small, BigramTable.from_tokens(text, VOCAB)


def run(k_matrix, fill: str, max_new: int = 48, lookup=None, temperature: float = 0.0):
    target, base, small, bigram = _family()
    log: list = []
    state = RequestState(SamplingParams(temperature), torch.Generator().manual_seed(7), CascadeStats("target"), VOCAB)
    top, below = local_tiers(VOCAB, target, [base, small, MaxGram(bigram)])
    schedule = Schedule.parse(k_matrix, NAMES, fill=fill)
    system = build_cascade(Logged(top, log), [Logged(t, log) for t in below], schedule, 1.0, state, lookup)
    out = [t for chunk in decode(system, PROMPT, max_new, state) for t in chunk]
    assert len(out) == max_new
    return schedule, log, state.stats


def missing_entries(schedule: Schedule, log: list, max_new: int) -> list[tuple]:
    """Blocks in which a positive entry did not run although the block left it room."""
    reviewers = ["target", *NAMES]
    # The target's block may reach one position before the budget's end (its review adds a token);
    # each reviewer below it one position fewer again (the reviews above it add theirs).
    budget_end = len(PROMPT) + max_new - 1
    missing = []
    for reviewer, start, origins in log:
        if origins and origins[0].endswith("_lookup"):
            continue  # the lookup gate filled this block instead of the row
        r = reviewers.index(reviewer)
        for c, _ in schedule.row(r):
            if NAMES[c] not in origins and start + len(origins) < budget_end - r:
                missing.append((reviewer, NAMES[c], start, origins))
    return missing


SHAPES = {
    # small's system (quota 1) returns 2+ tokens, so MaG's own entry in base's row starves under "total"
    "mag-after-small": [[1, 0, 0], [0, 1, 1], [0, 0, 4]],
    # base's system overshoots its quota of 2, so small's 3 in the target's row starve under "total"
    "small-after-base": [[2, 3, 0], [0, 2, 0], [0, 0, 4]],
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_positive_entry_runs_in_every_block_that_leaves_it_room(shape, temperature):
    schedule, log, _ = run(SHAPES[shape], "entry", temperature=temperature)
    assert missing_entries(schedule, log, 48) == []


@pytest.mark.parametrize("shape", SHAPES)
def test_the_running_total_starves_later_entries_on_the_same_shapes(shape):
    # The negative control: the same check fails under the authors' running total, as issue 37 saw.
    schedule, log, _ = run(SHAPES[shape], "total")
    assert len(missing_entries(schedule, log, 48)) >= 3


@pytest.mark.parametrize("fill", ["entry", "total"])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_row_counters_agree_with_the_blocks_reviewed(shape, fill):
    schedule, log, stats = run(SHAPES[shape], fill)
    reviewers = ["target", *NAMES]
    for reviewer, counters in stats.reviews.items():
        blocks = [origins for name, _, origins in log if name == reviewer]
        row = counters.row()
        assert row["blocks"] == len(blocks)
        for c, _ in schedule.row(reviewers.index(reviewer)):
            drafter = NAMES[c]
            # every call of a drafter here adds a token (systems emit a bonus; MaG's bigram fills)
            assert row["entries"][drafter]["blocks"] == sum(drafter in origins for origins in blocks)
            assert row["entries"][drafter]["tokens"] == sum(origins.count(drafter) for origins in blocks)
            if fill == "entry":
                assert row["entries"][drafter]["share"] == 1.0


def test_blocks_filled_by_the_lookup_gate_are_counted_apart():
    # The prompt repeats, so the gate opens; the row runs in every other block.
    schedule, log, stats = run(SHAPES["small-after-base"], "entry", lookup=Lookup(1, 4))
    gated = [origins for name, _, origins in log if name == "target" and origins and origins[0] == "mag_lookup"]
    assert gated and stats.reviews["target"].gated == len(gated)
    assert missing_entries(schedule, log, 48) == []
    row = stats.reviews["target"].row()
    assert row["entries"]["base"]["blocks"] + row["gated"] + row["entries"]["base"]["ended"] == row["blocks"]


def test_entries_are_ended_only_by_the_budget():
    # A budget of 3 tokens: the first target block has room for 2 drafts, base's overshoot fills it,
    # so small's turn comes after the block ended: counted as ended, not as skipped.
    _, _, stats = run(SHAPES["small-after-base"], "entry", max_new=3)
    entries = stats.reviews["target"].row()["entries"]
    assert entries["small"]["ended"] >= 1
    assert entries["small"]["blocks"] + entries["small"]["ended"] == stats.reviews["target"].reviews
