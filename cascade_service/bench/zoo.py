"""Every tier of a config loaded once, shared by all benchmark methods."""

from __future__ import annotations

from ..config import CascadeConfig, ModelTierConfig, StatisticalConfig
from ..engine.core import EngineCore
from ..inprocess import InProcess
from ..models.hf import HFModel


class Zoo:
    """The config's target and drafters, loaded once; engines over any subset of the drafters share them."""

    def __init__(self, cascade: CascadeConfig, core: EngineCore | None = None):
        # One InProcess over the whole config loads every tier (and MaG's bigram table) exactly once, by
        # `core` (the process's engine core: a new one when None).
        self._full = InProcess(cascade, core=core)
        self._cascade = cascade
        self._plain: dict[str, HFModel] = {}  # drafters on another backend, on transformers (transformers_model)
        self.target: HFModel = self._full.local_target()
        self.eos_ids: list[int] = sorted(self._full.eos_ids)
        self._drafters = {d.name: d for d in self._full.drafters}  # name -> HFModel | MaGConfig
        self._engines: dict[CascadeConfig, InProcess] = {}

    def model(self, name: str) -> HFModel:
        tier = self._drafters[name]
        if not isinstance(tier, HFModel):
            raise ValueError(f"tier {name!r} is not a model")
        return tier

    def engine(self, cascade: CascadeConfig) -> InProcess:
        """An InProcess for `cascade` (a subset of the config's drafters) over the already-loaded tiers."""
        if cascade not in self._engines:
            # a drafter the config lacks (bench methods' `suffix` at its defaults) goes as its settings
            tiers: list[str | StatisticalConfig] = [
                d if isinstance(d, StatisticalConfig) and d.name not in self._drafters else d.name
                for d in cascade.drafters
            ]
            self._engines[cascade] = self._full.variant(
                tiers, cascade.schedule.to_lists(), cascade.leniency, cascade.lookup, fill=cascade.schedule.fill.name
            )
        return self._engines[cascade]

    def forget(self) -> None:
        """Empty every engine's suffix cache of earlier requests: a benchmark's next repeat of the same
        prompts must not find their own outputs there (that would measure memory, not drafting)."""
        for engine in (self._full, *self._engines.values()):
            engine.leaves.forget()

    def encode(self, text: str) -> list[int]:
        return self._full.encode(text)

    def transformers_model(self, name: str) -> HFModel:
        """Tier `name` on transformers' own forward: itself, or for a drafter on another backend
        (models.lean) the same weights loaded again, once. Baselines built on transformers
        (assisted generation) run this, never a rewrite of ours."""
        model = self.model(name)
        tier = next(d for d in self._cascade.drafters if d.name == name)
        if not isinstance(tier, ModelTierConfig) or tier.backend == "hf":
            return model
        if name not in self._plain:
            self._plain[name] = self._full.core.model(tier, backend="hf")
        return self._plain[name]

    def tier_costs(self) -> dict[str, dict]:
        """Each model tier's step cost at 1 and 16 rows (bench.costs), with transformers' beside a
        drafter that runs on another backend."""
        from .costs import tier_costs

        models = {name: d for name, d in self._drafters.items() if isinstance(d, HFModel)}
        plain = {name: self.transformers_model(name) for name in models}
        return tier_costs(self.target, models, {n: m for n, m in plain.items() if m is not models[n]})

    def swi_costs(self) -> dict[str, dict[str, float]]:
        """{"params"|"measured": {drafter: cost relative to one target call}}; MaG is absent (cost 0)."""
        return self._full.swi_costs()
