"""Sub-cascades a tier server runs whole in one call: which group members may (their every tier
below them in the group), and which reviewing tiers with an acceptance head need that."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import MAG, CascadeConfig, ConfigError, ServingConfig
from ..core.schedule import Schedule


@dataclass(frozen=True)
class SubCascade:
    """A group member's sub-cascade, fixed at deployment: `tiers` is the member first, then every tier
    below it ("mag" last if used); `k_matrix` its part of the K-matrix; `leniency` its inner reviews';
    `fill` how its rows fill a block, as the whole cascade's do (core.schedule.FILLS)."""

    tiers: tuple[str, ...]
    k_matrix: tuple[tuple[int, ...], ...]
    leniency: float
    fill: str = "entry"

    def schedule(self) -> Schedule:
        return Schedule.parse([list(row) for row in self.k_matrix], list(self.tiers[1:]), fill=self.fill)


def system_heads(cascade: CascadeConfig, serving: ServingConfig) -> dict[str, SubCascade]:
    """Group members whose whole sub-cascade lies in their group (+ MaG), with that sub-cascade."""
    names = [t.name for t in cascade.tiers]
    k = cascade.schedule.to_lists()
    heads = {}
    for group in serving.groups:
        for name in group:
            h = names.index(name)
            below = set(names[h + 1 :])
            if h == 0 or cascade.schedule.is_leaf(h) or not below <= set(group) | {MAG}:
                continue
            reach, todo = set(), [h]
            while todo:  # every tier the sub-cascade reaches from h
                r = todo.pop()
                for c, _ in cascade.schedule.row(r) if r < len(k) else []:
                    if c + 1 not in reach:
                        reach.add(c + 1)
                        todo.append(c + 1)
            if {names[i] for i in reach} == below:
                rows = tuple(tuple(row[h:]) for row in k[h:])
                heads[name] = SubCascade(tuple(names[h:]), rows, cascade.leniency, cascade.schedule.fill.name)
    return heads


def check_adaptive_reviewers(cascade: CascadeConfig, serving: ServingConfig) -> None:
    """SpecDec++ at a reviewing tier reads that tier's hidden states, so its review must run where the
    cascade above it runs: colocated with the coordinator, or with its whole sub-cascade in its group."""
    names = [t.name for t in cascade.tiers]
    systems = system_heads(cascade, serving)
    for tier in cascade.adaptive:
        r = names.index(tier)
        if not cascade.schedule.is_leaf(r) and tier not in serving.colocate and tier not in systems:
            raise ConfigError(
                f"schedule.adaptive.{tier}: a reviewing tier with an acceptance head must be in "
                "serving.colocate, or in a serving.groups group that holds its whole sub-cascade"
            )
