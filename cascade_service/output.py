"""A request's output, as it streams and as one reply: the text (incremental detokenization), the
stop-string cut, the end-of-sequence finish and the logprobs of the tokens kept (`Output`, one per
request, fed each target round's tokens)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .core.stats import CascadeStats


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # on the last chunk: "eos", "length" or "stop"
    stats: CascadeStats | None = None  # on the last chunk
    session_length: int = 0  # on the last chunk of a session request
    logprobs: list = field(default_factory=list)  # per token, when asked for (core.review.TokenLogprob)


class Output:
    """One request's output, fed each round's committed tokens (`feed` for a stream, `add` for one
    reply: the same cut and the same text either way).

    A round that completes a stop string keeps its tokens up to the one that completed it and ends the
    request ("stop"); one whose last kept token is an end-of-sequence token ends it too ("eos"); the
    decode's own end is "length". The round that ends the request goes out with the last chunk.
    `logprobs`: the decode's list of the target's logprobs (CascadeStats.logprobs), one per committed
    token, which the decode appends to as it goes.
    """

    def __init__(
        self, decode: Callable[[Sequence[int]], str], stop: Sequence[str], eos_ids: frozenset[int], logprobs: list[Any]
    ):
        self.text = TextStream(decode, stop)
        self.eos_ids = eos_ids
        self.logprobs = logprobs
        self.tokens: list[int] = []  # every token kept so far
        self.texts: list[str] = []  # the text taken so far, in the pieces it was taken in (add)
        self.finish = "length"
        self.last: list[int] = []  # the kept tokens of the round that ended the request

    @property
    def done(self) -> bool:
        """Whether a stop string or an end-of-sequence token ended the request."""
        return self.finish != "length"

    def feed(self, new: list[int]) -> Chunk | None:
        """A round's tokens; the chunk to emit now, if any (None also when this round ended the request)."""
        kept = self._round(new)
        if kept is None or not (kept[0] or kept[1]):
            return None
        n = len(self.tokens)
        return Chunk(kept[0], kept[1], logprobs=self.logprobs[n - len(kept[0]) : n])

    def add(self, new: list[int]) -> None:
        """A round's tokens, for a reply made whole at the end (`whole`)."""
        kept = self._round(new)
        if kept is not None and kept[1]:
            self.texts.append(kept[1])

    def _round(self, new: list[int]) -> tuple[list[int], str] | None:
        """The round's kept tokens and the text now safe to emit; None when the round ended the request."""
        cut = self.text.feed(new)
        if cut is not None:
            new, self.finish = new[:cut], "stop"
        elif new and new[-1] in self.eos_ids:
            self.finish = "eos"
        self.tokens += new
        if self.done:
            self.last = new
            return None
        return new, self.text.take(final=False)

    def end(self, stats: CascadeStats, session_length: int) -> Chunk:
        """A stream's last chunk: the tokens of the round that ended the request and the text held back."""
        n = len(self.tokens)
        tail = self.logprobs[n - len(self.last) : n]
        return Chunk(self.last, self.text.take(final=True), self.finish, stats, session_length, tail)

    def whole(self, stats: CascadeStats, session_length: int) -> Chunk:
        """The reply of a request fed by `add`: every kept token and the text a stream would have sent."""
        self.texts.append(self.text.take(final=True))
        n = len(self.tokens)
        return Chunk(self.tokens, "".join(self.texts), self.finish, stats, session_length, self.logprobs[:n])


CONTEXT = 4  # tokens decoded before a round's new ones (TextStream._decoded)
SPAN = 16  # tokens a round's decoded window grows to before it starts again CONTEXT tokens back
CHECK_FIRST = 64  # tokens at which a stream's text is first checked against a whole decode


