"""Structured output: a request's response format (a JSON schema, any JSON object, a regular expression
or a Lark grammar) as a token mask on the target's distribution at the final review.

The grammar engine is llguidance (a 3 MB wheel with no dependencies; JSON schema, regex and Lark natively;
it computes a mask in tens of microseconds and validates a run of tokens in one call; against xgrammar and
outlines-core: docs/benchmarks.md "Structured output"). Per request, one
matcher follows the committed output. Each round, the draft block ends at its first token the grammar
refuses (that token stays only where the review must reject it: CascadeTier._masked), the matcher walks
the rest to give the mask of every position of the review, and rolls back; the final review scores the
target's distribution with the tokens outside each position's mask removed (after logit_bias and the
penalties, before temperature, as a `transformers` logits processor would), and the matcher then takes
the emitted tokens. So the output is distributed exactly as the masked target's, and greedy output is
the target's greedy path under the grammar. What the grammar forces next (a schema's keys, quotes and
commas) opens each block as free drafts, ahead of the drafters (jump-forward decoding, reviewed like any
draft). Every tier in this process masks
with the same state: a model drafter's distribution at each step (so it proposes only what the grammar
allows, and its rows say so), an inner reviewer's at each review position, each walking the drafts
before it first and rolling back. A model drafter on a tier server masks with a state of its own, which
follows the committed output each call carries (`GrammarSpec`, transport.grammars). Statistical drafters
(MaG, lookups, predictions) draft unmasked: their drafts are judged at the next review, where a refused
draft is never kept.
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


# A JSON format's whitespace outside strings -> llguidance's JSON compile options. Compact by default, as
# OpenAI's strict mode answers: with free whitespace a weak model can fill its budget with runs of spaces
# and newlines between keys (the shipped family at max_tokens 96: 3 of 6 outputs unparsed, issue 48),
# and every such token costs a target round. "spaced" is Python's json.dumps layout (", " and ": ").
# These are the compiler's defaults: a schema's own "x-guidance" options still win over them.
WHITESPACE: dict[str, dict[str, Any]] = {
    "compact": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
    "spaced": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    "free": {"whitespace_flexible": True},
}
DEFAULT_WHITESPACE = "compact"


def _schema(text: str, whitespace: str) -> str:
    import llguidance

    options: Any = WHITESPACE[whitespace]  # llguidance's JsonCompileOptions (a TypedDict)
    return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options)


def _regex(text: str, _whitespace: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_regex(text)


def _lark(text: str, _whitespace: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(text)


# A response format's kind -> its grammar, from the format's text and whitespace (json_object: any JSON
# object; the whitespace style is only for the JSON kinds).
FORMATS: dict[str, Callable[[str, str], str]] = {
    "json_schema": _schema,
    "json_object": lambda _text, whitespace: _schema('{"type": "object"}', whitespace),
    "regex": _regex,
    "lark": _lark,
}
JSON_FORMATS = frozenset({"json_schema", "json_object"})


@dataclass(frozen=True)
class ResponseFormat:
    """What a request's output must be: `kind` (one of FORMATS) and its text (the schema as JSON, the
    regular expression, the Lark grammar; empty for json_object); for the JSON kinds, the whitespace
    allowed outside strings (one of WHITESPACE; empty: DEFAULT_WHITESPACE)."""

    kind: str
    text: str = ""
    whitespace: str = ""

    def __post_init__(self) -> None:
        if self.kind not in FORMATS:
            raise ValueError(f"response_format must be one of {', '.join(FORMATS)}, got {self.kind!r}")
        if not isinstance(self.text, str) or len(self.text.encode()) > MAX_FORMAT_BYTES:
            raise ValueError(f"response_format: at most {MAX_FORMAT_BYTES} bytes of {self.kind}")
        if self.whitespace and self.whitespace not in WHITESPACE:
            raise ValueError(
                f"response_format.whitespace must be one of {', '.join(WHITESPACE)}, got {self.whitespace!r}"
            )
        if self.whitespace and self.kind not in JSON_FORMATS:
            raise ValueError(f"response_format.whitespace applies to json_schema and json_object, not {self.kind}")
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
        return _compiled(self.kind, self.text, self.whitespace or DEFAULT_WHITESPACE)


@functools.lru_cache(maxsize=256)
def _compiled(kind: str, text: str, whitespace: str) -> str:
    import llguidance

    try:
        grammar = FORMATS[kind](text, whitespace)
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


@dataclass(frozen=True)
class GrammarSpec:
    """A request's grammar as it crosses the tier wire (transport.codec): its response format, where the
    output starts in the context (`start`) and how far the committed sequence reaches (`at`). A tier
    server rebuilds or advances its own GrammarMask from it (tierhost.group), so its drafter masks too."""

    response_format: ResponseFormat
    start: int
    at: int


class GrammarMask:
    """One request's grammar state along its committed output (see the module doc). `start`: where the
    output begins in the context (the prompt's length), so a tier elsewhere can replay it (`spec`)."""

    def __init__(self, tokenizer: Any, response_format: ResponseFormat, vocab_size: int, start: int = 0):
        import llguidance

        self.response_format = response_format
        self.matcher = llguidance.LLMatcher(tokenizer, response_format.grammar())
        self.vocab_size = vocab_size
        self.start = start
        self.at = start  # see anchor
        self._bits = torch.arange(32, dtype=torch.int64)

    def anchor(self, length: int) -> None:
        """The length of the context the matcher's state stands at (the committed sequence: the target's
        round starts there); what a tier's context holds past it is the tail `masks` walks first."""
        self.at = length

    def masks(self, context: Sequence[int], block: Sequence[int]) -> tuple[int, torch.Tensor] | None:
        """For a review of `block` after `context` (the committed sequence, then a tail of drafts): how
        many of the block's leading tokens the grammar takes, and [that + 1, V] bool, the tokens allowed
        at each review position. None when the tail itself breaks the grammar. The state is rolled back."""
        tail = list(context[self.at :])
        walk = tail + list(block)
        valid = self.matcher.validate_tokens(walk) if walk else 0
        if valid < len(tail):
            return None
        pushed = sum(self._step(token) for token in tail)
        rows = [self._allowed()]
        for token in walk[len(tail) : valid]:
            stepped = self._step(token)
            pushed += stepped
            # After the grammar's EOS nothing is kept: that row is never read, and repeats the last.
            rows.append(self._allowed() if stepped else rows[-1])
        if pushed:
            self.matcher.rollback(pushed)
        return valid - len(tail), torch.stack(rows)

    def _step(self, token: int) -> bool:
        """Consume `token` unless the grammar has ended; whether it went into the matcher's history. A
        stopped matcher takes its EOS without recording it, and rolling that back would undo one token
        too many (llguidance 1.9): the state would be wrong from then on."""
        if self.matcher.is_stopped():
            return False
        self.matcher.consume_token(token)
        return True

    def mask(self, context: Sequence[int]) -> torch.Tensor | None:
        """[V] bool: the tokens allowed after `context` (a drafter's next token); None past a refused draft."""
        masked = self.masks(context, ())
        return None if masked is None else masked[1][0]

    def spec(self) -> GrammarSpec:
        return GrammarSpec(self.response_format, self.start, self.at)

    def follow(self, context: Sequence[int], at: int) -> None:
        """Take the committed tokens of `context` up to `at` that this state has not taken yet (a tier
        server's copy, one call behind the coordinator's)."""
        self.advance(context[self.at : at])
        self.at = at

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
