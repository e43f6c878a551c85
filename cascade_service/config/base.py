"""What every part of the config shares: the error type, field checks, and the tiers' own settings."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..core.limits import is_integer
from ..paths import expand

MAG = "mag"
SUFFIX = "suffix"
DTYPES = ("float32", "float16", "bfloat16", "auto")
# The forward a model tier runs on (models.lean.BACKENDS): transformers' own, or the lean rewrite that
# drafters may use (their numerics never change the output; the target's do, so it runs "hf").
BACKENDS = ("hf", "lean", "int8")
# Where a model tier keeps its requests' KV caches (models.kvpool.STORAGES): slots of one pool that a
# batched pass reads in place, or a DynamicCache per request packed into each batched pass.
KV_STORAGES = ("pool", "dynamic")
GRAPH_MODES = ("auto", "eager", "off")  # models.graphs.GRAPH_MODES's keys
DEVICE = re.compile(r"cpu|auto|cuda(:\d+)?")  # whether such a device exists is checked where weights load


class ConfigError(ValueError):
    """A config value is wrong; the message names the field."""


@dataclass(frozen=True)
class ModelTierConfig:
    name: str  # tier name in stats and K-matrix messages
    path: str  # local Hugging Face directory (config, safetensors, tokenizer)
    dtype: str = "float32"  # weights and compute dtype
    device: str = "cpu"  # "cpu", "cuda", "cuda:N" or "auto"; in a Ray replica given GPUs, those (tierhost.group)
    # Where the config set this tier ("tiers.drafters[1]", "--target"), for errors; "" when built in code.
    key: str = field(default="", compare=False)
    # host:port of the tier server(s) that serve this tier (`cascade-service tier`), replicas of one
    # another; the coordinator then reaches it over gRPC and loads no weights. `path` is then optional,
    # except for the target: the coordinator reads its tokenizer from there.
    address: tuple[str, ...] = ()
    backend: str = "hf"  # BACKENDS
    kv: str = "pool"  # KV_STORAGES
    # The most its paged KV pool holds, in MiB (models.kvsize); None: a share of the device's memory.
    kv_budget_mb: float | None = None
    # How its passes run in fixed shapes (models.graphs.GRAPH_MODES): "auto" captures CUDA graphs
    # on cuda and changes nothing elsewhere; "eager" the same shapes uncaptured; "off" neither.
    graphs: str = "auto"

    @property
    def remote(self) -> bool:
        return bool(self.address)


@dataclass(frozen=True)
class MaGConfig:
    """Max-Gram (core.proposers.mag): the longest earlier match of the sequence's suffix, then a bigram table."""

    kind: ClassVar[str] = MAG
    name: str = MAG
    bigram: str | None = None  # JSON bigram table (zoo build writes one); none: n-gram matches only
    max_ngram: int = 16  # longest suffix MaG looks up; bounds its per-call work
    address: tuple[str, ...] = ()  # a tier server hosting MaG (`cascade-service tier --tier mag`)

    @property
    def remote(self) -> bool:
        return bool(self.address)


@dataclass(frozen=True)
class SuffixConfig:
    """Suffix decoding (core.proposers.suffix), named "suffix": the most frequent continuation in tries of this
    request, of the same API key's recent requests and of an optional shared corpus. It runs where the
    coordinator runs (no address): its recent requests are the coordinator's."""

    kind: ClassVar[str] = SUFFIX
    name: str = SUFFIX
    depth: int = 24  # core.proposers.suffix.SuffixSettings
    factor: float = 1.0
    min_prob: float = 0.1
    cache_tokens: int = 32768  # recent requests' tokens held per API key (0: no cross-request trie)
    total_cache_tokens: int = 131072  # all keys' together; the least recently used keys go first
    corpus: str | None = None  # a UTF-8 text file indexed once, read-only, for every key
    corpus_tokens: int = 65536  # the most tokens of the corpus indexed (a longer corpus is refused)

    @property
    def address(self) -> tuple[str, ...]:
        return ()

    @property
    def remote(self) -> bool:
        return False


# The statistical drafters: leaves of the cascade that draft without a model and never review. They
# are variants of one family (engine.leaves.LEAVES builds each kind's per-request drafter); no
# subclassing between them, each with its own settings and tables.
StatisticalConfig = MaGConfig | SuffixConfig
STATISTICAL_KINDS = (MAG, SUFFIX)


ADDRESS = re.compile(r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})")


def parse_addresses(value: Any, where: str) -> tuple[str, ...]:
    """`address`: one host:port, or a non-empty list of distinct ones (replicas)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or len(set(map(str, items))) != len(items):
        raise ConfigError(f"{where} must be host:port or a list of distinct host:port, got {value!r}")
    for item in items:
        match = ADDRESS.fullmatch(item) if isinstance(item, str) else None
        if match is None or not 1 <= int(match.group(2)) <= 65535:
            raise ConfigError(f"{where}: {item!r} is not host:port (a port in 1..65535)")
    return tuple(items)


def resolve_path(path: str, base_dir: Path) -> str:
    expanded = Path(expand(path))
    return str(expanded if expanded.is_absolute() else (base_dir / expanded))


def mapping_at(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def only_keys(mapping: dict, prefix: str, allowed: set[str]) -> None:
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise ConfigError(f"unknown field {prefix}{unknown[0]} (allowed: {', '.join(sorted(allowed))})")


def check_int(value: Any, where: str, lo: int, hi: int) -> None:
    if not is_integer(value) or not lo <= value <= hi:
        raise ConfigError(f"{where} must be an integer in [{lo}, {hi}], got {value!r}")
