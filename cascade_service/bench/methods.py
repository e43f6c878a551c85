"""Benchmark methods: strings like `csd:base+mag` become runner objects here, once, against a config.

A `Method` is what the user named; its `variants` are the runners actually timed (one, or one per k
of an SD sweep, of which the fastest is reported). Every runner is exact: greedy, each must reproduce
`hf-ar`'s tokens; sampled (`Sampling.temperature` > 0), each draws from the target's distribution, so
only speeds and counters compare. `ar` (the target alone through our engine: plain decoding at the
same load) runs beside every method, and each is reported against it as well as against `hf-ar`.
`default` is the config's cascade as `generate` and the service run it: under the floor that turns
drafting off where it does not pay (engine.policies.floor); the other cascade methods run their K-matrix as
configured, every round (a fixed configuration).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from ..config import CascadeConfig, ConfigError, GenerationConfig, StatisticalConfig, SuffixConfig, make_cascade
from ..core.schedule import FILLS
from ..core.stats import CascadeStats, ReviewCounters
from ..zoo.baselines import HFRun, hf_assisted, hf_greedy, hf_prompt_lookup, hf_sampled
from .zoo import Zoo

REFERENCE = "hf-ar"
PLAIN = "ar"  # plain decoding through our engine: what every method is judged against at the same load
DEFAULT = "default"  # the config's cascade under the default controller (the floor)
OFF = "off"  # the config's cascade with speculation off: what a round without drafts costs it
USAGE = (
    "hf-ar, ar, default, off, hf-prompt-lookup, suffix, hf-assisted:<tier>, sd:<tier>, "
    "csd:<tier>+<tier>+...[@entry|@total]"
)


@dataclass(frozen=True)
class Sampling:
    """How a run samples: temperature 0 is greedy; `seed` makes a sampled run reproducible."""

    temperature: float = 0.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()
# `suffix`: suffix decoding alone, as vLLM runs it: the target reviews its drafts directly, up to this
# many a round (the drafter's own rule, factor x match length, usually stops it sooner).
SUFFIX_MAX_TOKENS = 32


@dataclass
class Outcome:
    """One generation's tokens and counters, the same figures for our engine and for transformers."""

    token_ids: list[int]
    target_calls: int
    drafter_calls: dict[str, int]  # tier -> forward passes (MaG: proposals)
    # reviewer tier -> (accepted_by_position, drafted_by_position); empty for transformers' methods
    reviews: dict[str, tuple[list[int], list[int]]]
    # tier -> {"calls", "drafted", "accepted"} (CascadeStats.per_tier); empty for transformers' methods
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    # reviewer tier -> its counters, for how its K-matrix row ran (ReviewCounters.row); ours only
    rows: dict[str, ReviewCounters] = field(default_factory=dict)
    orchestration_s: float = 0.0  # the engine loop's time outside model passes (ours only)
    drafted_rounds: int = 0  # target rounds whose block held a draft (ours only; CascadeStats.drafted_rounds)
    # When the first output arrived (seconds from the call) and how many tokens came with it: the time to
    # first token is the prompt's read (prefill, or a prefix-cache hit), the rest is decoding.
    first_token_s: float = 0.0
    first_tokens: int = 0


class Runner(Protocol):
    @property
    def label(self) -> str:
        """Unique among all runners of a bench, e.g. "sd:close@k=3"."""
        ...

    def run(self, zoo: Zoo, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = GREEDY) -> Outcome:
        """Decode `prompt_ids` (at most max_new_tokens new tokens), greedy unless `sampling` says."""
        ...

    def describe(self) -> dict:
        """What exactly ran (drafters, schedule, ...), for results.json."""
        ...


@dataclass(frozen=True)
class Method:
    name: str  # as written on the command line
    variants: tuple[Runner, ...]  # the fastest one is reported; all are kept
    sweep_k: tuple[int, ...] = ()  # k of each variant for an SD sweep, else empty


@dataclass(frozen=True)
class HFGreedy:
    label: str = REFERENCE

    def run(self, zoo: Zoo, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = GREEDY) -> Outcome:
        if sampling.greedy:
            return _from_hf(hf_greedy(zoo.target, prompt_ids, max_new_tokens, zoo.eos_ids))
        return _from_hf(
            hf_sampled(zoo.target, prompt_ids, max_new_tokens, zoo.eos_ids, sampling.temperature, sampling.seed)
        )

    def describe(self) -> dict:
        return {"kind": "transformers generate, target alone"}


