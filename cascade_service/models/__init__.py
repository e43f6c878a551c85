"""Model adapters: the only layer that imports transformers (a test enforces it)."""

from . import hf, seq2seq  # noqa: F401 - seq2seq adds the encoder-decoder kind to hf.MODEL_KINDS
