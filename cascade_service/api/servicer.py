"""The gRPC edge: proto <-> coordinator, and every error -> a status code with a message naming the field.

One servicer serves both wirings: a plain `grpc.server` (`api.server`) and Ray Serve's gRPC proxy
(`serving.app` calls these methods from its ingress). Both contexts support `set_code` /
`set_details`, so errors are reported that way and an empty message is returned, never raised: an
exception would reach the client as INTERNAL.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ..coordinator import Cancelled, Coordinator
from ..core.grammar import ResponseFormat
from ..core.proposers.prediction import PREDICTION
from ..core.stats import CascadeStats, TierCounters
from ..core.tier import Overloaded, Unavailable
from ..core.verify import Verification
from ..intake import Asked, Request
from ..metrics import default_metrics
from ..output import Chunk
from ..proto.v1 import cascade_pb2 as pb
from ..rpc.auth import owner_of
from ..sessions import (
    SessionConflict,
    SessionExists,
    SessionForbidden,
    SessionNotFound,
    SessionQuotaExceeded,
    StoreUnavailable,
)
from .choices import choice_counts, choice_requests, mean_logprob, together
from .status import set_status

# GenerateRequest's proto3-optional scalars that are Asked's fields of the same name (unset: the server's
# default), read off the message itself so that a new one is not left behind.
OPTIONAL = tuple(
    f.name
    for f in pb.GenerateRequest.DESCRIPTOR.fields
    if f.has_presence and f.message_type is None and f.name in {a.name for a in dataclasses.fields(Asked)}
)

log = logging.getLogger(__name__)
SERVICE_NAME = "cascade.v1.CascadeService"


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for an exception raised while serving: one line of
    our own words, never a traceback or another process's details."""
    exc = _raised(exc)
    code, message = _status(exc)
    return code, public_message(message)


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, SessionNotFound):
        return grpc.StatusCode.NOT_FOUND, f"session_id: {exc}"
    if isinstance(exc, SessionForbidden):
        return grpc.StatusCode.PERMISSION_DENIED, f"session_id: {exc}"
    if isinstance(exc, SessionExists):
        return grpc.StatusCode.ALREADY_EXISTS, f"session_id: {exc}"
    if isinstance(exc, SessionConflict):
        return grpc.StatusCode.ABORTED, f"session_id: the session changed during this request; retry ({exc})"
    if isinstance(exc, Cancelled):
        return grpc.StatusCode.CANCELLED, str(exc)
    if isinstance(exc, (Overloaded, SessionQuotaExceeded)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, StoreUnavailable):
        default_metrics().session_store_errors.inc()
    if isinstance(exc, (StoreUnavailable, Unavailable)):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    log.exception("internal error while serving a request", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"


def _raised(exc: BaseException) -> BaseException:
    """The exception a remote task raised, not the wrapper Ray re-raises it in (a `RayTaskError`, also
    an instance of the cause's class, whose text is the remote traceback). Duck-typed: the core of the
    API does not import Ray."""
    while type(exc).__name__.startswith("RayTaskError") and isinstance(getattr(exc, "cause", None), BaseException):
        exc = exc.cause  # type: ignore[attr-defined]
    return exc


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
MAX_MESSAGE_CHARS = 500


def public_message(message: str) -> str:
    """A message fit for a client: its first line, without terminal colour codes, at most
    MAX_MESSAGE_CHARS characters. Anything longer is internal detail that belongs in the server log."""
    lines = _ANSI.sub("", message).strip().splitlines()
    line = lines[0].strip() if lines else ""
    return line if len(line) <= MAX_MESSAGE_CHARS else line[: MAX_MESSAGE_CHARS - 3] + "..."


class CascadeServicer:
    """cascade.v1.CascadeService over a Coordinator (sync methods: the decode loop blocks)."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator

    def Generate(
        self, request: pb.GenerateRequest, context: Any, cancelled: Callable[[], bool] | None = None
    ) -> pb.GenerateResponse:
        """`cancelled`: says when the caller has gone; by default the gRPC context's `is_active`."""
        gone = cancelled or caller_gone(context)
        try:
            n, best = choice_counts(request)
            if best > 1:
                return self._choices(request, context, gone, n, best)
            params = self._params(request, context)
            result = self.coordinator.generate(params, gone)
        except Exception as exc:
            return fail(context, exc, pb.GenerateResponse())
        return pb.GenerateResponse(
            text=result.text,
            token_ids=result.token_ids,
            finish_reason=result.finish_reason or "",
            stats=self.stats(result.stats),
            session_id=request.session_id,
            session_length=result.session_length,
            logprobs=self.logprobs(result.logprobs),
        )

    def _choices(self, request: pb.GenerateRequest, context: Any, gone: Callable[[], bool], n: int, best: int):
        """n choices of `best` candidates, decoded together (api.choices); every one's fields are checked
        before any decodes."""
        requests = choice_requests(request, best, rank=best > n)
        params = [(self._params(each, context), each.seed) for each in requests]
        results = together(lambda item: (self.coordinator.generate(item[0], gone), item[1]), params)
        choices = [
            pb.Choice(
                text=result.text,
                token_ids=result.token_ids,
                finish_reason=result.finish_reason or "",
                stats=self.stats(result.stats),
                logprobs=self.logprobs(result.logprobs),
                seed=seed,
            )
            for result, seed in results
        ]
        if best > n:
            choices = sorted(choices, key=lambda c: mean_logprob(c.logprobs), reverse=True)[:n]
            if not request.HasField("logprobs"):  # they were asked for the ranking only
                for choice in choices:
                    del choice.logprobs[:]
        for index, choice in enumerate(choices):
            choice.index = index
        return pb.GenerateResponse(choices=choices)

    def GenerateStream(
        self, request: pb.GenerateRequest, context: Any, cancelled: Callable[[], bool] | None = None
    ) -> Iterator[pb.GenerateChunk]:
        try:
            if (request.HasField("n") and request.n != 1) or (request.HasField("best_of") and request.best_of != 1):
                raise ValueError("n: GenerateStream streams one choice; several come from Generate")
            params = self._params(request, context)
            for chunk in self.coordinator.stream(params, cancelled or caller_gone(context)):
                yield self.chunk(chunk)
        except Exception as exc:
            fail(context, exc, None)

    def CreateSession(self, request: pb.CreateSessionRequest, context: Any) -> pb.Session:
        try:
            record = self.coordinator.create_session(
                request.session_id, request.prompt, list(request.prompt_token_ids), owner=owner_of(context)
            )
        except Exception as exc:
            return fail(context, exc, pb.Session())
        return self._session(record)

    def GetSession(self, request: pb.GetSessionRequest, context: Any) -> pb.Session:
        try:
            _require_id(request.session_id)
            record = self.coordinator.get_session(request.session_id, owner_of(context))
        except Exception as exc:
            return fail(context, exc, pb.Session())
        return self._session(record)

    def DeleteSession(self, request: pb.DeleteSessionRequest, context: Any) -> pb.DeleteSessionResponse:
        try:
            _require_id(request.session_id)
            deleted = self.coordinator.delete_session(request.session_id, owner_of(context))
        except Exception as exc:
            return fail(context, exc, pb.DeleteSessionResponse())
        return pb.DeleteSessionResponse(deleted=deleted)

    # --- conversions -------------------------------------------------------------------------------

    def _params(self, request: pb.GenerateRequest, context: Any) -> Request:
        """The request as its client sent it, in one conversion (protobuf -> intake.Asked), built and
        checked by the coordinator's intake."""
        optional = {name: getattr(request, name) for name in OPTIONAL if request.HasField(name)}
        asked = Asked(
            prompt=request.prompt,
            prompt_ids=list(request.prompt_token_ids),
            session_id=request.session_id,
            stop=list(request.stop),
            prediction=_prediction(request),
            owner=owner_of(context),
            logit_bias=request.logit_bias or None,  # its size is checked before it is read
            verification=_verification(request),
            speculation=request.speculation.mode or None,  # unset or empty: the server's "auto"
            target_row=list(request.speculation.target_row) or None,
            response_format=_response_format(request),
            **optional,
        )
        return self.coordinator.intake.served(asked)

    def chunk(self, chunk: Chunk) -> pb.GenerateChunk:
        return pb.GenerateChunk(
            text=chunk.text,
            token_ids=chunk.token_ids,
            finish_reason=chunk.finish_reason or "",
            stats=self.stats(chunk.stats) if chunk.stats else None,
            session_length=chunk.session_length,
            logprobs=self.logprobs(chunk.logprobs),
        )

    def logprobs(self, logprobs: list) -> list[pb.TokenLogprob]:
        decode = self.coordinator.tokenizer.decode
        return [
            pb.TokenLogprob(
                token_id=t.token,
                text=decode([t.token]),
                logprob=t.logprob,
                top=[pb.TopLogprob(token_id=i, text=decode([i]), logprob=lp) for i, lp in t.top],
            )
            for t in logprobs
        ]

    def stats(self, stats: CascadeStats | None) -> pb.GenerateStats:
        if stats is None:
            return pb.GenerateStats()
        review = stats.reviews.get(stats.target)
        kept, rejected = review.kept(PREDICTION) if review else (0, 0)
        return pb.GenerateStats(
            generated_tokens=stats.generated,
            target_calls=stats.target_calls,
            drafted_rounds=stats.drafted_rounds,
            cached_prompt_tokens=stats.tier(stats.target).tokens_cached if stats.target in stats.tiers else 0,
            tiers={
                name: pb.TierStats(
                    calls=t["calls"], drafted=t["drafted"], accepted=t["accepted"], **_tier_costs(stats.tiers.get(name))
                )
                for name, t in stats.per_tier().items()
            },
            accepted_by_position=list(review.accepted_by_position) if review else [],
            drafted_by_position=list(review.drafted_by_position) if review else [],
            mean_accepted_length=stats.mean_accepted_length,
            wall_s=stats.wall_s,
            swi_params=stats.swi(self.coordinator.param_costs),
            verification=stats.verification,
            off_target_tokens=stats.off_target_tokens,
            tv_deviation=stats.tv_deviation,
            loglik_loss=stats.loglik_loss,
            rows={name: _row(r.row()) for name, r in stats.reviews.items()},
            accepted_prediction_tokens=kept,
            rejected_prediction_tokens=rejected,
            **_engine_time(stats),
        )

    def _session(self, record) -> pb.Session:
        return pb.Session(
            session_id=record.session_id,
            token_ids=list(record.token_ids),
            version=record.version,
            text=self.coordinator.tokenizer.decode(list(record.token_ids)),
        )


def _engine_time(stats: CascadeStats) -> dict[str, Any]:
    engine = stats.engine
    return {} if engine is None else {"pass_s": engine.pass_s, "loop_s": engine.run_s, "waited_s": engine.waited_s}


def _row(row: dict) -> pb.RowStats:
    return pb.RowStats(
        blocks=row["blocks"], gated=row["gated"], entries={n: pb.EntryStats(**e) for n, e in row["entries"].items()}
    )


def _tier_costs(c: TierCounters | None) -> dict[str, Any]:
    if c is None:
        return {}
    return {
        "tokens_processed": c.tokens_processed,
        "time_s": c.time_s,
        "hops": c.hops,
        "tokens_cached": c.tokens_cached,
    }


def _verification(request: pb.GenerateRequest) -> Verification | None:
    """The request's final-verifier rule; a bad one raises ValueError naming the verification field."""
    if not request.HasField("verification"):
        return None
    v = request.verification
    if v.tune_beta and v.HasField("beta"):
        raise ValueError("verification.beta: give beta or tune_beta, not both")
    beta = None if v.tune_beta else (v.beta if v.HasField("beta") else 1.0)
    return Verification(v.rule or "exact", v.alpha if v.HasField("alpha") else None, beta)


def _require_id(session_id: str) -> None:
    if not session_id:
        raise ValueError("session_id: required")


def fail(context: Any, exc: BaseException, empty: Any) -> Any:
    """Report `exc` on `context` as a status (code and message) and return `empty`: a servicer returns
    rather than raises, since a raised exception would reach the client as INTERNAL. The rich error
    details go with it (`api.status`)."""
    set_status(context, *status_for(exc))
    return empty


def caller_gone(context: Any) -> Callable[[], bool]:
    """Whether the caller has gone (cancelled, or past its deadline), from a gRPC server context.

    A context without `is_active` (one that records a forwarded call) never says so; its caller passes
    its own `cancelled` instead.
    """
    is_active = getattr(context, "is_active", None)
    if not callable(is_active):
        return lambda: False
    return lambda: not is_active()


def failure(context: Any) -> str | None:
    """The message of the error status set on `context`, or None when it holds none (still OK)."""
    code = context.code()
    if code is None or code == grpc.StatusCode.OK:
        return None
    return context.details() or code.name


def _prediction(request: pb.GenerateRequest) -> str | list[int] | None:
    if not request.HasField("prediction"):
        return None
    p = request.prediction
    if p.content and p.token_ids:
        raise ValueError("prediction: give content or token_ids, not both")
    return list(p.token_ids) if p.token_ids else p.content or None


def _response_format(request: pb.GenerateRequest) -> ResponseFormat | None:
    kind = request.response_format.WhichOneof("format") if request.HasField("response_format") else None
    if kind is None:
        return None
    value = getattr(request.response_format, kind)
    return ResponseFormat(kind, "" if isinstance(value, bool) else value, request.response_format.whitespace)
