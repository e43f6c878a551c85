"""Hugging Face causal LMs as cascade tiers: a shared loaded model and a per-request KV-cached scorer."""

from __future__ import annotations

import functools
import inspect
import json
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel
from transformers.utils import logging as hf_logging

from ..core.tier import TierFacts
from ..metrics import Metrics, default_metrics
from .batching import Pass, PassQueue, forward_batch
from .cachearg import cache_kwargs
from .cpukernels import fast_cpu_linears, packed_parameters
from .graphs import GRAPH_MODES
from .kvpool import STORAGES, KVCache, PagedCache
from .kvsize import kv_pool
from .lean import BACKENDS
from .poolpass import PoolPass, pool_attention
from .rows import last_rows
from .scorer import HFScorer
from .staticpass import StaticRunner

T = TypeVar("T")

_DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "auto": "auto",  # whatever config.json records
}
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# 5.x renamed from_pretrained's `torch_dtype` to `dtype` (the old name is deprecated); 4.x knows only it.
DTYPE_KWARG = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


def _parse_dtype(dtype: str) -> torch.dtype | str:
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_device(device: str) -> torch.device:
    """ "cpu" | "cuda" | "cuda:N" | "auto" -> the device it names on this machine.

    Raises ValueError for another string and for a CUDA device this machine does not have, so a
    tier fails before its weights are read rather than in `.to()` after.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        raise ValueError(f"unknown device {device!r}; expected cpu, cuda, cuda:N or auto")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (resolved.index or 0) >= count:
            raise ValueError(
                f"{device} does not exist (this machine has {count} CUDA device{'' if count == 1 else 's'})"
            )
    return resolved


def _config_json(path: str | Path) -> dict:
    """A model directory's config.json (no weights read); {} when there is none to read: loading
    the directory then fails with its own error."""
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def is_encoder_decoder(path: str | Path) -> bool:
    """Whether a model directory's config.json records an encoder-decoder model."""
    return bool(_config_json(path).get("is_encoder_decoder", False))


def config_vocab_size(path: str | Path) -> int | None:
    """The vocabulary size a model directory's config.json records; None if none."""
    config = _config_json(path)
    size = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    return size if isinstance(size, int) else None


def same_tokenizer(a: str | Path, b: str | Path) -> bool | None:
    """Whether two model directories ship the same token -> id map; None when either ships none."""
    files = [Path(p).expanduser() / "tokenizer.json" for p in (a, b)]
    if all(f.is_file() for f in files) and files[0].read_bytes() == files[1].read_bytes():
        return True  # the common case (one family, one tokenizer file): no tokenizer to load
    if not all(any((Path(p).expanduser() / f).is_file() for f in _TOKENIZER_FILES) for p in (a, b)):
        return None
    return load_tokenizer(a).get_vocab() == load_tokenizer(b).get_vocab()


def _local_dir(path: str | Path) -> Path:
    # A string that is not a local directory is refused rather than treated as a hub id: the service
    # must never download weights behind the operator's back.
    local = Path(path).expanduser()
    if not local.is_dir():
        raise FileNotFoundError(f"model directory {str(local)!r} does not exist (hub ids are not loaded)")
    if not (local / "config.json").is_file():
        raise FileNotFoundError(f"{str(local)!r} has no config.json; not a Hugging Face model directory")
    return local


def _decoder_start(config: Any, name: str) -> int:
    """The token an encoder-decoder model's decoder starts from (its config's decoder_start_token_id)."""
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(config, "pad_token_id", None)  # T5's convention, and BART's fallback
    if start is None:
        raise ValueError(f"{name}: an encoder-decoder model without a decoder_start_token_id")
    return int(start)


