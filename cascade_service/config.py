"""Configuration: one tree of frozen, validated objects, loaded here and nowhere else.

Strings become objects once, here (a drafter named "mag" becomes `MaGConfig`, a K-matrix becomes a
`Schedule`); every other module receives only its own slice.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import yaml

import torch

from .core.adaptive import AdaptiveLength, StopperFactory
from .core.cascade import Lookup, RequestState
from .core.sampling import SamplingParams
from .core.schedule import Schedule, ScheduleError
from .core.stats import CascadeStats
from .scheduling.trial import ARMS
from .core.request import GenerationConfig, check_stop_threshold
from .core.verify import Verification
from .paths import expand

MAG = "mag"
DTYPES = ("float32", "float16", "bfloat16", "auto")
DEVICE = re.compile(r"cpu|auto|cuda(:\d+)?")  # whether such a device exists is checked where weights load


class ConfigError(ValueError):
    """A config value is wrong; the message names the field."""


@dataclass(frozen=True)
class ModelTierConfig:
    name: str  # tier name in stats and K-matrix messages
    path: str  # local Hugging Face directory (config, safetensors, tokenizer)
    dtype: str = "float32"  # weights and compute dtype
    device: str = "cpu"  # "cpu", "cuda", "cuda:N" or "auto"; in a Ray replica given GPUs, those (serving.tier)
    # Where the config set this tier ("tiers.drafters[1]", "--target"), for errors; "" when built in code.
    key: str = field(default="", compare=False)


@dataclass(frozen=True)
class MaGConfig:
    name: str = MAG
    bigram: str | None = None  # JSON bigram table (zoo build writes one); none: n-gram matches only
    max_ngram: int = 16  # longest suffix MaG looks up; bounds its per-call work


@dataclass(frozen=True)
class CascadeConfig:
    target: ModelTierConfig
    drafters: tuple[ModelTierConfig | MaGConfig, ...]  # largest first, MaG last
    schedule: Schedule  # the K-matrix
    leniency: float = 1.0  # inner reviews only; the target's review is always strict
    lookup: Lookup | None = None  # MaG-first gate at the target (needs MaG among the drafters)
    # Adaptive draft length (SpecDec++ or the confidence baseline) per tier that drafts alone.
    adaptive: dict[str, AdaptiveLength] = field(default_factory=dict, hash=False)  # dicts do not hash

    @property
    def tiers(self) -> tuple[ModelTierConfig | MaGConfig, ...]:
        return (self.target, *self.drafters)

    def max_block(self) -> int:
        """The most drafts the target reviews in one round under this schedule (MaG lookup included)."""
        rows = self.schedule.to_lists()
        lookup = self.lookup.tokens if self.lookup is not None else 0
        return max(sum(rows[0]) if rows else 0, lookup)


def request_state(gen: GenerationConfig, stats: CascadeStats, vocab_size: int, eos_ids: frozenset[int],
                  adaptive: dict[str, AdaptiveLength] | None = None,
                  make_stopper: StopperFactory | None = None) -> RequestState:
    """The shared state of one request's cascade, from its generation settings."""
    v = gen.verification
    stats.verification = v.describe()
    sampling = SamplingParams(gen.temperature, gen.top_p, rows=v.needs_rows)
    return RequestState(sampling, torch.Generator().manual_seed(gen.seed), stats, vocab_size, eos_ids, v,
                        with_stop_threshold(adaptive or {}, gen.stop_threshold), make_stopper)


def with_stop_threshold(adaptive: dict[str, AdaptiveLength], threshold: float | None) -> dict[str, AdaptiveLength]:
    """The tiers' adaptive draft lengths with a request's SpecDec++ threshold applied.

    Raises ValueError naming `stop_threshold` when it is out of (0, 1) or no tier has an acceptance
    head to apply it to: a request must not believe it changed something that does not exist.
    """
    threshold = check_stop_threshold(threshold)
    if threshold is None:
        return dict(adaptive)
    if not any(spec.rule == "specdec" for spec in adaptive.values()):
        raise ValueError("stop_threshold: no tier of this cascade has an acceptance head "
                         "(schedule.adaptive with rule specdec)")
    return {tier: replace(spec, threshold=float(threshold)) if spec.rule == "specdec" else spec
            for tier, spec in adaptive.items()}


DEPLOYMENT_OPTIONS = {"num_replicas", "ray_actor_options", "autoscaling_config", "max_ongoing_requests",
                      "max_queued_requests", "graceful_shutdown_timeout_s"}


