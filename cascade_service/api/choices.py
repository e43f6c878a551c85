"""A request's `n` choices and `best_of` candidates (gRPC `GenerateRequest.n` / `best_of`, OpenAI's `n` /
`best_of`): each candidate is the request again with its own seed (the request's + i, or a random base),
decoded as a task of its own beside the others in the engine loop, so they share its batched passes and
the prompt's prefix cache. best_of keeps the n with the highest mean token logprob, likeliest first.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..engine.loop import current_loop
from ..proto.v1 import cascade_pb2 as pb

MAX_CHOICES = 16  # n and best_of: each candidate is a decode of its own
T = TypeVar("T")


def choice_counts(request: pb.GenerateRequest) -> tuple[int, int]:
    """(n, best_of) of a gRPC request, checked (ValueError naming the field)."""
    n = request.n if request.HasField("n") else 1
    best = request.best_of if request.HasField("best_of") else n
    for field, value in (("n", n), ("best_of", best)):
        if not 1 <= value <= MAX_CHOICES:
            raise ValueError(f"{field} must be in [1, {MAX_CHOICES}], got {value}")
    if best < n:
        raise ValueError(f"best_of ({best}) must be at least n ({n})")
    if best > 1 and request.session_id:
        raise ValueError("n: a session request has one choice (each would append to the session)")
    return n, best


def choice_requests(message: pb.GenerateRequest, count: int, rank: bool) -> list[pb.GenerateRequest]:
    """`count` copies of the request, each with its own seed (the request's + i, or random ones), one
    choice each, and logprobs when the candidates are to be ranked by them."""
    base = message.seed if message.HasField("seed") else secrets.randbelow(2**62)
    out = []
    for i in range(count):
        each = pb.GenerateRequest()
        each.CopyFrom(message)
        each.ClearField("n")
        each.ClearField("best_of")
        each.seed = (base + i) % 2**63
        if rank and not each.HasField("logprobs"):
            each.logprobs = 0
        out.append(each)
    return out


def mean_logprob(logprobs: Sequence[pb.TokenLogprob]) -> float:
    """A candidate's log-probability per token (best_of keeps the highest, as OpenAI's does)."""
    return sum(t.logprob for t in logprobs) / max(1, len(logprobs))


def together(work: Callable[[T], Any], items: Sequence[T]) -> list[Any]:
    """work(item) for each item, at once: in an engine loop task, the others as sibling tasks of this one
    (their forward passes join the same batches); elsewhere one after another. Every one is waited for;
    the first error is raised after."""
    loop = current_loop()
    if loop is None or len(items) < 2:
        return [work(item) for item in items]
    futures = [loop.submit(work, item) for item in items[1:]]
    outcomes: list[Any] = []
    try:
        outcomes.append(work(items[0]))
    except Exception as exc:
        outcomes.append(exc)
    for future in futures:
        try:
            outcomes.append(loop.wait(future))
        except Exception as exc:
            outcomes.append(exc)
    failed = next((o for o in outcomes if isinstance(o, Exception)), None)
    if failed is not None:
        raise failed
    return outcomes
