"""Reference decoders from `transformers` itself: every call to `generate()` in the project lives here.

The benchmark compares our cascade against these: plain greedy `generate`, assisted generation
(Leviathan-style speculative decoding with a drafter as `assistant_model`, transformers' default
schedule) and prompt-lookup decoding. Forward passes are counted with forward hooks on the top-level
modules, so the counts are the same kind of figure as `CascadeStats` calls (one per model forward).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers.utils import logging as hf_logging

from cascade_service.models.hf import HFModel

PROMPT_LOOKUP_TOKENS = 10  # tokens prompt lookup proposes per step (transformers' documented example)


@dataclass
class HFRun:
    token_ids: list[int]  # generated ids only, EOS included when it came
    target_calls: int  # forward passes of the target module
    drafter_calls: dict[str, int] = field(default_factory=dict)  # assistant name -> forward passes
    first_token_s: float = 0.0  # seconds from the call to the first generated token(s) reaching the streamer
    first_tokens: int = 0  # how many tokens arrived with it (assisted generation streams a round at once)


class _FirstToken:
    """A `generate()` streamer that notes when the first generated tokens arrive and how many.

    generate() hands a decoder-only model's streamer the prompt first, then each step's new tokens; an
    encoder-decoder model's gets its decoder start token first. Either way the second `put` is the first
    output. Nothing else is kept: the tokens come back from generate() itself."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.calls = 0
        self.at = 0.0
        self.tokens = 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.at = time.perf_counter() - self.began
            self.tokens = int(value.numel())

    def end(self) -> None:
        pass


@contextmanager
def count_forwards(modules: Mapping[str, torch.nn.Module]) -> Iterator[dict[str, int]]:
    """Count top-level forward calls of each named module while the block runs."""
    counts = {name: 0 for name in modules}
    handles = []
    for name, module in modules.items():

        def hook(_module, _inputs, _output, name=name):
            counts[name] += 1

        handles.append(module.register_forward_hook(hook))
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def hf_greedy(model: HFModel, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int]) -> HFRun:
    """Plain greedy `generate()` of the target alone."""
    return _generate(model, prompt_ids, max_new_tokens, eos_ids, {}, None)


def hf_sampled(
    model: HFModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    temperature: float,
    seed: int,
) -> HFRun:
    """Plain `generate()` of the target alone, sampling at `temperature` (no top-k or top-p), seeded."""
    torch.manual_seed(seed)
    return _generate(model, prompt_ids, max_new_tokens, eos_ids, {"do_sample": True, "temperature": temperature}, None)


def hf_assisted(
    model: HFModel, assistant: HFModel, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int]
) -> HFRun:
    """Greedy assisted generation with `assistant` as the drafter, on transformers' default schedule.

    The family shares one tokenizer (equal vocabularies), so no `tokenizer`/`assistant_tokenizer` is
    passed: transformers refuses them then, and would take the universal-assisted path with them.
    """
    if assistant.vocab_size != model.vocab_size:
        raise ValueError(
            f"assistant {assistant.name!r} has vocabulary size {assistant.vocab_size}, "
            f"target has {model.vocab_size}: assisted generation needs one shared vocabulary"
        )
    return _generate(model, prompt_ids, max_new_tokens, eos_ids, {"assistant_model": assistant.module}, assistant)


def hf_prompt_lookup(
    model: HFModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    num_tokens: int = PROMPT_LOOKUP_TOKENS,
) -> HFRun:
    """Greedy prompt-lookup decoding (n-gram matches in the context draft, the target verifies).

    Refused for an encoder-decoder model: transformers' prompt lookup then does not keep the model's
    greedy output (on the tiny T5 family its second token already differs from plain `generate()`).
    """
    if model.encoder_decoder:
        raise ValueError(
            f"{model.name}: transformers' prompt lookup does not keep an encoder-decoder model's greedy "
            "output; leave hf-prompt-lookup out (MaG and suffix decoding copy from the input instead)"
        )
    return _generate(model, prompt_ids, max_new_tokens, eos_ids, {"prompt_lookup_num_tokens": num_tokens}, None)


def _generate(
    model: HFModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    extra: dict,
    assistant: HFModel | None,
) -> HFRun:
    if not prompt_ids:
        raise ValueError("prompt must hold at least one token")
    eos = sorted(eos_ids)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)  # [1, S]
    modules = {model.name: model.module}
    if assistant is not None:
        modules[assistant.name] = assistant.module
    first = _FirstToken()
    with torch.inference_mode(), count_forwards(modules) as counts, _quiet():
        out = model.module.generate(  # type: ignore[operator]  # transformers' stubs type generate oddly
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            eos_token_id=eos or None,
            pad_token_id=_pad_id(model, eos),
            streamer=first,
            # Unset sampling knobs a checkpoint's generation_config may carry, so greedy stays plain
            # greedy (and transformers does not warn about flags that greedy ignores), and sampling
            # samples the whole distribution at the temperature asked.
            **{"do_sample": False, "temperature": None, "top_p": None, "top_k": None, **extra},
        )  # [1, S + n]
    drafter_calls = {assistant.name: counts[assistant.name]} if assistant is not None else {}
    # A decoder-only model returns the prompt and what follows; an encoder-decoder one (models.seq2seq)
    # its decoder's sequence, from the decoder start token.
    generated = out[0, 1:] if model.encoder_decoder else out[0, ids.shape[1] :]
    return HFRun(generated.tolist(), counts[model.name], drafter_calls, first.at, first.tokens)


@contextmanager
def _quiet() -> Iterator[None]:
    # Assisted generation calls the assistant's generate() with both a generation_config and loose
    # arguments, and transformers warns about its own call; that line is noise in a benchmark log.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _pad_id(model: HFModel, eos: list[int]) -> int:
    for cfg in (model.module.generation_config, model.config):
        pad = getattr(cfg, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return eos[0] if eos else 0