class TextStream:
    """Incremental detokenization with stop strings; emitted text is never taken back.

    While streaming, the last (longest stop string - 1) characters are held back, since a stop string
    may still complete there, and so is a trailing U+FFFD (a multi-byte character split across tokens).
    On a stop, the kept tokens end with the one that completed the stop string, and the text ends just
    before the stop string (the convention of vLLM and the OpenAI API).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str]):
        self.decode = decode
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""  # the text of self.tokens (the tokenizer's decode of them all; see `_decoded`)
        self.sent = 0  # characters of self.text already emitted
        self.stopped_at: int | None = None
        # Incremental decoding: the text of the tokens up to the last settled round is self.text[:_settled],
        # and a round decodes only tokens[_start:] (CONTEXT tokens before those, whose text is _window)
        # instead of every token: a whole decode each round made detokenization quadratic in the length.
        self._start = self._settled = 0
        self._window = ""
        self._check_at = CHECK_FIRST  # token count at which the next whole decode checks the window's text

    def feed(self, new: Sequence[int]) -> int | None:
        """Add a round's tokens; if a stop string completed, return how many of them to keep."""
        base = len(self.tokens)
        self.tokens += new
        self.text = self._decoded()
        # A stop string cannot start before `sent`: at least len(stop) - 1 characters were held back.
        found = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
        if not found:
            return None
        for n in range(base + 1, len(self.tokens) + 1):  # the first token that completes a stop string
            text = self.decode(self.tokens[:n])
            hits = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]
            if hits:
                self.tokens, self.text, self.stopped_at = self.tokens[:n], text, min(hits)
                return n - base
        self.stopped_at = min(found)  # decoding is not prefix-stable here; keep every token
        return len(new)

    def take(self, final: bool) -> str:
        """The text not emitted yet that is safe to emit now."""
        if self.stopped_at is not None:
            end = self.stopped_at
        elif final:
            self.text = self._settle(self.decode(self.tokens))  # the last text is the whole decode's, as ever
            end = len(self.text)
        else:
            end = len(self.text) - self.hold
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
        end = max(end, self.sent)
        delta, self.sent = self.text[self.sent : end], end
        return delta

    def _decoded(self) -> str:
        """The text of self.tokens, decoding only the tokens since the text last settled (and CONTEXT
        before them, so that a tokenizer which drops a leading space at a decode's start still gives the
        new tokens theirs). Decoding a window equals decoding every token wherever the tokenizer's text of
        a sequence is its text up to a token plus the window's new text, as byte-level BPE's is; where a
        new token changes text before it (a decoder that cleans up spaces) the window's text no longer
        starts as before, and the whole sequence is decoded instead. A whole decode at doubling lengths
        (from CHECK_FIRST tokens) and at the end keeps any other difference from lasting: amortised, a
        few tokens decoded per token."""
        if len(self.tokens) >= self._check_at:
            self._check_at = 2 * len(self.tokens)
            return self._settle(self.decode(self.tokens))
        window = self.decode(self.tokens[self._start :])
        if not window.startswith(self._window):
            return self._settle(self.decode(self.tokens))
        return self._settle(self.text[: self._settled] + window[len(self._window) :], window)

    def _settle(self, text: str, window: str | None = None) -> str:
        """`text`, the text of every token, settled where it ends on a whole character (a trailing U+FFFD
        may be a character split across tokens: its bytes are decoded again with the next tokens).
        `window`: the text of tokens[_start:] where `text` came from it (None: a whole decode). The
        window then grows to SPAN tokens before it starts again CONTEXT tokens back, so a round
        decodes once rather than twice (its window, then the next round's CONTEXT tokens)."""
        if not text.endswith("\ufffd"):
            self._settled = len(text)
            if window is not None and len(self.tokens) - self._start <= SPAN:
                self._window = window
            else:
                self._start = max(0, len(self.tokens) - CONTEXT)
                self._window = self.decode(self.tokens[self._start :])
        elif window is None:  # not even the text before the split character is known to be settled: start over
            self._start = self._settled = 0
            self._window = ""
        return text