MAX_SHUTDOWN_GRACE_S = 3600


@dataclass(frozen=True)
class ServingConfig:
    """How `cascade-service serve` places and scales the tiers (Ray Serve); ignored in-process."""

    grpc_port: int = 9000
    # None: sessions in an in-cluster actor (survives app restarts, not Ray's). `${NAME}` in it is read
    # from the environment when the config loads: deploy files give each pod or node CASCADE_REDIS_URL.
    redis_url: str | None = None
    session_namespace: str = "cascade"
    session_ttl_s: int = 7 * 24 * 3600
    # Live sessions one API key (or all anonymous callers together) may hold; None: no limit. With each
    # session within the model's context, this also bounds the tokens a key stores.
    max_sessions_per_key: int | None = 1000
    # Model tiers hosted inside the coordinator's replica instead of their own deployment: their calls
    # cost no hop, but they scale with the coordinator. MaG always runs in the coordinator (it is a
    # dict lookup), so colocating the smallest tier puts MaG beside it.
    colocate: tuple[str, ...] = ()
    # Model tiers that share one deployment (`tier-<a>-<b>`). A member whose whole sub-cascade (the
    # tiers below it in the K-matrix, MaG included) lies in its group runs it there in one call.
    groups: tuple[tuple[str, ...], ...] = ()
    torch_threads: int | None = None  # per tier replica; None: torch's default
    # deployment name ("coordinator", "tier-<name>") -> Ray Serve options: num_replicas,
    # ray_actor_options (num_cpus, num_gpus, accelerator_type, resources), autoscaling_config, ...
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Access control of the gRPC edge (api/auth.py); relative paths are relative to the config file.
    api_keys_file: str | None = None  # one key per line (`KEY [name]`, `#` comments); None: no keys
    tls_cert_file: str | None = None  # PEM certificate chain; with tls_key_file: serve TLS
    tls_key_file: str | None = None  # PEM private key
    # Speculation that adapts to load (scheduling.load): each round's drafting is chosen from measured
    # acceptance and what the load makes of each way of drafting. The standalone server's
    # --adapt-to-load turns it on too.
    adapt_to_load: bool = False
    # The ways of drafting its trial chooses between, wherever speculation adapts to load (scheduling.trial.ARMS);
    # None: every one the frontend can run. E.g. [full, budget] on a pool where drafting always pays, to
    # spare the trial its exploring; one arm alone: that arm, no trial.
    load_arms: tuple[str, ...] | None = None
    # On SIGTERM or Ctrl-C, `serve` stops taking calls and gives the calls in flight this long to finish
    # before it cancels them (each ends with a status, never silently); Ray Serve replicas get the same
    # graceful_shutdown_timeout_s unless serving.deployments sets one. Then Serve and Ray stop.
    shutdown_grace_s: float = 10.0
    # What the standalone server and the edge admit (api.frontend.Limits, docs/service.md "Admission"):
    # any of ADMISSION_KEYS; unset ones keep their defaults (workers: the frontend's own).
    admission: dict[str, float] = field(default_factory=dict)


# The settings of serving.admission (api.frontend.Limits' fields).
ADMISSION_KEYS = ("workers", "max_queued", "max_pending", "max_calls_per_key", "max_streams_per_connection",
                  "body_timeout_s", "max_probes", "max_message_bytes")


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
    _only(raw, "", {"tiers", "schedule", "generation", "model", "serving"})
    model_defaults = _mapping(raw.get("model", {}), "model")
    tiers = _mapping(raw.get("tiers"), "tiers")
    _only(tiers, "tiers.", {"target", "drafters"})
    target = _model_tier(tiers.get("target"), "tiers.target", "target", model_defaults, base_dir)
    drafter_list = tiers.get("drafters", [])
    if not isinstance(drafter_list, list):
        raise ConfigError("tiers.drafters must be a list")
    drafters = tuple(
        _drafter(item, f"tiers.drafters[{i}]", model_defaults, base_dir) for i, item in enumerate(drafter_list)
    )
    schedule_raw = _mapping(raw.get("schedule", {}), "schedule")
    _only(schedule_raw, "schedule.", {"k_matrix", "leniency", "lookup", "adaptive"})
    cascade = make_cascade(target, drafters, schedule_raw.get("k_matrix"), schedule_raw.get("leniency", 1.0),
                           _lookup(schedule_raw.get("lookup")), make_adaptive(schedule_raw.get("adaptive", {}), base_dir))
    gen_raw = _mapping(raw.get("generation", {}), "generation")
    _only(gen_raw, "generation.", {"max_new_tokens", "temperature", "top_p", "seed", "verification"})
    if "verification" in gen_raw:
        gen_raw = {**gen_raw, "verification": make_verification(gen_raw["verification"], "generation.verification")}
    serving = _serving(_mapping(raw.get("serving", {}), "serving"), cascade, base_dir)
    return Config(cascade, make_generation(GenerationConfig(), gen_raw), serving)


