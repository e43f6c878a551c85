"""Every tier of a config loaded once, shared by all benchmark methods."""

from __future__ import annotations

from ..config import CascadeConfig
from ..engine import Engine
from ..models.hf import HFModel


class Zoo:
    """The config's target and drafters, loaded once; engines over any subset of the drafters share them."""

    def __init__(self, cascade: CascadeConfig):
        # One Engine over the whole config loads every tier (and MaG's bigram table) exactly once.
        self._full = Engine(cascade)
        self.target: HFModel = self._full.local_target()
        self.eos_ids: list[int] = sorted(self._full.eos_ids)
        self._drafters = {d.name: d for d in self._full.drafters}  # name -> HFModel | MaGConfig
        self._engines: dict[CascadeConfig, Engine] = {}

    def model(self, name: str) -> HFModel:
        tier = self._drafters[name]
        if not isinstance(tier, HFModel):
            raise ValueError(f"tier {name!r} is not a model")
        return tier

    def engine(self, cascade: CascadeConfig) -> Engine:
        """An Engine for `cascade` (a subset of the config's drafters) over the already-loaded tiers."""
        if cascade not in self._engines:
            names = [d.name for d in cascade.drafters]
            self._engines[cascade] = self._full.variant(
                names, cascade.schedule.to_lists(), cascade.leniency, cascade.lookup
            )
        return self._engines[cascade]

    def encode(self, text: str) -> list[int]:
        return self._full.encode(text)

    def swi_costs(self) -> dict[str, dict[str, float]]:
        """{"params"|"measured": {drafter: cost relative to one target call}}; MaG is absent (cost 0)."""
        return self._full.swi_costs()
