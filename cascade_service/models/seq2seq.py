"""Encoder-decoder models (T5, FLAN-T5, BART, Marian) as cascade tiers.

The cascade extends one token sequence: the encoder's input, the model's `decoder_start_token_id`,
then the decoder's tokens (core.encdec).

Per request and tier the encoder runs once (`Seq2SeqScorer`): its output is kept with the request's
cache (`Seq2SeqCache`, transformers' `EncoderDecoderCache` plus that output), the cross-attention
keys are computed once from it, and the decoder's self-attention cache grows and is cropped on
rejection exactly as a decoder-only model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AutoModelForSeq2SeqLM, DynamicCache, EncoderDecoderCache

from cascade_service.core.types import Context

from .cachearg import cache_kwargs
from .hf import MODEL_KINDS, HFModel, HFScorer
from .kvpool import KVCache
from .poolpass import PoolPass
from .rows import last_rows


class Seq2SeqCache(EncoderDecoderCache):
    """One request's decoder cache on an encoder-decoder tier, with its encoder's output."""

    def __init__(self, encoder_out: torch.Tensor | None = None):
        super().__init__(DynamicCache(), DynamicCache())
        self.encoder_out = encoder_out  # [1, S_enc, d] of the request's encoder input


def encode(model: HFModel, encoder_ids: Sequence[int]) -> torch.Tensor:
    """The encoder's output for one request, [1, S, d] on the model's device."""
    ids = torch.tensor([list(encoder_ids)], dtype=torch.long, device=model.device)
    with torch.inference_mode():
        return model.module.get_encoder()(input_ids=ids).last_hidden_state


def forward(
    model: HFModel, tokens: Sequence[int], cache: Seq2SeqCache, keep: int, with_hidden: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A cached decoder pass of one request: `tokens` extend what `cache` holds; the last `keep` rows."""
    if cache.encoder_out is None:
        raise ValueError(f"{model.name}: a decoder pass before the request's encoder ran")
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=model.device)
    out = model.module(
        encoder_outputs=(cache.encoder_out,),
        decoder_input_ids=ids,
        **cache_kwargs(model.module, cache),
        use_cache=True,
        output_hidden_states=with_hidden,
    )
    return last_rows(out.logits, out.decoder_hidden_states[-1] if with_hidden else None, keep)


class Seq2SeqScorer(HFScorer):
    """An `HFScorer` over an encoder-decoder model: the decoder's part of each context is scored as a
    decoder-only model's whole context is, after the encoder ran once on the request's input."""

    def __init__(self, model: HFModel, salt: str = ""):
        self._encoder_ids: list[int] | None = None
        self._encoder_out: torch.Tensor | None = None
        super().__init__(model, salt)
        self._seq2seq = model  # the encoder's too, which a scorer's model (ScoredModel) need not have
        assert model.decoder_start is not None  # HFModel.scorer() makes this scorer for such models
        self.start = model.decoder_start

    def logits(self, ctx: Context, n: int) -> torch.Tensor:
        try:
            split = ctx.tokens.index(self.start)
        except ValueError:
            raise ValueError(
                f"{self.name}: an encoder-decoder context needs the decoder start token {self.start} after "
                "the encoder's input"
            ) from None
        encoder_ids = ctx.tokens[:split]
        if encoder_ids != self._encoder_ids:  # a new request's input (or a scorer reused for another)
            self._encoder_ids, self._encoder_out = encoder_ids, encode(self._seq2seq, encoder_ids)
            self.reset()
        return super().logits(Context(ctx.tokens[split:], max(0, ctx.stable - split)), n)

    def reset(self) -> None:
        super().reset()
        self._cache = Seq2SeqCache(self._encoder_out)


class Seq2SeqModel(HFModel):
    """An encoder-decoder tier: its requests' caches hold their encoder output, its passes score the
    decoder (`forward`) one request at a time, its scorer splits each context at the start token."""

    auto = AutoModelForSeq2SeqLM

    def new_cache(self, salt: str = "") -> Seq2SeqCache:
        return Seq2SeqCache()

    def timing_cache(self, prompt: Sequence[int]) -> Seq2SeqCache:
        return Seq2SeqCache(encode(self, prompt))

    def scorer(self, salt: str = "") -> Seq2SeqScorer:
        return Seq2SeqScorer(self)  # no prefix cache: its caches are its own (config: `kv`)

    def full_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        raise ValueError(f"{self.name}: an encoder-decoder model scores a decoder sequence: use scorer()")

    def forward_now(
        self, tokens: Sequence[int], cache: KVCache | PoolPass | None, keep: int, with_hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(cache, Seq2SeqCache)  # new_cache() made it
        return forward(self, tokens, cache, keep, with_hidden)


MODEL_KINDS[True] = Seq2SeqModel