def _eos_ids(module: PreTrainedModel) -> set[int]:
    ids: set[int] = set()
    for cfg in (getattr(module, "generation_config", None), module.config):
        value = getattr(cfg, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return ids


def load_tokenizer(path: str | Path):
    """Load the tokenizer stored in a local model directory (never from the hub)."""
    return AutoTokenizer.from_pretrained(_local_dir(path), local_files_only=True)


class HFModel:
    """One loaded tier, shared read-only across requests; each request gets its own `scorer()`.
    A decoder-only model; an encoder-decoder one is `models.seq2seq.Seq2SeqModel` (`MODEL_KINDS`)."""

    auto: Any = AutoModelForCausalLM  # the transformers class its weights load with

    def __init__(self, module: PreTrainedModel, name: str, kv: str = "pool", kv_budget_mb: float | None = None):
        if kv not in STORAGES:
            raise ValueError(f"unknown kv storage {kv!r}; expected one of {sorted(STORAGES)}")
        self.module = module
        self.name = name
        self.config = module.config
        self.device = next(module.parameters()).device
        self.dtype = next(module.parameters()).dtype
        # An encoder-decoder model's (T5, BART, Marian: models.seq2seq) decoder start token: a request's
        # context is its prompt, then this (core.encdec). None for a decoder-only model.
        self.decoder_start: int | None = (
            _decoder_start(module.config, name) if getattr(module.config, "is_encoder_decoder", False) else None
        )
        # Where requests' KV caches live (models.kvpool): blocks of one paged pool with a prefix cache,
        # read in place ("pool"), or a DynamicCache each, packed per batched pass ("dynamic").
        self.kv = kv
        self.backend = "hf"  # the forward it runs (models.lean.BACKENDS), set by `load`
        self.kv_pool = kv_pool(module.config, self.dtype, self.device, kv_budget_mb, name)
        metrics = default_metrics()
        self.kv_pool.report = lambda event, amount: metrics.kv_event(name, event, amount)
        head = module.get_output_embeddings()
        # out_features: an int8 head (models.cpukernels) keeps its weight packed, not as `.weight`
        self.vocab_size: int = head.out_features if head is not None else module.config.vocab_size
        self.num_parameters: int = sum(p.numel() for p in module.parameters()) + packed_parameters(module)
        self.eos_token_ids: set[int] = _eos_ids(module)
        # The positions the model holds: a learned position table (GPT-2's n_positions) indexes out of
        # range past it, and rotary models were never trained there. None: the config names no limit.
        positions = getattr(module.config, "max_position_embeddings", None) or getattr(
            module.config, "n_positions", None
        )
        self.max_positions: int | None = int(positions) if positions else None
        # A prefill of a long prompt would otherwise materialise [S, V] logits only to drop all but n.
        self._keeps_logits = "logits_to_keep" in inspect.signature(module.forward).parameters
        self._step_times: dict[int, float] = {}
        self._blocks_seen: tuple[Metrics, tuple[int, int, int]] | None = None  # the KV gauges last set (record_pass)
        # Once the engine joins it (engine.core.join_loop): where its passes wait for the engine's batched step.
        self.batcher: PassQueue | None = None
        self.static: StaticRunner | None = None  # its fixed-shape passes (GRAPH_MODES, `use_graphs`); None: none

    def use_graphs(self, mode: str) -> None:
        """Run this model's passes that fit a bucket in fixed shapes (models.graphs.GRAPH_MODES:
        "auto" captures CUDA graphs on cuda, "eager" runs the same shapes uncaptured, "off" neither).
        Only a pool's passes have fixed-shape indices: other storages ignore it."""
        if mode not in GRAPH_MODES:
            raise ValueError(f"unknown graphs mode {mode!r}; expected one of {sorted(GRAPH_MODES)}")
        usable = self.prefix_caching
        self.static = GRAPH_MODES[mode](self.module, self.kv_pool, self.dtype, self.device) if usable else None

    def record_pass(self, metrics: Metrics, rows: int, seconds: float) -> None:
        """A batched pass of `rows` rows took `seconds`: the metrics of it and of the KV pool after it."""
        metrics.forward_pass(self.name, rows, seconds)
        if self.prefix_caching:
            pool = self.kv_pool
            blocks = (pool.held, len(pool.cached), pool.free_blocks())
            seen = self._blocks_seen  # most passes change none (a block holds 16 tokens): three gauges spared
            if seen is None or seen[0] is not metrics or seen[1] != blocks:
                self._blocks_seen = (metrics, blocks)
                metrics.kv_blocks(self.name, *blocks)

    @property
    def encoder_decoder(self) -> bool:
        """An encoder-decoder model keeps an encoder output and a decoder cache per request, and its
        passes run one request at a time (models.seq2seq)."""
        return self.decoder_start is not None

    @property
    def prefix_caching(self) -> bool:
        """Whether requests reuse the KV of earlier ones' prefixes (models.kvpool): a paged pool's."""
        return self.kv == "pool" and not self.encoder_decoder

    def new_cache(self, salt: str = "") -> KVCache:
        """An empty KV cache for one request, in this model's storage; `salt` (the API key's) scopes
        the prefixes it may reuse and publish."""
        return PagedCache(self.kv_pool, salt) if self.kv == "pool" else DynamicCache()

    def timing_cache(self, prompt: Sequence[int]) -> KVCache:
        """A cache to time passes with (`pass_time_s`): a new one; an encoder-decoder model's also
        holds the encoder's output for `prompt`."""
        return self.new_cache()

    def forward(self, tokens: Sequence[int], cache: KVCache, keep: int, with_hidden: bool = False, chain: int = 1):
        """A cached forward pass for one request: in the engine loop once batching is on. `chain` > 1:
        then that many greedy draft steps on the device, (tokens, probabilities) back (models.chain)."""
        if self.batcher is None:  # a batch of one, now (in the loop, the executor enters inference mode)
            with torch.inference_mode():
                return forward_batch(self, [Pass(list(tokens), cache, keep, with_hidden, chain=chain)])[0]
        if not isinstance(cache, PagedCache):
            return self.batcher.forward(tokens, cache, keep, with_hidden, chain)
        cache.pinned += 1  # queued: the pool never preempts a cache a pending pass was planned on
        try:
            return self.batcher.forward(tokens, cache, keep, with_hidden, chain)
        finally:
            cache.pinned -= 1

    @classmethod
    def load(
        cls,
        path: str | Path,
        dtype: str = "float32",
        device: str = "cpu",
        name: str | None = None,
        backend: str = "hf",
        kv: str = "pool",
        kv_budget_mb: float | None = None,
        graphs: str = "auto",
    ) -> HFModel:
        """Load a local Hugging Face model directory in eval mode on `device`.

        dtype: "float32" | "float16" | "bfloat16" | "auto"; device: "cpu" | "cuda" | "cuda:N" | "auto";
        backend: the forward that runs it (models.lean.BACKENDS: "hf", or "lean" for a drafter);
        kv: where requests' KV caches live (models.kvpool.STORAGES: "pool" or "dynamic");
        kv_budget_mb: the most its pool holds (None: models.kvsize.default_budget);
        graphs: how passes run in fixed shapes (models.graphs.GRAPH_MODES: "auto", "eager", "off").
        Raises ValueError for other values and FileNotFoundError when `path` is not a model directory.
        """
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {sorted(BACKENDS)}")
        if graphs not in GRAPH_MODES:  # before the weights load
            raise ValueError(f"unknown graphs mode {graphs!r}; expected one of {sorted(GRAPH_MODES)}")
        torch_dtype = _parse_dtype(dtype)
        target = resolve_device(device)
        local = _local_dir(path)
        hf_logging.disable_progress_bar()  # a "Loading weights" bar per tier per process is only noise
        kind = MODEL_KINDS[is_encoder_decoder(local)]  # chosen once, here: HFModel or Seq2SeqModel
        module = kind.auto.from_pretrained(local, local_files_only=True, **{DTYPE_KWARG: torch_dtype})
        module.eval().to(target)
        runs = BACKENDS[backend](module)
        fast_cpu_linears(runs)  # on the CPU, the faster product for few rows (models.cpukernels)
        model = kind(runs, name or local.resolve().name, kv, kv_budget_mb)
        model.backend = backend
        model.use_graphs(graphs)
        return model

    def facts(self) -> TierFacts:
        """What a coordinator needs to know of this tier (core.tier.TierFacts)."""
        return TierFacts(
            self.vocab_size,
            self.num_parameters,
            tuple(sorted(self.eos_token_ids)),
            self.max_positions,
            str(self.device),
            self.decoder_start,
        )

    def scorer(self, salt: str = "") -> HFScorer:
        """A fresh scorer (own KV cache) for one request; `salt` (its API key's) scopes the prefix
        cache it reads and adds to (models.kvpool)."""
        return HFScorer(self, salt)

    def full_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Plain no-cache forward: [len(tokens), V] float32 logits on the model's device."""
        with torch.inference_mode():
            logits = self.forward_now(tokens, None, len(tokens))
        assert isinstance(logits, torch.Tensor)  # without hidden states
        return logits

    def step_time_s(self, context_len: int = 64, repeats: int = 7) -> float:
        """Median wall time of one single-token decode step over a `context_len`-token KV cache.

        Measured once per context length (after warm-up) and cached on the object.
        """
        if context_len < 0 or repeats < 1:
            raise ValueError(f"need context_len >= 0 and repeats >= 1, got {context_len}, {repeats}")
        if context_len not in self._step_times:
            measure = functools.partial(self._measure_step, context_len, repeats)
            # On the engine loop's thread once the model serves there (engine.loop.on_loop_thread says why).
            self._step_times[context_len] = self.batcher.call(measure) if self.batcher is not None else measure()
        return self._step_times[context_len]

    def _measure_step(self, context_len: int, repeats: int) -> float:
        return pass_time_s(self, 1, context_len, repeats)

    def sync(self) -> None:
        """Wait for the device's queued work (a pass's time is what it took to finish)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward_now(
        self, tokens: Sequence[int], cache: KVCache | PoolPass | None, keep: int, with_hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One request's pass now, on the calling thread: what a batch of one runs (models.batching),
        and the timers. A request's tiers call `forward`, which takes its turn in the engine loop."""
        if isinstance(cache, PagedCache):
            # A lone row over its blocks: the model makes its mask and positions from the cache's
            # length, as over a DynamicCache (models.kvpool.PoolPass).
            with self.kv_pool.lock:
                step = PoolPass(self.kv_pool, [cache], len(tokens))
                try:
                    with pool_attention(self):
                        result = self.forward_now(tokens, step, keep, with_hidden)
                except BaseException:
                    step.abandon()
                    raise
                step.commit([len(tokens)])
            return result
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, S]
        extra = {"logits_to_keep": keep} if self._keeps_logits else {}
        if with_hidden:
            extra["output_hidden_states"] = True
        out = self.module(input_ids=ids, use_cache=cache is not None, **cache_kwargs(self.module, cache), **extra)
        return last_rows(out.logits, out.hidden_states[-1] if with_hidden else None, keep)


