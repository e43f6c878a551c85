"""Configuration: one tree of frozen, validated objects, loaded here and nowhere else.

Strings become objects once, here (a drafter named "mag" becomes `MaGConfig`, a K-matrix becomes a
`Schedule`); every other module receives only its own slice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from ..core.adaptive import AdaptiveLength
from ..core.cascade import Lookup
from ..core.limits import is_number
from ..core.request import GenerationConfig
from ..core.schedule import Schedule, ScheduleError
from ..core.verify import Verification
from .base import (
    BACKENDS,
    DEVICE,
    DTYPES,
    GRAPH_MODES,
    KV_STORAGES,
    MAG,
    SUFFIX,
    ConfigError,
    MaGConfig,
    ModelTierConfig,
    StatisticalConfig,
    SuffixConfig,
    check_int,
    mapping_at,
    only_keys,
    parse_addresses,
    resolve_path,
)
from .serving import (  # noqa: F401 - part of this package's interface
    ADMISSION_KEYS,
    DEPLOYMENT_OPTIONS,
    ENV_REFERENCE,
    MAX_SHUTDOWN_GRACE_S,
    ServingConfig,
    TierClientConfig,
    TierServerConfig,
    deployment_name,
    parse_serving,
    resolve_redis_url,
    tier_groups,
)


@dataclass(frozen=True)
class CascadeConfig:
    target: ModelTierConfig
    drafters: tuple[ModelTierConfig | StatisticalConfig, ...]  # largest first, the statistical ones last
    schedule: Schedule  # the K-matrix
    leniency: float = 1.0  # inner reviews only; the target's review is always strict
    lookup: Lookup | None = None  # MaG-first gate at the target (needs MaG among the drafters)
    # Adaptive draft length (SpecDec++ or the confidence baseline) per tier that drafts alone.
    adaptive: dict[str, AdaptiveLength] = field(default_factory=dict, hash=False)  # dicts do not hash

    @property
    def tiers(self) -> tuple[ModelTierConfig | StatisticalConfig, ...]:
        return (self.target, *self.drafters)

    def max_block(self) -> int:
        """The most drafts the target reviews in one round under this schedule (MaG lookup included)."""
        rows = self.schedule.to_lists()
        lookup = self.lookup.tokens if self.lookup is not None else 0
        return max(sum(rows[0]) if rows else 0, lookup)


def local_mag(cascade: CascadeConfig) -> MaGConfig | None:
    """The config's MaG drafter when no tier server hosts it (suffix decoding is not MaG)."""
    return next((d for d in cascade.drafters if d.name == MAG and isinstance(d, MaGConfig) and not d.remote), None)


GENERATION_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "verification"}
GENERATION_KEYS |= {"repetition_penalty", "presence_penalty", "frequency_penalty"}


@dataclass(frozen=True)
class Config:
    cascade: CascadeConfig
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)


def load_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return parse_config(raw, base_dir=path.parent)


def parse_config(raw: dict[str, Any], base_dir: Path = Path(".")) -> Config:
    only_keys(raw, "", {"tiers", "schedule", "generation", "model", "serving"})
    model_defaults = mapping_at(raw.get("model", {}), "model")
    only_keys(
        model_defaults, "model.", {"dtype", "device", "kv", "kv_budget_mb", "graphs"}
    )  # what every model tier takes unless it says
    tiers = mapping_at(raw.get("tiers"), "tiers")
    only_keys(tiers, "tiers.", {"target", "drafters"})
    target = _model_tier(tiers.get("target"), "tiers.target", "target", model_defaults, base_dir)
    drafter_list = tiers.get("drafters", [])
    if not isinstance(drafter_list, list):
        raise ConfigError("tiers.drafters must be a list")
    drafters = tuple(
        _drafter(item, f"tiers.drafters[{i}]", model_defaults, base_dir) for i, item in enumerate(drafter_list)
    )
    schedule_raw = mapping_at(raw.get("schedule", {}), "schedule")
    only_keys(schedule_raw, "schedule.", {"k_matrix", "leniency", "lookup", "adaptive", "fill"})
    cascade = make_cascade(
        target,
        drafters,
        schedule_raw.get("k_matrix"),
        schedule_raw.get("leniency", 1.0),
        _lookup(schedule_raw.get("lookup")),
        make_adaptive(schedule_raw.get("adaptive", {}), base_dir),
        schedule_raw.get("fill", "entry"),
    )
    gen_raw = mapping_at(raw.get("generation", {}), "generation")
    only_keys(gen_raw, "generation.", GENERATION_KEYS)
    if "verification" in gen_raw:
        gen_raw = {**gen_raw, "verification": make_verification(gen_raw["verification"], "generation.verification")}
    serving = parse_serving(mapping_at(raw.get("serving", {}), "serving"), cascade, base_dir)
    return Config(cascade, make_generation(GenerationConfig(), gen_raw), serving)


