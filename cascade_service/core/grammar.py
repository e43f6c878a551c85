"""Structured output: a request's response format (a JSON schema, any JSON object, a regular expression
or a Lark grammar) as a token mask on the target's distribution at the final review.

The grammar engine is llguidance (a 3 MB wheel with no dependencies; it computes a mask over a 100k
vocabulary in tens of microseconds, and validates a run of tokens in one call). Per request, one
matcher follows the committed output. Each round, the draft block is first cut at its first token the
grammar refuses (no target position is spent on it), then the matcher walks the rest to give the mask of
every position of the review, and rolls back; the final review scores the target's distribution with the
tokens outside each position's mask removed (after logit_bias and the penalties, before temperature, as a
`transformers` logits processor would), and the matcher then takes the emitted tokens. So the output is
distributed exactly as the masked target's, and greedy output is the target's greedy path under the
grammar. What the grammar forces next (a schema's keys, quotes and commas) opens each block as free drafts,
ahead of the drafters (jump-forward decoding, reviewed like any draft); the model drafters then draft
unmasked after it: a draft that breaks the grammar is cut before the review, never kept.
"""

from __future__ import annotations

import functools
import json
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

MAX_FORMAT_BYTES = 64 * 1024  # a schema, regex or grammar; a larger one is refused before it is compiled


def _schema(text: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(text)


def _regex(text: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_regex(text)


def _lark(text: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(text)


# A response format's kind -> its grammar, from the format's text (json_object: any JSON object).
FORMATS: dict[str, Callable[[str], str]] = {
    "json_schema": _schema,
    "json_object": lambda _text: _schema('{"type": "object"}'),
    "regex": _regex,
    "lark": _lark,
}


@dataclass(frozen=True)
class ResponseFormat:
    """What a request's output must be: `kind` (one of FORMATS) and its text (the schema as JSON, the
    regular expression, the Lark grammar; empty for json_object)."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in FORMATS:
            raise ValueError(f"response_format must be one of {', '.join(FORMATS)}, got {self.kind!r}")
        if not isinstance(self.text, str) or len(self.text.encode()) > MAX_FORMAT_BYTES:
            raise ValueError(f"response_format: at most {MAX_FORMAT_BYTES} bytes of {self.kind}")
        if self.kind == "json_schema":
            try:
                json.loads(self.text)
            except ValueError as exc:
                raise ValueError(f"response_format: the JSON schema is not JSON ({exc})") from None
            except RecursionError:  # Python's parser recurses per level; a 64 KiB schema can nest 30,000 deep
                raise ValueError("response_format: the JSON schema is nested too deeply") from None

    def grammar(self) -> str:
        """The llguidance grammar, checked (ValueError naming response_format when it cannot be used).
        Compiled once per format: the coordinator checks it when a request arrives and uses it when the
        request decodes, and clients repeat their schemas."""
        return _compiled(self.kind, self.text)


@functools.lru_cache(maxsize=256)
def _compiled(kind: str, text: str) -> str:
    import llguidance

    try:
        grammar = FORMATS[kind](text)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"response_format: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"response_format: {error}")
    return grammar


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammar_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of a `transformers` tokenizer, built once per tokenizer."""
    import llguidance.hf

    if tokenizer not in _TOKENIZERS:
        _TOKENIZERS[tokenizer] = llguidance.hf.from_tokenizer(tokenizer)
    return _TOKENIZERS[tokenizer]


class GrammarMask:
    """One request's grammar state along its committed output (see the module doc)."""

    def __init__(self, tokenizer: Any, grammar: str, vocab_size: int):
        import llguidance

        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        self.vocab_size = vocab_size
        self._bits = torch.arange(32, dtype=torch.int64)

    def review_masks(self, block: Sequence[int]) -> tuple[int, torch.Tensor]:
        """(how many of the block's leading tokens the grammar takes, [that + 1, V] bool: the tokens
        allowed at each review position)."""
        valid = self.matcher.validate_tokens(list(block)) if block else 0
        rows = [self._allowed()]
        for token in block[:valid]:
            self.matcher.consume_token(token)
            rows.append(self._allowed())
        if valid:
            self.matcher.rollback(valid)
        return valid, torch.stack(rows)

    def forced(self, limit: int) -> list[int]:
        """At most `limit` tokens the grammar forces next (a JSON schema's keys and punctuation): the
        matcher's fast-forward tokens. They are the block's first drafts (core.cascade): the target's
        review still judges them, since the grammar may allow other tokenizations of the same bytes."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return [t for t in self.matcher.compute_ff_tokens() if t < self.vocab_size][:limit]

    def advance(self, tokens: Sequence[int]) -> None:
        """The emitted tokens (each within its position's mask) join the matcher's state."""
        for token in tokens:
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    def _allowed(self) -> torch.Tensor:
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32).to(torch.int64)
        bits = ((words[:, None] >> self._bits) & 1).flatten().bool()
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        n = min(self.vocab_size, bits.numel())
        allowed[:n] = bits[:n]
        return allowed
