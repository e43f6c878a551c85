"""A tiny random-weight model family built in-process in seconds, for tests and CI (no downloads).

`target` is a small random LM; `close` and `mid` are the target plus Gaussian weight noise (so they
agree with its greedy choices often / less often, like real drafters of one family); `unrelated` is a
smaller independent init that agrees at about chance. All share one byte-level BPE tokenizer.
`arch="t5"` builds the same family as encoder-decoder models (T5), whose decoder starts from <pad>.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import json.decoder
import math
import shutil
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    GenerationConfig,
    GPT2Config,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    T5Config,
)
from transformers.utils import logging as hf_logging

from cascade_service.core.types import Context
from cascade_service.models.hf import HFModel

PAD, BOS, EOS = "<pad>", "<s>", "</s>"  # ids 0, 1, 2: trained first, so fixed
ARCHS = ("llama", "qwen2", "gpt2", "t5")
VOCAB_SIZE = 320  # 256 bytes + 3 specials + 61 merges: keeps the models tiny, any text encodable
_BUILDER_VERSION = 1  # bump when the weights a spec produces change
# Random LMs at the usual init (std 0.02) have near-uniform logits whose top-2 margins sit at float
# rounding level, so a block forward and an incremental one could pick different argmaxes. A large
# output-head gain makes logits std ~ this value: margins are orders of magnitude above rounding.
_HEAD_GAIN = 10.0
# T5 ties its head to the token table (transformers 5 always does), so the head's gain is the table's
# too, and a large one makes the model copy its input; half of it, with a quarter of the drafters'
# weight noise, gives varied continuations that the drafters follow a third of the time.
_T5_HEAD_GAIN, _T5_NOISE = 5.0, 0.25


@dataclass(frozen=True)
class TierSpec:
    """How one member of the family is made."""

    hidden: int
    layers: int
    heads: int
    noise: float | None  # relative weight noise on top of the target; None = independent init
    seed_offset: int


TIERS = {
    "target": TierSpec(hidden=64, layers=3, heads=4, noise=None, seed_offset=0),
    "close": TierSpec(hidden=64, layers=3, heads=4, noise=0.04, seed_offset=1),
    "mid": TierSpec(hidden=64, layers=3, heads=4, noise=0.10, seed_offset=2),
    "unrelated": TierSpec(hidden=32, layers=1, heads=2, noise=None, seed_offset=3),
}


def _corpus() -> list[str]:
    # Stdlib sources: a few tens of KB of English + code, deterministic for a given Python.
    return [inspect.getsource(module) for module in (textwrap, json, json.decoder)]


def build_tokenizer(out_dir: str | Path, vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE (256 byte symbols + merges + 3 specials) and save it."""
    if vocab_size < 259:
        raise ValueError(f"vocab_size must cover 256 bytes + 3 specials, got {vocab_size}")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        # Every byte is a symbol, so any text round-trips even with a tiny merge table.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def _config(arch: str, tier: TierSpec, vocab_size: int, tokenizer: PreTrainedTokenizerFast):
    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,  # the head gets its own (large) init, see _HEAD_GAIN
    )
    if arch == "t5":  # encoder-decoder: the decoder starts from <pad>, as T5's does
        config = T5Config(
            vocab_size=vocab_size,
            d_model=tier.hidden,
            d_kv=tier.hidden // tier.heads,
            d_ff=2 * tier.hidden,
            # Tied embeddings (transformers 5 ties T5's always); unscaled decoder outputs, as T5 v1.1.
            num_layers=tier.layers,
            num_decoder_layers=tier.layers,
            num_heads=tier.heads,
            **ids,
        )
        config.decoder_start_token_id = tokenizer.pad_token_id
        return config
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size,
            n_embd=tier.hidden,
            n_layer=tier.layers,
            n_head=tier.heads,
            n_positions=2048,
            **ids,
        )
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    return config_class(
        vocab_size=vocab_size,
        hidden_size=tier.hidden,
        intermediate_size=2 * tier.hidden,
        num_hidden_layers=tier.layers,
        num_attention_heads=tier.heads,
        num_key_value_heads=max(1, tier.heads // 2),
        max_position_embeddings=4096,
        **ids,
    )


def _init_weights(module: PreTrainedModel, seed: int) -> None:
    # Our own init instead of HF's: independent of the library version, and peaky on purpose.
    gen = torch.Generator().manual_seed(seed)
    hidden = module.config.hidden_size
    head = module.get_output_embeddings().weight
    gain = _T5_HEAD_GAIN if module.config.is_encoder_decoder else _HEAD_GAIN
    # Token and (GPT-2) position tables at unit scale: weak position embeddings let GPT-2 fall into
    # two-token greedy loops.
    tables = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            if param is head:
                param.copy_(noise * gain / math.sqrt(hidden))  # logits std ~ gain
            elif id(param) in tables:
                param.copy_(noise)
            elif param.dim() == 1:
                # Norm gains at 1; biases (Qwen2 q/k/v, GPT-2) non-zero so their code path matters.
                param.copy_(noise * 0.1 if name.endswith("bias") else torch.ones_like(param))
            else:
                param.copy_(noise / math.sqrt(hidden))  # keeps activations O(1) through the layers


def _perturb(module: PreTrainedModel, relative_std: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(module.named_parameters()):
            rms = param.float().pow(2).mean().sqrt()
            param.add_(torch.randn(param.shape, generator=gen) * relative_std * rms)


def _spec(arch: str, seed: int, vocab_size: int) -> dict:
    corpus = hashlib.sha256("".join(_corpus()).encode()).hexdigest()
    return {
        "builder": _BUILDER_VERSION,
        "arch": arch,
        "seed": seed,
        "vocab_size": vocab_size,
        "transformers": transformers.__version__,
        "corpus_sha256": corpus,
        "tiers": {name: asdict(tier) for name, tier in TIERS.items()},
    }


def build_family(out_dir: str | Path, seed: int = 0, arch: str = "llama") -> dict[str, Path]:
    """Write `target`, `close`, `mid` and `unrelated` HF model directories under `out_dir`.

    Each is a standard local model dir (config.json, model.safetensors, generation_config.json with
    eos, tokenizer files). A family already built there with the same spec is reused.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    out = Path(out_dir)
    paths = {name: out / name for name in TIERS}
    spec = _spec(arch, seed, VOCAB_SIZE)
    marker = out / "family.json"
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return paths
    marker.unlink(missing_ok=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # four "Writing model shards" bars per build are only noise
    try:
        _write_models(paths, arch, seed, build_tokenizer(out / "tokenizer", VOCAB_SIZE))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    # Written last: a half-built family (crash, Ctrl-C) is never mistaken for a complete one.
    marker.write_text(json.dumps(spec, indent=1))
    return paths


def _write_models(paths: dict[str, Path], arch: str, seed: int, tokenizer: PreTrainedTokenizerFast) -> None:
    vocab_size = len(tokenizer)
    target = None
    for name, tier in TIERS.items():
        if tier.noise is None:
            auto = AutoModelForSeq2SeqLM if arch == "t5" else AutoModelForCausalLM
            module = auto.from_config(_config(arch, tier, vocab_size, tokenizer))
            _init_weights(module, seed * 1000 + tier.seed_offset)
        else:
            assert target is not None  # TIERS lists the target first
            module = copy.deepcopy(target)
            _perturb(module, tier.noise * (_T5_NOISE if arch == "t5" else 1.0), seed * 1000 + tier.seed_offset)
        if target is None:
            target = module
        module.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            decoder_start_token_id=getattr(module.config, "decoder_start_token_id", None),
        )
        shutil.rmtree(paths[name], ignore_errors=True)
        module.save_pretrained(paths[name])
        tokenizer.save_pretrained(str(paths[name]))


def random_prompts(count: int, length: int, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> list[list[int]]:
    """Deterministic random prompts of ordinary (non-special) token ids."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (length,), generator=gen).tolist() for _ in range(count)]


def greedy_tokens(model: HFModel, prompt_ids: Sequence[int], steps: int) -> list[int]:
    """`steps` greedy tokens after the prompt, decoded incrementally with a KV cache (no eos stop)."""
    scorer = model.scorer()
    ctx = Context(list(prompt_ids), len(prompt_ids))
    out: list[int] = []
    for _ in range(steps):
        token = int(scorer.logits(ctx, 1)[0].argmax())
        out.append(token)
        ctx = Context(ctx.tokens + [token], len(ctx) + 1)
    return out


def agreement(model_a: HFModel, model_b: HFModel, prompts_ids: Sequence[Sequence[int]], steps: int) -> float:
    """Fraction of positions along model_a's greedy trajectories where model_b's argmax is the same."""
    matched = total = 0
    for prompt in prompts_ids:
        chosen = greedy_tokens(model_a, prompt, steps)
        # One forward of b over the whole trajectory scores every position at once.
        rows = model_b.full_logits(list(prompt) + chosen)[len(prompt) - 1 : -1]  # [steps, V]
        matched += sum(int(a == b) for a, b in zip(chosen, rows.argmax(-1).tolist()))
        total += steps
    return matched / total if total else 0.0
