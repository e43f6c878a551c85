"""What every part of the config shares: the error type, field checks, and the tiers' own settings."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..paths import expand

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
