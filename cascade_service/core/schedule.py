"""The K-matrix: how many tokens each drafter adds to each reviewer's block (paper §1, Algorithm 1).

Convention (one, used everywhere in this project). Tiers are T0 = the target and T1..Tn = the drafters,
largest first; MaG, if present, is Tn. K is n x n non-negative ints:

- row r is used when tier T_r reviews (row 0: the target's review);
- column c is drafter T_{c+1};
- K[r][c] is how many tokens T_{c+1} ADDS to the block T_r reviews: per-drafter increments, not
  cumulative totals. Drafters are called in column order, so bigger drafters take the early positions
  (horizontal cascade);
- below the diagonal (c < r) must be 0: a tier reviews only drafters smaller than itself;
- a reviewer T_r (r >= 1) whose row is all zeros is a leaf and drafts autoregressively alone; Tn has
  no row and is always a leaf, which is why MaG (it cannot review) must be last; with MaG and
  suffix decoding both, they are the last two and the first's row is all zeros.

How a row fills a block (invariant 7), `Schedule.fill`, one of `FILLS`:

- "entry" (the default): every positive entry runs in every block of its row. When T_{c+1}'s turn
  comes it is asked for K[r][c] tokens on top of what the block already holds, and called again until
  it has added them; a system drafter (a reviewer over tiers below) may return more than it was asked
  (its kept tokens plus its bonus token), and the block keeps that overshoot. So K[r][c] > 0 is at
  least one call of T_{c+1}'s system per block of T_r.
- "total" (the authors' csd.py): drafter c runs until the block holds K[r][0] + ... + K[r][c] tokens,
  a running total, so an earlier drafter's overshoot uses up the later entries' quotas and they may
  not run at all in that block.

Under either, an inner reviewer fills its block by its own row whatever its parent still needs, and
only the token budget (max_new_tokens) or an EOS cuts a block short. The stats count, per reviewer,
the blocks in which each entry ran (core.stats.ReviewCounters.ran_by_drafter). A K-matrix with an
entry that can never run -- below the diagonal, or in the row of a tier no reachable row calls -- is
refused, and the message names the entry and the tiers.

Worked example, drafters (base, small, mag) with the authors' FLAN-T5 config [repo]:

    K = [[5, 14, 10],    target reviews 5 tokens from base, then 14 from small, then 10 from mag
         [0,  1, 10],    base reviews 1 token from small, then 10 from mag
         [0,  0, 10]]    small reviews 10 tokens from mag

Each target block thus holds 29 drafted tokens. The paper's cumulative step limits map as
K = [[k11, k12 - k11, ·], [0, k21, ·], ...]; the authors' code already used increments and gave MaG 10
in every row. LLaMA-7B with (llama-160m, mag): [[13, 10], [0, 10]]. Plain SD with one drafter: [[k]].
No drafters at all: K = [] (plain autoregressive decoding).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .limits import is_integer

MAX_ENTRY = 256  # a block longer than this would never be accepted whole; it only wastes compute
LEAF_ONLY = ("mag", "suffix")  # statistical drafters: they draft, never review


class ScheduleError(ValueError):
    """A K-matrix that does not fit the drafters, with the reason spelled out."""


class PerEntry:
    """Each positive entry adds its own quota to the block, whatever came before it ("entry")."""

    name = "entry"

    def goal(self, held: int, previous_goal: int, quota: int) -> int:
        return held + quota


class RunningTotal:
    """The authors' csd.py: each drafter fills the block up to the row's running total ("total")."""

    name = "total"

    def goal(self, held: int, previous_goal: int, quota: int) -> int:
        return previous_goal + quota


Fill = PerEntry | RunningTotal
FILLS: dict[str, Fill] = {f.name: f for f in (PerEntry(), RunningTotal())}


@dataclass(frozen=True)
class Schedule:
    """A validated K-matrix over named drafters; build it with `parse`, `from_json` or `default`."""

    drafters: tuple[str, ...]
    k: tuple[tuple[int, ...], ...]
    fill: Fill = FILLS["entry"]  # how a row's entries fill a block (the module's docstring)

    def __post_init__(self) -> None:
        drafters = tuple(self.drafters)
        _check_names(drafters)
        k = _normalize(self.k, drafters)
        _check_diagonal(k, drafters)
        _check_reachable(k, drafters)
        # Frozen, yet the stored form must be the normalized one (tuples of plain ints).
        object.__setattr__(self, "drafters", drafters)
        object.__setattr__(self, "k", k)

    @classmethod
    def parse(
        cls, k_matrix: object, drafters: Sequence[str], leaf_only: Collection[str] = LEAF_ONLY, fill: str = "entry"
    ) -> Schedule:
        """Validate `k_matrix` against `drafters` (largest first), raising ScheduleError."""
        drafters = tuple(drafters)
        _check_leaf_only(drafters, leaf_only)
        if not isinstance(fill, str) or fill not in FILLS:
            raise ScheduleError(f"fill must be one of {', '.join(FILLS)}, got {fill!r}")
        schedule = cls(drafters, k_matrix, FILLS[fill])  # type: ignore[arg-type]
        for r, d in enumerate(drafters[:-1], start=1):
            if d in leaf_only and any(schedule.k[r]):
                raise ScheduleError(f"{d!r} cannot review: its row K[{r}] must be all zeros")
        return schedule

    @classmethod
    def from_json(
        cls, text: str, drafters: Sequence[str], leaf_only: Collection[str] = LEAF_ONLY, fill: str = "entry"
    ) -> Schedule:
        """Parse a K-matrix written as JSON, e.g. "[[5, 14, 10], [0, 1, 10], [0, 0, 10]]"."""
        try:
            k_matrix = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScheduleError(f"K-matrix is not valid JSON: {e}") from None
        return cls.parse(k_matrix, drafters, leaf_only, fill)

    @classmethod
    def default(cls, drafters: Sequence[str], leaf_only: Collection[str] = LEAF_ONLY, fill: str = "entry") -> Schedule:
        """A plain vertical cascade: each tier reviews only the next one, 5 tokens (10 from MaG, the paper's figure)."""
        n = len(drafters)
        # MaG proposes for free, so a longer block from it costs nothing but target compute.
        diag = [10 if d in leaf_only else 5 for d in drafters]
        k = [[diag[c] if r == c else 0 for c in range(n)] for r in range(n)]
        return cls.parse(k, drafters, leaf_only, fill)

    @property
    def n(self) -> int:
        return len(self.drafters)

    def row(self, r: int) -> list[tuple[int, int]]:
        """(column, quota) pairs with quota > 0 for reviewer T_r, in the order the drafters run."""
        return [(c, q) for c, q in enumerate(self._row(r)) if q > 0]

    def is_leaf(self, r: int) -> bool:
        """Whether drafter tier T_r (1..n) drafts autoregressively instead of reviewing."""
        if not 1 <= r <= self.n:
            raise IndexError(f"drafter tier must be in 1..{self.n}, got {r}")
        return r == self.n or not any(self.k[r])

    def block_size(self, r: int) -> int:
        """How many drafted tokens reviewer T_r checks per review."""
        return sum(self._row(r))

    def to_lists(self) -> list[list[int]]:
        """The matrix as plain lists, e.g. for JSON."""
        return [list(row) for row in self.k]

    def _row(self, r: int) -> tuple[int, ...]:
        if not 0 <= r < self.n:
            raise IndexError(f"reviewer row must be in 0..{self.n - 1}, got {r}")
        return self.k[r]


def _tier(r: int, drafters: tuple[str, ...]) -> str:
    return "target" if r == 0 else drafters[r - 1]


def _check_names(drafters: tuple[str, ...]) -> None:
    for d in drafters:
        if not isinstance(d, str) or not d:
            raise ScheduleError(f"drafter names must be non-empty strings, got {d!r}")
        if (times := drafters.count(d)) > 1:
            raise ScheduleError(f"drafter names must be unique: {d!r} appears {times} times")


def _check_leaf_only(drafters: tuple[str, ...], leaf_only: Collection[str]) -> None:
    # Drafters that cannot review (MaG, suffix decoding) come last, after every model drafter; when
    # there are two, the first has a row, which must be all zeros (Schedule.parse).
    for i, d in enumerate(drafters[:-1]):
        if d in leaf_only and any(later not in leaf_only for later in drafters[i + 1 :]):
            raise ScheduleError(f"{d!r} cannot review: it must be the last drafter (or among the last, with MaG)")


def _normalize(k_matrix: object, drafters: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    n = len(drafters)
    names = ", ".join(drafters)
    if not isinstance(k_matrix, (list, tuple)):
        raise ScheduleError(f"K-matrix must be a list of lists, got {type(k_matrix).__name__}")
    if len(k_matrix) != n:
        raise ScheduleError(f"K-matrix must have {n} rows, one per drafter ({names}); got {len(k_matrix)}")
    rows = []
    for r, row in enumerate(k_matrix):
        if not isinstance(row, (list, tuple)):
            raise ScheduleError(f"K-matrix must be a list of lists: row {r} is {type(row).__name__}")
        if len(row) != n:
            raise ScheduleError(f"row {r} must have {n} entries, one per drafter ({names}); got {len(row)}")
        rows.append(tuple(_entry(v, r, c) for c, v in enumerate(row)))
    return tuple(rows)


def _entry(value: object, r: int, c: int) -> int:
    # bool is an int subclass, but `true` in a config is a mistake, not a 1.
    ok = (type(value) is int) or (isinstance(value, float) and value.is_integer())
    if not ok or value < 0:  # type: ignore[operator]
        raise ScheduleError(f"K[{r}][{c}] must be a non-negative integer, got {value!r}")
    if value > MAX_ENTRY:  # type: ignore[operator]
        raise ScheduleError(f"K[{r}][{c}] = {value!r} exceeds {MAX_ENTRY}")
    return int(value)  # type: ignore[call-overload]


def _check_diagonal(k: tuple[tuple[int, ...], ...], drafters: tuple[str, ...]) -> None:
    for r, row in enumerate(k):
        for c in range(r):
            if row[c]:
                raise ScheduleError(
                    f"K[{r}][{c}] = {row[c]} is below the diagonal: "
                    f"tier {_tier(r, drafters)!r} cannot review {drafters[c]!r}"
                )


def _check_reachable(k: tuple[tuple[int, ...], ...], drafters: tuple[str, ...]) -> None:
    if not k:
        return
    if not any(k[0]):
        raise ScheduleError("row 0 (target) is all zeros: no drafter is used")
    # Rows only point right (upper triangular), so one left-to-right pass settles reachability.
    used = [False] * len(drafters)
    for r, row in enumerate(k):
        if r == 0 or used[r - 1]:
            for c, q in enumerate(row):
                used[c] = used[c] or q > 0
    for c, d in enumerate(drafters):
        if not used[c]:
            # Name the first entry that would never run: the dead tier's own row, if it has one.
            row = k[c + 1] if c + 1 < len(k) else ()
            dead = next(
                (
                    f"; so K[{c + 1}][{j}] = {q} ({d!r} reviewing {drafters[j]!r}) can never run"
                    for j, q in enumerate(row)
                    if q
                ),
                "",
            )
            raise ScheduleError(
                f"drafter {d!r} is never used: no reachable row gives it tokens "
                f"(column {c} is 0 in every row that runs){dead}"
            )


@dataclass(frozen=True)
class Lookup:
    """MaG-first drafting at the target (ours, not in the paper): the gate of a dynamic horizontal cascade.

    When the sequence's last `min_match` or more tokens occurred earlier, MaG's continuation of that
    occurrence (at most `tokens` of it) is the target's whole block and the model drafters rest; on
    no such match the K-matrix schedule runs as usual. Text that repeats itself (code, quoting, edits,
    a model stuck in a loop) is where a long n-gram match is right almost every time and a model
    drafter's forward passes are wasted; prompt-lookup decoding is this gate without the fallback.
    """

    min_match: int = 2
    tokens: int = 10
    tier: str = "mag"  # the statistical drafter behind the gate: MaG, or suffix decoding ("suffix")

    def __post_init__(self) -> None:
        if not isinstance(self.tier, str) or not self.tier:
            raise ValueError(f"lookup.tier must name a drafter, got {self.tier!r}")
        for name, value in (("min_match", self.min_match), ("tokens", self.tokens)):
            if not is_integer(value) or not 1 <= value <= 256:
                raise ValueError(f"lookup.{name} must be an integer in [1, 256], got {value!r}")
