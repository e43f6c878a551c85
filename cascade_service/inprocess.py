"""The in-process wiring: loaded tiers + the core cascade, one fresh cascade per request.

Models are loaded once, by the process's engine core (engine.core), and shared; each request gets
its own scorers (KV caches), MaG index, RNG and counters, so concurrent requests never see each
other's state. A tier the config names by `address`
is not loaded: it is reached on its tier server over gRPC (`transport.client`), and the cascade calls
it through the same `Tier` protocol.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .config import CascadeConfig, GenerationConfig, ServingConfig, StatisticalConfig, TierClientConfig, make_cascade
from .coordinator import Coordinator, Tokenizer
from .core.adaptive import AdaptiveLength, DraftStopper
from .core.cascade import Lookup
from .core.local import ModelTier
from .core.stats import CascadeStats
from .core.tier import Scope, Tier
from .engine.core import EngineCore, queue_of
from .engine.leaves import Leaves
from .engine.policies import build_policies
from .models.detokenize import text_decoder
from .models.hf import HFModel, load_tokenizer
from .runtime.assemble import assemble_coordinator
from .sessions import MemoryStore, SessionStore
from .startup import check_tiers, check_vocabularies
from .tierhost.loopback import loopback
from .transport.client import RemoteModel, connect

Drafter = HFModel | StatisticalConfig | RemoteModel


@dataclass
class Generation:
    token_ids: list[int]
    stats: CascadeStats


class InProcess:
    """The cascade service in this process, without a network: target + drafters loaded from local
    directories (by an engine core), ready to generate. Tests, benchmarks, tuning and the standalone
    server use it; `cascade-service serve` puts the same coordinator behind Ray Serve."""

    def __init__(
        self,
        cascade: CascadeConfig,
        loopback: bool = False,
        tier_client: TierClientConfig | None = None,
        core: EngineCore | None = None,
    ):
        """`loopback`: every tier behind the wire codec (tierhost.loopback), as a remote tier
        would be; tests use it to show that the codec changes no token. `tier_client`: how to reach
        the tiers named by address (the config's serving.tier_client). `core`: the process's engine
        core, which loads the models and runs the requests and passes (a new one when None)."""
        self.cascade = cascade
        self.loopback = loopback
        check_tiers(cascade)  # a device this machine lacks or a foreign vocabulary fails before any weights load
        self.core = core or EngineCore()
        self.loop = self.core.loop  # every request of this engine runs in it, with the models' passes
        self.remote = connect(cascade, tier_client or TierClientConfig())  # asks each tier server what it hosts
        t = cascade.target
        # The tokenizer is read beside the weights: the real family's took 0.9 s of its 4.6-6.3 s load,
        # mostly parsing a 7 MB tokenizer.json while the weights' packing holds no lock.
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as reader:
            tokenizer = reader.submit(load_tokenizer, t.path)
            self.target: HFModel | RemoteModel = self.remote.get(t.name) or self.core.model(t)
            self.drafters: list[Drafter] = []
            for d in cascade.drafters:
                if d.name in self.remote:
                    self.drafters.append(self.remote[d.name])
                elif isinstance(d, StatisticalConfig):
                    self.drafters.append(d)
                else:
                    self.drafters.append(self.core.model(d))
            # Again with the weights' own counts (the LM heads' rows), which config.json may not record.
            check_vocabularies(cascade, {m.name: m.vocab_size for m in self.tiers()}, tokenizers=False)
            self.tokenizer = tokenizer.result()
            self._decode = text_decoder(self.tokenizer)
        # MaG's bigram table, suffix decoding's recent requests and corpus (engine.leaves)
        self.leaves = self.core.leaves(cascade.drafters, self.target.vocab_size, self.encode)
        self.heads = self.core.heads(self.target.device if isinstance(self.target, HFModel) else "cpu")
        self._check_heads(cascade)
        self._own: Coordinator | None = None  # its own requests' coordinator, made when first asked for

    @property
    def _local(self) -> Coordinator:
        """In-process requests (generate, bench, tune) take the serving path: a coordinator, no
        sessions. Made on first use: a server that only serves builds its own coordinator alone."""
        if self._own is None:
            self._own = self.coordinator(MemoryStore(), leaves=self.leaves)
        return self._own

    def serve_like(self, serving: ServingConfig) -> None:
        """This engine's own requests (generate, stream) take the speculation policies a server with
        `serving`'s settings runs: load adaptation and its arms, the floor. By default they run the floor
        over the K-matrix; a comparison with a served config (the demo's in-process side) must run what
        the server runs, or it compares two policies, not two paths."""
        self._own = self.coordinator(
            MemoryStore(),
            adapt_to_load=serving.adapt_to_load,
            arms=serving.load_arms,
            leaves=self.leaves,
            floor=serving.floor,
        )

    def _check_heads(self, cascade: CascadeConfig) -> None:
        """Load every acceptance head now: a missing or mismatched head fails here, not mid-request."""
        models = {d.name: d for d in self.drafters if isinstance(d, HFModel)}
        for tier, spec in cascade.adaptive.items():
            self.heads.stopper(spec, models[tier].config.hidden_size)

    @property
    def eos_ids(self) -> frozenset[int]:
        """The token ids that end a request (the target's); settable, for this engine's own requests."""
        return self._local.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: frozenset[int]) -> None:
        self._local.eos_ids = frozenset(ids)

    def make_stopper(self, spec: AdaptiveLength) -> DraftStopper:
        return self.heads.stopper(spec)

    def variant(
        self,
        drafters: Sequence[str | StatisticalConfig],
        k_matrix: Any = None,
        leniency: float = 1.0,
        lookup: Lookup | None = None,
        adaptive: dict[str, AdaptiveLength] | None = None,
        fill: str | None = None,
    ) -> InProcess:
        """The same loaded models with another drafter subset (by tier name, largest first) and schedule.
        A statistical drafter the config lacks may be given as its settings: it loads nothing.

        Benchmarks and tuning compare many schedules; reloading weights for each would dominate.
        """
        by_name: dict[str, tuple[Any, Any]] = {d.name: (cfg, d) for cfg, d in zip(self.cascade.drafters, self.drafters)}
        for extra in drafters:
            if not isinstance(extra, str):
                by_name.setdefault(extra.name, (extra, extra))
        names = [n if isinstance(n, str) else n.name for n in drafters]
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ValueError(f"unknown drafter {unknown[0]!r}; this config has {sorted(by_name)}")
        cascade = make_cascade(
            self.cascade.target,
            [by_name[n][0] for n in names],
            k_matrix,
            leniency,
            lookup,
            adaptive,
            fill or self.cascade.schedule.fill.name,
        )
        twin: InProcess = copy.copy(self)
        twin.cascade = cascade
        twin.drafters = [by_name[n][1] for n in names]
        # its own requests only, MaG's table and any corpus as loaded once
        twin.leaves = Leaves(cascade.drafters, self.target.vocab_size, self.encode, like=self.leaves)
        twin._check_heads(cascade)
        twin._own = None
        return twin

    def stream(
        self, prompt_ids: Sequence[int], gen: GenerationConfig, stats: CascadeStats | None = None
    ) -> Iterator[list[int]]:
        """Yield committed tokens round by round: the request decodes in the engine loop, through the
        same coordinator path as a served one; `stats` (if given) holds its figures at the end."""
        params = self._local.request(prompt_ids, gen)
        for chunk in self.loop.iterate(lambda: self._local.stream(params)):
            if chunk.stats is not None and stats is not None:
                vars(stats).update(vars(chunk.stats))
            if chunk.token_ids:
                yield chunk.token_ids

    def request_tier(self, model: HFModel | RemoteModel, scope: Scope) -> Tier:
        """One request's tier of a model: its own KV cache here (from its salt's cached prefixes), or
        on the tier server replica its affinity picks (which reads the salt from each call)."""
        if isinstance(model, RemoteModel):
            return model.tier(scope.request_id, scope.affinity)
        return self._wire(ModelTier(model.scorer(scope.cache_salt), model.vocab_size, self.make_stopper))

    def _wire(self, tier: Tier) -> Tier:
        return loopback(tier) if self.loopback else tier

    def generate(self, prompt_ids: Sequence[int], gen: GenerationConfig) -> Generation:
        """One request, decoded in the engine loop by the serving path (the coordinator)."""
        params = self._local.request(prompt_ids, gen)
        chunk = self.loop.run(self._local.generate, params)
        assert chunk.stats is not None
        return Generation(chunk.token_ids, chunk.stats)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def decode_text(self, token_ids: Sequence[int]) -> str:
        return self._decode(token_ids)

    def coordinator(
        self,
        store: SessionStore,
        defaults: GenerationConfig | None = None,
        adapt_to_load: bool = False,
        arms: Sequence[str] | None = None,
        leaves: Leaves | None = None,
        floor: bool = True,
    ) -> Coordinator:
        """A Coordinator over these loaded models (the standalone gRPC server, tests, this engine's own
        requests); its requests run in the engine loop when their front end submits them there.

        adapt_to_load: choose each round's draft budget from measured acceptance and the target's
        batched passes (engine.policies.load). arms: the ways of drafting its trial chooses between
        (engine.policies.trial.ARMS, all of them when None). leaves: the statistical drafters' state to
        share (this engine's own requests share the engine's); a fresh one when None. floor: a
        request's speculation "auto" drafts only while its measured rounds beat plain decoding
        (engine.policies.floor); False: "auto" runs the K-matrix (or load adaptation) as it is.
        """
        models = {model.name: model for model in self.tiers()} | self.remote  # MaG's server too
        timer = None
        if adapt_to_load:
            if not isinstance(self.target, HFModel) or self.target.batcher is None:
                raise ValueError("adapt_to_load needs the target's passes in this process")
            timer = queue_of(self.target).timer
        policies = build_policies(self.cascade.max_block(), adapt_to_load, floor, arms, timer)
        leaves = leaves or self.core.leaves(self.cascade.drafters, self.target.vocab_size, self.encode)
        return assemble_coordinator(
            self.cascade,
            {m.name: m.facts() for m in self.tiers()},
            Tokenizer(self.encode, self.decode_text, self.tokenizer),
            tiers=lambda scope: {name: self.request_tier(m, scope) for name, m in models.items()},
            store=store,
            defaults=defaults or GenerationConfig(),
            leaves=lambda owner, context: {name: self._wire(tier) for name, tier in leaves(owner, context).items()},
            make_stopper=self.make_stopper,
            policies=policies,
            loop=self.loop,
        )

    def local_target(self) -> HFModel:
        """The target's weights in this process; a benchmark that measures them refuses a remote target."""
        if not isinstance(self.target, HFModel):
            raise ValueError(
                f"tiers.target.address: this needs the target's weights in this process, not on {self.target.name!r}'s "
                "tier server"
            )
        return self.target

    def models(self) -> list[HFModel]:
        """The model tiers loaded in this process, target first."""
        return [m for m in (self.target, *self.drafters) if isinstance(m, HFModel)]

    def tiers(self) -> list[HFModel | RemoteModel]:
        """Every tier with a model, here or on a tier server (MaG's server included), target first."""
        return [m for m in (self.target, *self.drafters) if isinstance(m, HFModel | RemoteModel) and not _is_mag(m)]

    def param_costs(self) -> dict[str, float]:
        return {m.name: m.num_parameters / self.target.num_parameters for m in self.drafters if isinstance(m, HFModel)}

    def swi_costs(self) -> dict[str, dict[str, float]]:
        """Drafter costs relative to the target: parameter ratio and measured step-time ratio."""
        models = [d for d in self.drafters if isinstance(d, HFModel)]
        target_step = self.local_target().step_time_s()
        return {
            "params": self.param_costs(),
            "measured": {m.name: m.step_time_s() / target_step for m in models},
        }


def _is_mag(model: HFModel | RemoteModel) -> bool:
    return isinstance(model, RemoteModel) and model.mag
