"""Predicted outputs: the text a client expects the output to be (OpenAI's `prediction`: the file being
edited, a document being rewritten) as a drafter of its own request.

The prediction drafts at the target ahead of the lookup gate and the K-matrix: each round proposes the
prediction's next tokens from where the output stands in it, and the final review keeps what the target
agrees with, so the output is the target's, prediction or not. Where the output leaves the prediction
(an edited line), the proposer waits until the output's last tokens occur in the prediction again
(forward of where it left, else anywhere, else its last token just ahead) and goes on from there; until
then the round drafts as it would without a prediction. A block grows while the prediction is right
(doubling up to MAX_BLOCK) and shrinks to what the target kept when it is not, so a wrong prediction
costs little.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..limits import MAX_PREDICTION_TOKENS, check_prediction
from ..types import Context

PREDICTION = "prediction"  # its tier's name in the stats (per-drafter acceptance: accepted_prediction_tokens)
FIRST_BLOCK = 16  # tokens proposed in a round before anything is known
MAX_BLOCK = 64  # the longest block: a target pass over it is still one pass
MIN_BLOCK = 4
RESYNC = 3  # output tokens that must occur in the prediction to take it up again (fewer at the start)
WINDOW = 8  # how far ahead a single token may take it up again


def prediction_ids(encode: Callable[[str], list[int]], prediction: str | Sequence[int]) -> tuple[int, ...]:
    """A request's prediction as token ids (checked: core.limits.check_prediction). Text is tokenized as
    a continuation: without the special tokens the tokenizer puts before any text, which no output holds."""
    if not isinstance(prediction, str):
        return check_prediction(list(prediction))
    if len(prediction) > 8 * MAX_PREDICTION_TOKENS:  # refused before tokenizing a huge one
        raise ValueError(f"prediction holds at most {MAX_PREDICTION_TOKENS} tokens (its text is too long)")
    ids, lead = encode(prediction), encode("")
    return check_prediction(ids[len(lead) :] if lead and ids[: len(lead)] == lead else ids)


class PredictionProposer:
    """core.local.Proposer over one request's predicted tokens (wrapped as a StatisticalTier named
    "prediction"): `propose` reads the output so far (the context after its length at the first call)."""

    decides_length = True  # a short proposal is the end of the prediction, not a drafter to ask again

    def __init__(self, tokens: Sequence[int]):
        self.tokens = list(tokens)
        self.start: int | None = None  # the context's length at the first round: where the output begins
        self.seen = 0  # output tokens already walked
        self.cursor = 0  # where the next output token is expected in the prediction; None: lost
        self.synced = True
        self.block = FIRST_BLOCK
        self.proposed = 0  # the last proposal's length, judged when the next output arrives

    def propose(self, ctx: Context, k: int) -> list[int]:
        if self.start is None:
            self.start = len(ctx.tokens)
        output = ctx.tokens[self.start : ctx.stable]
        self._walk(output)
        if not self.synced or self.cursor >= len(self.tokens):
            self.proposed = 0
            return []
        n = max(0, min(k, self.block, len(self.tokens) - self.cursor))
        self.proposed = n
        return self.tokens[self.cursor : self.cursor + n]

    def lookup(self, ctx: Context, k: int, min_match: int) -> list[int]:
        return self.propose(ctx, k)

    def finish(self, tokens: Sequence[int] = ()) -> None:
        pass

    def _walk(self, output: Sequence[int]) -> None:
        """Follow the output tokens not seen yet through the prediction; resync where they left it."""
        new = output[self.seen :]
        self.seen = len(output)
        kept = 0
        for token in new:
            if self.synced and self.cursor < len(self.tokens) and self.tokens[self.cursor] == token:
                self.cursor += 1
                kept += 1
            else:
                self.synced = False
        if self.proposed:  # grow while the prediction is right, shrink to what was kept when not
            full = self.synced and kept >= self.proposed
            self.block = min(MAX_BLOCK, self.block * 2) if full else max(MIN_BLOCK, kept + 1)
        if not self.synced and output:
            self._resync(output)

    def _resync(self, output: Sequence[int]) -> None:
        """Take the prediction up again after the output's last tokens: RESYNC of them anywhere ahead of
        where it left (else anywhere); failing that, the last one alone within WINDOW tokens ahead, as
        after an edit that replaced or dropped a few tokens (a wrong guess costs one short block)."""
        n = min(RESYNC, len(output))
        tail = list(output[-n:])
        starts = range(n, len(self.tokens) + 1)
        found = next((j for j in starts if j >= self.cursor and self.tokens[j - n : j] == tail), None)
        if found is None:
            found = next((j for j in starts if self.tokens[j - n : j] == tail), None)
        if found is None:
            near = self.tokens[self.cursor : self.cursor + WINDOW]
            found = next((self.cursor + i + 1 for i, t in enumerate(near) if t == output[-1]), None)
        if found is not None:
            self.cursor, self.synced = found, True