def pass_time_s(model: HFModel, rows: int, context_len: int = 64, repeats: int = 7, tokens: int = 1) -> float:
    """Median seconds of one pass feeding `tokens` tokens to each of `rows` requests with `context_len`
    cached (after 2 warm-up passes). One row and one token is `HFModel.step_time_s`; more rows is a
    batched pass (models.batching); more tokens is a review of tokens - 1 drafts."""
    gen = torch.Generator().manual_seed(rows)
    prompts = torch.randint(0, model.vocab_size, (rows, context_len + tokens), generator=gen).tolist()
    caches = [model.timing_cache(prompt[:32]) for prompt in prompts]
    times = []
    with torch.inference_mode():
        for cache, prompt in zip(caches, prompts):
            if context_len:
                model.forward_now(prompt[:context_len], cache, 1)
        for _ in range(2 + repeats):
            batch = [Pass(p[context_len:], c, tokens, False) for p, c in zip(prompts, caches)]
            model.sync()
            began = time.perf_counter()
            forward_batch(model, batch)
            model.sync()
            times.append(time.perf_counter() - began)
            for cache in caches:
                cache.crop(-tokens)  # every repeat decodes against the same cache length
    return statistics.median(times[2:])


# is_encoder_decoder -> the class a model directory loads as; models.seq2seq adds its own (the package
# imports it), so this module never imports that one.
MODEL_KINDS: dict[bool, type[HFModel]] = {False: HFModel}