def make_cascade(
    target: ModelTierConfig,
    drafters: Sequence[ModelTierConfig | StatisticalConfig],
    k_matrix: Any,
    leniency: Any,
    lookup: Lookup | None = None,
    adaptive: dict[str, AdaptiveLength] | None = None,
    fill: Any = "entry",
) -> CascadeConfig:
    names = [d.name for d in drafters]
    if len(set(names) | {target.name}) != len(names) + 1:
        raise ConfigError(f"tier names must be unique, got target {target.name!r} and drafters {names}")
    leaves = [d.name for d in drafters if isinstance(d, StatisticalConfig)]  # they draft, never review
    try:
        if k_matrix is None:
            schedule = Schedule.default(names, leaves, fill)
        elif isinstance(k_matrix, str):
            schedule = Schedule.from_json(k_matrix, names, leaves, fill)
        else:
            schedule = Schedule.parse(k_matrix, names, leaves, fill)
    except ScheduleError as exc:
        field = "schedule.fill" if str(exc).startswith("fill ") else "schedule.k_matrix"
        raise ConfigError(f"{field}: {exc}") from None
    if not is_number(leniency) or not leniency >= 1.0:
        raise ConfigError(f"schedule.leniency must be a number >= 1, got {leniency!r}")
    if lookup is not None and not any(isinstance(d, StatisticalConfig) and d.name == lookup.tier for d in drafters):
        raise ConfigError(
            f"schedule.lookup.tier: {lookup.tier!r} is not a statistical drafter (kind: mag or suffix) "
            "among tiers.drafters"
        )
    for tier in adaptive or {}:
        r = names.index(tier) + 1 if tier in names else 0
        if not r or isinstance(drafters[r - 1], StatisticalConfig):
            raise ConfigError(f"schedule.adaptive.{tier}: not a model drafter (drafters: {names})")
        if not schedule.is_leaf(r) and adaptive[tier].rule != "specdec":  # type: ignore[index]
            raise ConfigError(
                f"schedule.adaptive.{tier}: this tier reviews (its K-matrix row is not zero); a "
                "reviewing tier stops its part early only by SpecDec++ (rule: specdec, with a head)"
            )
    return CascadeConfig(target, tuple(drafters), schedule, float(leniency), lookup, dict(adaptive or {}))


def make_adaptive(raw: Any, base_dir: Path = Path("."), where: str = "schedule.adaptive") -> dict[str, AdaptiveLength]:
    """{tier: {rule, threshold, head}} -> AdaptiveLength per tier; errors name the field."""
    out = {}
    for tier, spec in mapping_at(raw, where).items():
        spec = mapping_at(spec, f"{where}.{tier}")
        only_keys(spec, f"{where}.{tier}.", {"rule", "threshold", "head"})
        head = spec.get("head")
        if head is not None:
            if not isinstance(head, str) or not head:
                raise ConfigError(f"{where}.{tier}.head must be a directory written by `cascade-service train-head`")
            head = resolve_path(head, base_dir)
        try:
            out[str(tier)] = AdaptiveLength(spec.get("rule", ""), spec.get("threshold", 0.0), head)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}.{tier}.{exc}") from None
    return out