@dataclass(frozen=True)
class HFAssisted:
    label: str
    assistant: str  # drafter tier name

    def run(self, zoo: Zoo, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = GREEDY) -> Outcome:
        assistant = zoo.transformers_model(self.assistant)  # the baseline as transformers runs it
        return _from_hf(hf_assisted(zoo.target, assistant, prompt_ids, max_new_tokens, zoo.eos_ids))

    def describe(self) -> dict:
        return {"kind": "transformers assisted generation, greedy, default schedule", "assistant": self.assistant}


@dataclass(frozen=True)
class HFPromptLookup:
    label: str = "hf-prompt-lookup"

    def run(self, zoo: Zoo, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = GREEDY) -> Outcome:
        return _from_hf(hf_prompt_lookup(zoo.target, prompt_ids, max_new_tokens, zoo.eos_ids))

    def describe(self) -> dict:
        return {"kind": "transformers prompt lookup decoding, greedy, prompt_lookup_num_tokens=10"}


@dataclass(frozen=True)
class EngineRunner:
    """Our engine over a subset of the config's drafters with its own schedule: every round as the
    K-matrix says ("fixed"), or under the default controller ("auto": the floor)."""

    label: str
    cascade: CascadeConfig
    speculation: str = "fixed"

    def run(self, zoo: Zoo, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = GREEDY) -> Outcome:
        gen = GenerationConfig(
            max_new_tokens=max_new_tokens,
            temperature=sampling.temperature,
            seed=sampling.seed,
            speculation=self.speculation,
        )
        stats = CascadeStats(self.cascade.target.name)  # filled in by the stream at its end
        tokens: list[int] = []
        first_token_s, first_tokens = 0.0, 0
        began = time.perf_counter()
        for chunk in zoo.engine(self.cascade).stream(prompt_ids, gen, stats):
            if not tokens:
                first_token_s, first_tokens = time.perf_counter() - began, len(chunk)
            tokens += chunk
        return replace(_from_stats(tokens, stats), first_token_s=first_token_s, first_tokens=first_tokens)

    def describe(self) -> dict:
        return {
            "kind": "cascade-service engine",
            "speculation": self.speculation,
            "drafters": [d.name for d in self.cascade.drafters],
            "k_matrix": self.cascade.schedule.to_lists(),
            "leniency": self.cascade.leniency,
            "lookup": None if self.cascade.lookup is None else vars(self.cascade.lookup),
        }


def _from_hf(run: HFRun) -> Outcome:
    return Outcome(
        run.token_ids,
        run.target_calls,
        dict(run.drafter_calls),
        {},
        first_token_s=run.first_token_s,
        first_tokens=run.first_tokens,
    )


def _from_stats(token_ids: list[int], stats: CascadeStats) -> Outcome:
    drafter_calls = {name: c.calls for name, c in stats.tiers.items() if name != stats.target}
    reviews = {name: (list(r.accepted_by_position), list(r.drafted_by_position)) for name, r in stats.reviews.items()}
    orchestration = stats.engine.orchestration_s() if stats.engine is not None else 0.0
    return Outcome(
        token_ids,
        stats.target_calls,
        drafter_calls,
        reviews,
        stats.per_tier(),
        dict(stats.reviews),
        orchestration,
        stats.drafted_rounds,
    )


def drafted_label(name: str, tiers: dict[str, dict[str, int]]) -> str:
    """The method's label as the counters tell it: `kind:` and only the tiers that drafted in the run.

    A K-matrix entry that never runs, or a drafter the lookup gate always pre-empts, then shows
    in the label instead of being credited (`mag_lookup` is MaG through the gate, `mag` inside the
    K-matrix). Methods without our counters (transformers') keep their name.
    """
    kind, sep, rest = name.partition(":")
    if not sep or not tiers:
        return name
    drafting = [tier for tier, t in tiers.items() if t["drafted"] > 0]  # the target drafts nothing
    fill = rest.partition("@")[2]
    return f"{kind}:{'+'.join(drafting) or 'none'}" + (f"@{fill}" if fill else "")


