"""Start-up checks of the model tiers a process is about to load, made before any weights are read.

Each failure is a ConfigError naming the tier and its config key, e.g.
    tiers.drafters[1].device (tier 'small'): cuda:7 does not exist (this machine has 2 CUDA devices)
- a tier's device exists on this machine (checked in the process that loads the tier: a Ray driver
  may have no GPU while the tier's replica has one);
- every tier shares the target's vocabulary: config.json's vocab_size, and the token -> id map where
  both directories ship a tokenizer (token ids are what tiers exchange);
- every model tier is of the target's kind, encoder-decoder or decoder-only (they extend one sequence
  with one meaning: models.seq2seq).
Unknown dtypes and malformed devices are refused earlier, when the config is parsed (config.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from .config import CascadeConfig, ConfigError, ModelTierConfig
from .models.hf import config_vocab_size, is_encoder_decoder, resolve_device, same_tokenizer


def where(tier: ModelTierConfig, field: str, fallback: str = "") -> str:
    """`tiers.drafters[1].device (tier 'small')`: the key of a tier's field, and the tier's name."""
    key = tier.key or fallback
    return f"{key}.{field} (tier {tier.name!r})" if key else f"tier {tier.name!r} {field}"


def tier_device(tier: ModelTierConfig, fallback_key: str = "", hint: str = "") -> torch.device:
    """The device `tier` runs on in this process; ConfigError (with `hint` appended) if it is not here."""
    try:
        return resolve_device(tier.device)
    except ValueError as exc:
        raise ConfigError(f"{where(tier, 'device', fallback_key)}: {exc}{hint}") from None


def model_tiers(cascade: CascadeConfig) -> list[tuple[str, ModelTierConfig]]:
    """(config key, tier) for the target and every model drafter; the key a tier built in code would
    have had in a config file."""
    keyed = [("tiers.target", cascade.target)]
    keyed += [(f"tiers.drafters[{i}]", d) for i, d in enumerate(cascade.drafters) if isinstance(d, ModelTierConfig)]
    return keyed


def check_devices(cascade: CascadeConfig) -> None:
    """Every model tier's device exists in this process (before any tier loads: the first bad one fails).
    A tier named by address runs on its tier server, which checks its own."""
    for key, tier in model_tiers(cascade):
        if not tier.remote:
            tier_device(tier, key)


def check_vocabularies(cascade: CascadeConfig, sizes: Mapping[str, int] | None = None, tokenizers: bool = True) -> None:
    """Every drafter's vocabulary is the target's.

    sizes: tier name -> vocabulary size of the loaded tiers (a Ray coordinator asks its replicas);
    None: read from the model directories (a directory this process cannot read is skipped: the
    process that loads it checks it). tokenizers: compare the tokenizers too.
    """
    if sizes is None:
        sizes = {t.name: n for _, t in model_tiers(cascade) if t.path and (n := config_vocab_size(t.path)) is not None}
    target = cascade.target
    for key, tier in model_tiers(cascade)[1:]:
        if target.name in sizes and tier.name in sizes and sizes[tier.name] != sizes[target.name]:
            raise ConfigError(
                f"{where(tier, 'path', key)}: a vocabulary of {sizes[tier.name]} tokens, the target's "
                f"({where(target, 'path', 'tiers.target')}) has {sizes[target.name]}: "
                "every tier must share the target's vocabulary"
            )
        if not (tokenizers and tier.path and target.path and Path(tier.path).is_dir() and Path(target.path).is_dir()):
            continue
        if same_tokenizer(tier.path, target.path) is False:
            raise ConfigError(
                f"{where(tier, 'path', key)}: its tokenizer maps tokens to other ids than the "
                f"target's ({where(target, 'path', 'tiers.target')}): every tier must share the "
                "target's vocabulary"
            )


def check_kinds(cascade: CascadeConfig) -> None:
    """Every model tier is encoder-decoder if the target is, decoder-only if it is not (config.json's
    is_encoder_decoder; a tier without a readable directory is checked where it loads)."""
    target = cascade.target
    if not (target.path and Path(target.path).is_dir()):
        return
    kind = is_encoder_decoder(target.path)
    names = {True: "an encoder-decoder model", False: "a decoder-only model"}
    for key, tier in model_tiers(cascade)[1:]:
        if tier.path and Path(tier.path).is_dir() and is_encoder_decoder(tier.path) != kind:
            raise ConfigError(
                f"{where(tier, 'path', key)}: {names[not kind]}, the target "
                f"({where(target, 'path', 'tiers.target')}) is {names[kind]}: a cascade's model tiers "
                "must all be encoder-decoder or all decoder-only"
            )


def check_tiers(cascade: CascadeConfig) -> None:
    """The checks, devices first (they cost nothing); call before loading any tier."""
    check_devices(cascade)
    check_kinds(cascade)
    check_vocabularies(cascade)
