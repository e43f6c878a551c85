"""A request's text as it streams: incremental detokenization with stop strings (the coordinator's)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


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
        self.text = ""
        self.sent = 0  # characters of self.text already emitted
        self.stopped_at: int | None = None

    def feed(self, new: Sequence[int]) -> int | None:
        """Add a round's tokens; if a stop string completed, return how many of them to keep."""
        base = len(self.tokens)
        self.tokens += new
        self.text = self.decode(self.tokens)
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
            end = len(self.text)
        else:
            end = len(self.text) - self.hold
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
        end = max(end, self.sent)
        delta, self.sent = self.text[self.sent : end], end
        return delta