def _lookup(raw: Any) -> Lookup | None:
    if raw is None:
        return None
    only_keys(mapping_at(raw, "schedule.lookup"), "schedule.lookup.", {"min_match", "tokens", "tier"})
    try:
        return Lookup(**raw)
    except ValueError as exc:
        raise ConfigError(f"schedule.{exc}") from None


def make_generation(base: GenerationConfig, overrides: dict[str, Any]) -> GenerationConfig:
    """`base` with overrides applied (None = keep), checked as every request is (core.request)."""
    try:
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        raise ConfigError(f"generation.{exc}") from None


def make_verification(raw: Any, where: str = "verification") -> Verification:
    """{rule, alpha, beta} (beta: a number, or "tuned") -> Verification; errors name `where`."""
    raw = mapping_at(raw, where)
    only_keys(raw, where + ".", {"rule", "alpha", "beta"})
    beta = raw.get("beta", 1.0)
    try:
        return Verification(raw.get("rule", "exact"), raw.get("alpha"), None if beta == "tuned" else beta)
    except ValueError as exc:
        raise ConfigError(str(exc).replace("verification.", where + ".", 1)) from None


def drafter_from_arg(arg: str, index: int, dtype: str, device: str) -> ModelTierConfig | StatisticalConfig:
    """A command-line drafter: `mag`, `suffix`, or a model directory (named after it)."""
    if arg in STATISTICAL:
        return STATISTICAL[arg]({}, f"--drafter[{index}]", Path("."))
    return _model_tier(
        {"path": arg},
        f"--drafter[{index}]",
        Path(arg).name or f"drafter{index}",
        {"dtype": dtype, "device": device},
        Path("."),
    )


def target_from_arg(path: str, dtype: str, device: str) -> ModelTierConfig:
    return _model_tier({"path": path}, "--target", "target", {"dtype": dtype, "device": device}, Path("."))


def _drafter(item: Any, where: str, defaults: dict, base_dir: Path) -> ModelTierConfig | StatisticalConfig:
    if isinstance(item, str) and item in STATISTICAL:
        return STATISTICAL[item]({}, where, base_dir)
    item = mapping_at(item, where)
    kind = item.get("kind")
    if kind is None and item.get("name") == MAG and "path" not in item:
        kind = MAG  # `{name: mag}` has always meant MaG
    if kind in STATISTICAL:
        return STATISTICAL[kind](item, where, base_dir)
    if kind is not None and kind != "model":
        raise ConfigError(f"{where}.kind must be one of model, {', '.join(STATISTICAL)}, got {kind!r}")
    return _model_tier(item, where, None, defaults, base_dir)


def _mag(item: dict, where: str, base_dir: Path) -> MaGConfig:
    only_keys(item, where + ".", {"kind", "name", "bigram", "max_ngram", "address"})
    bigram = item.get("bigram")
    max_ngram = item.get("max_ngram", 16)
    check_int(max_ngram, where + ".max_ngram", 1, 64)
    address = parse_addresses(item["address"], where + ".address") if "address" in item else ()
    return MaGConfig(item.get("name", MAG), resolve_path(bigram, base_dir) if bigram else None, max_ngram, address)