def parse_methods(
    spec: str, config: CascadeConfig, sd_ks: Sequence[int], tuned: Sequence[CascadeConfig] = (), greedy: bool = True
) -> list[Method]:
    """Parse a comma-separated method list; hf-ar (the reference) and ar (plain decoding through our
    engine, what each method is judged against at the same load) always come first.

    Raises ValueError naming the offending method; sampled (`greedy` False), transformers' assisted
    generation and prompt lookup are refused (their greedy outputs are what they are compared on).
    """
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--methods: give at least one method ({USAGE})")
    methods = [Method(REFERENCE, (HFGreedy(),))]
    for name in dict.fromkeys([PLAIN, *names]):  # de-duplicated, order kept
        if name != REFERENCE:
            if not greedy and name.partition(":")[0] in ("hf-assisted", "hf-prompt-lookup"):
                raise ValueError(f"method {name!r}: runs greedy only; leave it out with --temperature above 0")
            methods.append(_parse_one(name, config, sd_ks, tuned))
    return methods


def _parse_one(name: str, config: CascadeConfig, sd_ks: Sequence[int], tuned: Sequence[CascadeConfig]) -> Method:
    kind, _, arg = name.partition(":")
    if name == PLAIN:
        return Method(name, (EngineRunner(name, _cascade(name, config, (), None, 1.0)),))
    if name == DEFAULT:  # the whole config, its K-matrix, leniency and lookup, as generate runs it
        return Method(name, (EngineRunner(name, config, speculation="auto"),))
    if name == OFF:  # the whole config with speculation off: plain rounds through the cascade's machinery
        return Method(name, (EngineRunner(name, config, speculation="off"),))
    if name == "hf-prompt-lookup":
        return Method(name, (HFPromptLookup(),))
    if name == "suffix":
        # The config's suffix drafter where it has one (its corpus and cache settings); else one at the
        # defaults, as prompt lookup needs no tier: suffix decoding needs no model, so any config can
        # be compared with it.
        tiers = next(((d,) for d in config.drafters if isinstance(d, SuffixConfig)), (SuffixConfig(),))
        return Method(name, (EngineRunner(name, _cascade(name, config, tiers, [[SUFFIX_MAX_TOKENS]], 1.0)),))
    if kind == "hf-assisted" and arg:
        tier = _tiers(name, arg, config)[0]
        if isinstance(tier, StatisticalConfig) or "+" in arg:
            raise ValueError(f"method {name!r}: the assistant must be one model tier of the config")
        return Method(name, (HFAssisted(name, tier.name),))
    if kind == "sd" and arg:
        tiers = _tiers(name, arg, config)
        if len(tiers) != 1:
            raise ValueError(f"method {name!r}: sd takes exactly one drafter tier (use csd: for more)")
        variants = tuple(EngineRunner(f"{name}@k={k}", _cascade(name, config, tiers, [[k]], 1.0)) for k in sd_ks)
        return Method(name, variants, tuple(sd_ks))
    if kind == "csd" and arg:
        # `@total` / `@entry`: the same schedule under another fill (core.schedule.FILLS), side by side
        arg, _, fill = arg.partition("@")
        if fill:
            if fill not in FILLS:
                raise ValueError(f"method {name!r}: @{fill} is not a fill ({', '.join(FILLS)})")
            config = replace(config, schedule=replace(config.schedule, fill=FILLS[fill]))
        tiers = _tiers(name, arg, config)
        names = [t.name for t in tiers]
        # The first --tuned config with exactly these drafters lends its K-matrix, leniency and lookup, then
        # the config itself; else the default schedule. A tuned config comes first: `tune` writes one with
        # the drafters of the config it tuned, and the config's own schedule is what `default` runs.
        source = next((c for c in (*tuned, config) if [d.name for d in c.drafters] == names), None)
        if source is not None:
            cascade = _cascade(name, config, tiers, source.schedule.to_lists(), source.leniency, source.lookup)
        else:
            cascade = _cascade(name, config, tiers, None, 1.0)
        return Method(name, (EngineRunner(name, cascade),))
    raise ValueError(f"unknown method {name!r} (expected {USAGE})")


def _tiers(name: str, arg: str, config: CascadeConfig) -> tuple:
    by_name = {d.name: d for d in config.drafters}
    tiers = []
    for tier in arg.split("+"):
        if tier not in by_name:
            known = ", ".join(by_name) or "none"
            raise ValueError(f"method {name!r}: {tier!r} is not a drafter tier of the config (drafters: {known})")
        tiers.append(by_name[tier])
    return tuple(tiers)


def _cascade(
    name: str, config: CascadeConfig, tiers: Sequence, k_matrix, leniency: float, lookup=None
) -> CascadeConfig:
    try:
        return make_cascade(config.target, list(tiers), k_matrix, leniency, lookup, fill=config.schedule.fill.name)
    except ConfigError as exc:
        raise ValueError(f"method {name!r}: {exc}") from None