def _load_arms(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    # membership first: then every item is a string, and the set of them can be built
    if not isinstance(value, list) or not value or any(arm not in ARMS for arm in value) \
            or len(set(value)) != len(value):
        raise ConfigError(f"serving.load_arms must be a non-empty list of distinct arms among {list(ARMS)}, "
                          f"got {value!r}")
    return tuple(value)


def _admission(value: Any) -> dict[str, float]:
    """serving.admission: known keys, each a number (the ranges are Limits' own, checked when `serve` starts)."""
    if value is None:
        return {}
    raw = _mapping(value, "serving.admission")
    _only(raw, "serving.admission.", set(ADMISSION_KEYS))
    for key, number in raw.items():
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ConfigError(f"serving.admission.{key} must be a number, got {number!r}")
        if key != "body_timeout_s" and number != int(number):
            raise ConfigError(f"serving.admission.{key} must be a whole number, got {number!r}")
    return {k: (float(v) if k == "body_timeout_s" else int(v)) for k, v in raw.items()}


def _serving(raw: dict[str, Any], cascade: CascadeConfig, base_dir: Path = Path(".")) -> ServingConfig:
    _only(raw, "serving.", {"grpc_port", "redis_url", "session_namespace", "session_ttl_s", "colocate",
                            "groups", "torch_threads", "deployments", "api_keys_file", "tls_cert_file",
                            "tls_key_file", "adapt_to_load", "load_arms", "shutdown_grace_s", "admission",
                            "max_sessions_per_key"})
    serving = ServingConfig(**{k: v for k, v in raw.items()
                               if k not in ("deployments", "colocate", "groups", "load_arms", "admission")},
                            load_arms=_load_arms(raw.get("load_arms")), admission=_admission(raw.get("admission")))
    _check_int(serving.grpc_port, "serving.grpc_port", 1, 65535)
    _check_int(serving.session_ttl_s, "serving.session_ttl_s", 1, 10 * 365 * 24 * 3600)
    if serving.max_sessions_per_key is not None:
        _check_int(serving.max_sessions_per_key, "serving.max_sessions_per_key", 1, 10**9)
    if serving.torch_threads is not None:
        _check_int(serving.torch_threads, "serving.torch_threads", 1, 1024)
    grace = serving.shutdown_grace_s
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace <= MAX_SHUTDOWN_GRACE_S:
        raise ConfigError(f"serving.shutdown_grace_s must be a number of seconds in [0, {MAX_SHUTDOWN_GRACE_S}], "
                          f"got {grace!r}")
    if not isinstance(serving.adapt_to_load, bool):
        raise ConfigError(f"serving.adapt_to_load must be true or false, got {serving.adapt_to_load!r}")
    serving = replace(serving, redis_url=resolve_redis_url(serving.redis_url, "serving.redis_url"))
    if not isinstance(serving.session_namespace, str) or not serving.session_namespace or ":" in serving.session_namespace:
        raise ConfigError(f"serving.session_namespace must be a non-empty string without ':', got {serving.session_namespace!r}")
    files = {}
    for name in ("api_keys_file", "tls_cert_file", "tls_key_file"):
        value = getattr(serving, name)
        if value is not None and not (isinstance(value, str) and value):
            raise ConfigError(f"serving.{name} must be a file path (a string), got {value!r}")
        files[name] = None if value is None else _resolve(value, base_dir)
    if (files["tls_cert_file"] is None) != (files["tls_key_file"] is None):
        raise ConfigError("serving.tls_cert_file and serving.tls_key_file go together")
    model_tiers = [t.name for t in cascade.tiers if isinstance(t, ModelTierConfig)]
    colocate = raw.get("colocate", [])
    if not isinstance(colocate, list) or any(name not in model_tiers for name in colocate):
        raise ConfigError(f"serving.colocate must list model tiers ({', '.join(model_tiers)}), got {colocate!r}")
    groups = raw.get("groups", [])
    grouped = [name for group in groups for name in group] if isinstance(groups, list) and all(
        isinstance(g, list) and g for g in groups) else None
    if grouped is None or len(set(grouped)) != len(grouped) or any(
            n not in model_tiers or n in colocate for n in grouped):
        raise ConfigError(f"serving.groups must be disjoint non-empty lists of model tiers not in serving.colocate, "
                          f"got {groups!r}")
    names = {"coordinator"} | {deployment_name(group) for group in tier_groups(model_tiers, colocate, groups)}
    deployments = _mapping(raw.get("deployments", {}), "serving.deployments")
    for name, options in deployments.items():
        if name not in names:
            raise ConfigError(f"serving.deployments.{name}: no such deployment (have: {', '.join(sorted(names))})")
        _only(_mapping(options, f"serving.deployments.{name}"), f"serving.deployments.{name}.", DEPLOYMENT_OPTIONS)
    return replace(serving, colocate=tuple(colocate), groups=tuple(tuple(g) for g in groups),
                   deployments={k: dict(v) for k, v in deployments.items()}, api_keys_file=files["api_keys_file"],
                   tls_cert_file=files["tls_cert_file"], tls_key_file=files["tls_key_file"])


ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def resolve_redis_url(value: Any, where: str) -> str | None:
    """A session store URL with each `${NAME}` replaced by that environment variable; None stays None.

    Only the braced form is read, so a `$` in a password stays as written. A reference to a variable
    that is unset or empty is an error rather than an empty URL: a cluster whose sessions silently fell
    back to one replica's memory would lose them whenever that replica went away.
    """
    if value is None:
        return None

    def lookup(match: re.Match) -> str:
        found = os.environ.get(match.group(1))
        if not found:
            raise ConfigError(f"{where} reads {match.group(0)}, which is not set in this process's environment "
                              f"(set it on every node, as the deploy files do, or write the URL out)")
        return found

    url = ENV_REFERENCE.sub(lookup, value) if isinstance(value, str) else value
    if not (isinstance(url, str) and url.startswith(("redis://", "rediss://", "unix://"))):
        # An expanded value is not echoed: it may hold a password.
        shown = f"{value!r} (its value is not such a URL)" if url != value else repr(value)
        raise ConfigError(f"{where} must be a redis://, rediss:// or unix:// URL, got {shown}")
    return url


def tier_groups(model_tiers: Sequence[str], colocate: Sequence[str], groups: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    """The tier deployments: each configured group, then every other non-colocated model tier alone."""
    grouped = {name for group in groups for name in group}
    return [tuple(g) for g in groups] + [(n,) for n in model_tiers if n not in grouped and n not in colocate]


def deployment_name(group: Sequence[str]) -> str:
    return "tier-" + "-".join(group)


def make_cascade(
    target: ModelTierConfig,
    drafters: Sequence[ModelTierConfig | MaGConfig],
    k_matrix: Any,
    leniency: Any,
    lookup: Lookup | None = None,
    adaptive: dict[str, AdaptiveLength] | None = None,
) -> CascadeConfig:
    names = [d.name for d in drafters]
    if len(set(names) | {target.name}) != len(names) + 1:
        raise ConfigError(f"tier names must be unique, got target {target.name!r} and drafters {names}")
    try:
        if k_matrix is None:
            schedule = Schedule.default(names)
        elif isinstance(k_matrix, str):
            schedule = Schedule.from_json(k_matrix, names)
        else:
            schedule = Schedule.parse(k_matrix, names)
    except ScheduleError as exc:
        raise ConfigError(f"schedule.k_matrix: {exc}") from None
    if isinstance(leniency, bool) or not isinstance(leniency, (int, float)) or not leniency >= 1.0:
        raise ConfigError(f"schedule.leniency must be a number >= 1, got {leniency!r}")
    if lookup is not None and not any(isinstance(d, MaGConfig) for d in drafters):
        raise ConfigError("schedule.lookup needs the MaG drafter (kind: mag) among tiers.drafters")
    for tier in adaptive or {}:
        r = names.index(tier) + 1 if tier in names else 0
        if not r or isinstance(drafters[r - 1], MaGConfig):
            raise ConfigError(f"schedule.adaptive.{tier}: not a model drafter (drafters: {names})")
        if not schedule.is_leaf(r) and adaptive[tier].rule != "specdec":  # type: ignore[index]
            raise ConfigError(f"schedule.adaptive.{tier}: this tier reviews (its K-matrix row is not zero); a "
                              "reviewing tier stops its part early only by SpecDec++ (rule: specdec, with a head)")
    return CascadeConfig(target, tuple(drafters), schedule, float(leniency), lookup, dict(adaptive or {}))


def make_adaptive(raw: Any, base_dir: Path = Path("."), where: str = "schedule.adaptive") -> dict[str, AdaptiveLength]:
    """{tier: {rule, threshold, head}} -> AdaptiveLength per tier; errors name the field."""
    out = {}
    for tier, spec in _mapping(raw, where).items():
        spec = _mapping(spec, f"{where}.{tier}")
        _only(spec, f"{where}.{tier}.", {"rule", "threshold", "head"})
        head = spec.get("head")
        if head is not None:
            if not isinstance(head, str) or not head:
                raise ConfigError(f"{where}.{tier}.head must be a directory written by `cascade-service train-head`")
            head = _resolve(head, base_dir)
        try:
            out[str(tier)] = AdaptiveLength(spec.get("rule", ""), spec.get("threshold", 0.0), head)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}.{tier}.{exc}") from None
    return out


def _lookup(raw: Any) -> Lookup | None:
    if raw is None:
        return None
    _only(_mapping(raw, "schedule.lookup"), "schedule.lookup.", {"min_match", "tokens"})
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
    raw = _mapping(raw, where)
    _only(raw, where + ".", {"rule", "alpha", "beta"})
    beta = raw.get("beta", 1.0)
    try:
        return Verification(raw.get("rule", "exact"), raw.get("alpha"), None if beta == "tuned" else beta)
    except ValueError as exc:
        raise ConfigError(str(exc).replace("verification.", where + ".", 1)) from None


def drafter_from_arg(arg: str, index: int, dtype: str, device: str) -> ModelTierConfig | MaGConfig:
    """A command-line drafter: `mag`, or a model directory (named after it)."""
    if arg == MAG:
        return MaGConfig()
    return _model_tier({"path": arg}, f"--drafter[{index}]", Path(arg).name or f"drafter{index}", {"dtype": dtype, "device": device}, Path("."))


def target_from_arg(path: str, dtype: str, device: str) -> ModelTierConfig:
    return _model_tier({"path": path}, "--target", "target", {"dtype": dtype, "device": device}, Path("."))


def _drafter(item: Any, where: str, defaults: dict, base_dir: Path) -> ModelTierConfig | MaGConfig:
    if item == MAG:
        return MaGConfig()
    item = _mapping(item, where)
    if item.get("kind") == MAG or (item.get("name") == MAG and "path" not in item):
        _only(item, where + ".", {"kind", "name", "bigram", "max_ngram"})
        bigram = item.get("bigram")
        max_ngram = item.get("max_ngram", 16)
        _check_int(max_ngram, where + ".max_ngram", 1, 64)
        return MaGConfig(item.get("name", MAG), _resolve(bigram, base_dir) if bigram else None, max_ngram)
    return _model_tier(item, where, None, defaults, base_dir)


def _model_tier(item: Any, where: str, default_name: str | None, defaults: dict, base_dir: Path) -> ModelTierConfig:
    item = _mapping(item, where)
    _only(item, where + ".", {"name", "path", "dtype", "device", "kind"})
    if not isinstance(item.get("path"), str) or not item["path"]:
        raise ConfigError(f"{where}.path must be a local model directory")
    path = _resolve(item["path"], base_dir)
    name = item.get("name") or default_name or Path(path).name
    dtype = item.get("dtype", defaults.get("dtype", "float32"))
    if dtype not in DTYPES:
        raise ConfigError(f"{where}.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    device = item.get("device", defaults.get("device", "cpu"))
    if not isinstance(device, str) or not DEVICE.fullmatch(device):
        raise ConfigError(f"{where}.device must be cpu, cuda, cuda:N or auto, got {device!r}")
    if name == MAG:
        raise ConfigError(f"{where}.name: 'mag' is reserved for the Max-Gram drafter")
    return ModelTierConfig(str(name), path, dtype, device, key=where)


def _resolve(path: str, base_dir: Path) -> str:
    expanded = Path(expand(path))
    return str(expanded if expanded.is_absolute() else (base_dir / expanded))


def _mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def _only(mapping: dict, prefix: str, allowed: set[str]) -> None:
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise ConfigError(f"unknown field {prefix}{unknown[0]} (allowed: {', '.join(sorted(allowed))})")


def _check_int(value: Any, where: str, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{where} must be an integer in [{lo}, {hi}], got {value!r}")