def _suffix(item: dict, where: str, base_dir: Path) -> SuffixConfig:
    fields = {"depth", "factor", "min_prob", "cache_tokens", "total_cache_tokens", "corpus", "corpus_tokens"}
    only_keys(item, where + ".", {"kind", *fields})
    defaults = SuffixConfig()
    depth = item.get("depth", defaults.depth)
    check_int(depth, where + ".depth", 2, 256)
    ints = {}
    for key in ("cache_tokens", "total_cache_tokens", "corpus_tokens"):
        ints[key] = item.get(key, getattr(defaults, key))
        check_int(ints[key], f"{where}.{key}", 0, 10_000_000)
    if ints["total_cache_tokens"] < ints["cache_tokens"]:
        raise ConfigError(
            f"{where}.total_cache_tokens ({ints['total_cache_tokens']}) must be at least cache_tokens "
            f"({ints['cache_tokens']}): one key's recent requests must fit"
        )
    numbers = {}
    for key, default, lo, hi in (("factor", defaults.factor, 0.1, 64.0), ("min_prob", defaults.min_prob, 0.0, 1.0)):
        value = item.get(key, default)
        if not is_number(value) or not lo <= value <= hi:
            raise ConfigError(f"{where}.{key} must be a number in [{lo:g}, {hi:g}], got {value!r}")
        numbers[key] = float(value)
    corpus = item.get("corpus")
    if corpus is not None:
        if not isinstance(corpus, str) or not corpus:
            raise ConfigError(f"{where}.corpus must be the path of a UTF-8 text file, got {corpus!r}")
        corpus = resolve_path(corpus, base_dir)
        if not Path(corpus).is_file():
            raise ConfigError(f"{where}.corpus: {corpus} is not a file")
    return SuffixConfig(
        depth=depth,
        factor=numbers["factor"],
        min_prob=numbers["min_prob"],
        cache_tokens=ints["cache_tokens"],
        total_cache_tokens=ints["total_cache_tokens"],
        corpus=corpus,
        corpus_tokens=ints["corpus_tokens"],
    )


# kind -> the parser of that statistical drafter's settings (one registry for the family).
STATISTICAL: dict[str, Callable[[dict, str, Path], StatisticalConfig]] = {MAG: _mag, SUFFIX: _suffix}


def _model_tier(item: Any, where: str, default_name: str | None, defaults: dict, base_dir: Path) -> ModelTierConfig:
    item = mapping_at(item, where)
    fields = {"name", "path", "dtype", "device", "kind", "address", "backend", "kv", "kv_budget_mb", "graphs"}
    only_keys(item, where + ".", fields)
    address = parse_addresses(item["address"], where + ".address") if "address" in item else ()
    if address and "path" not in item:
        if where.endswith("target"):
            raise ConfigError(f"{where}.path: a remote target still needs the directory of its tokenizer")
        if not item.get("name"):
            raise ConfigError(f"{where}.name: a remote tier without a path needs a name (its name on the tier server)")
    elif not isinstance(item.get("path"), str) or not item["path"]:
        raise ConfigError(f"{where}.path must be a local model directory")
    path = resolve_path(item["path"], base_dir) if "path" in item else ""
    name = item.get("name") or default_name or Path(path).name
    dtype = item.get("dtype", defaults.get("dtype", "float32"))
    if dtype not in DTYPES:
        raise ConfigError(f"{where}.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    device = item.get("device", defaults.get("device", "cpu"))
    if not isinstance(device, str) or not DEVICE.fullmatch(device):
        raise ConfigError(f"{where}.device must be cpu, cuda, cuda:N or auto, got {device!r}")
    if name in (MAG, SUFFIX):
        raise ConfigError(f"{where}.name: {name!r} is reserved for a statistical drafter")
    backend = item.get("backend", "hf")
    if backend not in BACKENDS:
        raise ConfigError(f"{where}.backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend != "hf" and where.endswith("target"):
        # A drafter's rounding never reaches the output (the target reviews it); the target's would.
        raise ConfigError(f"{where}.backend must be hf: the output is the target's transformers forward")
    kv = item.get("kv", defaults.get("kv", "pool"))
    if kv not in KV_STORAGES:
        raise ConfigError(f"{where}.kv must be one of {', '.join(KV_STORAGES)}, got {kv!r}")
    budget = item.get("kv_budget_mb", defaults.get("kv_budget_mb"))
    if budget is not None and (not is_number(budget) or budget <= 0):
        raise ConfigError(f"{where}.kv_budget_mb must be a positive number of MiB, got {budget!r}")
    graphs = item.get("graphs", defaults.get("graphs", "auto"))
    if graphs not in GRAPH_MODES:
        raise ConfigError(f"{where}.graphs must be one of {', '.join(GRAPH_MODES)}, got {graphs!r}")
    return ModelTierConfig(
        str(name),
        path,
        dtype,
        device,
        key=where,
        address=address,
        backend=backend,
        kv=kv,
        kv_budget_mb=budget,
        graphs=graphs,
    )
