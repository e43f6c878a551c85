"""The wire codec of the tier protocol: `core.tier`'s messages <-> protobuf bytes (protos/cascade/tier/v1/).

One place turns every message a tier call sends or answers into bytes and back, so what crosses a
process boundary is a declared schema, never pickled objects or hand-built dicts. Probability rows
travel as float32 bytes (`core.placement.to_host`: the receiver may have no GPU, and the wire holds
no bfloat16) and arrive as CPU tensors; the reviewer that takes them moves them to its device
(`core.placement.to_reviewer`). Probabilities that are scalars travel as doubles, exactly.

Contexts travel as deltas: a request names the `Address` of the call (the tier it is for, and how much
of the context the server already holds, with a digest of it), and carries only the tokens after
that. The server rebuilds the whole context from what it kept (`transport.contexts`), or answers
"resend" (a reply that decodes to None) when it holds another prefix; the caller then sends the whole
context. So a round costs the new tokens on the wire, not the sequence, and a server that lost its
state (a restart, a failover, an eviction) never computes on a wrong context.

Decoding checks what the types check (a temperature out of range, an unknown rule, a negative count),
so a malformed message fails as ValueError, naming what is wrong."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from google.protobuf.message import DecodeError

from ..core.adaptive import AdaptiveLength
from ..core.placement import to_host
from ..core.review import TokenLogprob, Verdict
from ..core.sampling import SamplingParams
from ..core.stats import ReviewCounters, TierCounters, Usage
from ..core.tier import DraftReply, DraftRequest, Release, ReviewReply, ReviewRequest
from ..core.types import Context, Draft
from ..core.verify import Verification
from ..proto.tier.v1 import tier_pb2 as pb
from .grammars import grammar_in, grammar_out


@dataclass(frozen=True)
class Address:
    """Where a call goes on the server: tier `tier`, whose context the server holds up to `offset`
    tokens already (their digest: `prefix`, see `prefix_digest`). offset 0: the call carries it all."""

    tier: str
    offset: int = 0
    prefix: int = 0


def prefix_digest(tokens: Sequence[int]) -> int:
    """A 64-bit digest of a token prefix: the server checks it before trusting what it kept."""
    data = np.asarray(tokens, dtype="<i4").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def encode_draft_request(request: DraftRequest, tier: str, offset: int = 0) -> bytes:
    """`request` for tier `tier` of the server that receives it, which holds its first `offset`
    context tokens already (0: send them all)."""
    return pb.DraftRequest(
        request_id=request.request_id,
        tier=tier,
        context=_context_out(request.context, offset),
        want=request.want,
        limit=request.limit,
        sampling=_sampling_out(request.sampling),
        seed=request.seed,
        eos_ids=sorted(request.eos_ids),
        min_match=request.min_match,
        cache_salt=request.cache_salt,
        grammar=grammar_out(request.grammar),
        keyed=request.keyed,
        adaptive={
            name: pb.Adaptive(rule=a.rule, threshold=a.threshold, head=a.head or "")
            for name, a in request.adaptive.items()
        },
    ).SerializeToString()


def decode_draft_request(data: bytes) -> tuple[Address, DraftRequest]:
    """(address, request); the request's context holds the tokens from address.offset on."""
    m = _parse(pb.DraftRequest, data)
    adaptive = {name: AdaptiveLength(a.rule, a.threshold, a.head or None) for name, a in m.adaptive.items()}
    return _address(m), DraftRequest(
        m.request_id,
        _context_in(m.context),
        m.want,
        m.limit,
        _sampling_in(m.sampling),
        m.seed,
        frozenset(m.eos_ids),
        adaptive,
        m.min_match,
        m.cache_salt,
        grammar_in(m),
        m.keyed,
    )


def encode_draft_reply(reply: DraftReply) -> bytes:
    return pb.DraftReply(
        block=_block_out(reply.draft), usage=_usage_out(reply.usage), stopped=reply.stopped
    ).SerializeToString()


def decode_draft_reply(data: bytes) -> DraftReply | None:
    """The reply; None when the server asks for the whole context (`RESEND`)."""
    m = _parse(pb.DraftReply, data)
    if m.resend:
        return None
    return DraftReply(_block_in(m.block), _usage_in(m.usage), m.stopped)


# The server's answer to a call whose context prefix it does not hold, by method.
RESEND = {
    "draft": pb.DraftReply(resend=True).SerializeToString(),
    "review": pb.ReviewReply(resend=True).SerializeToString(),
}


def encode_review_request(request: ReviewRequest, tier: str, offset: int = 0) -> bytes:
    if request.hidden:
        raise ValueError(
            "hidden states do not cross the wire: a reviewing tier with an acceptance head must run "
            "where the cascade above it runs"
        )
    v = request.verification
    rule = pb.FinalRule(rule=v.rule, alpha=v.alpha, beta=v.beta)  # None leaves an optional field unset
    return pb.ReviewRequest(
        request_id=request.request_id,
        tier=tier,
        context=_context_out(request.context, offset),
        block=_block_out(request.block),
        leniency=request.leniency,
        sampling=_sampling_out(request.sampling),
        seed=request.seed,
        verification=rule,
        cache_salt=request.cache_salt,
        logprobs=request.logprobs if request.logprobs >= 0 else None,
        keyed=request.keyed,
        probs_unread=request.probs_unread,
        **_mask_out(request.allowed),
    ).SerializeToString()


def decode_review_request(data: bytes) -> tuple[Address, ReviewRequest]:
    """(address, request); the request's context holds the tokens from address.offset on."""
    m = _parse(pb.ReviewRequest, data)
    r = m.verification
    verification = Verification(
        r.rule or "exact", r.alpha if r.HasField("alpha") else None, r.beta if r.HasField("beta") else None
    )
    return _address(m), ReviewRequest(
        m.request_id,
        _context_in(m.context),
        _block_in(m.block),
        m.leniency,
        _sampling_in(m.sampling),
        m.seed,
        verification,
        cache_salt=m.cache_salt,
        logprobs=m.logprobs if m.HasField("logprobs") else -1,
        allowed=_mask_in(m),
        keyed=m.keyed,
        probs_unread=m.probs_unread,
    )


def _mask_out(allowed: torch.Tensor | None) -> dict[str, Any]:
    if allowed is None:
        return {}
    bits = np.packbits(allowed.cpu().numpy().astype(bool), axis=-1, bitorder="little")
    return {"allowed": bits.tobytes(), "allowed_rows": allowed.shape[0], "allowed_cols": allowed.shape[1]}


def _mask_in(m: pb.ReviewRequest) -> torch.Tensor | None:
    if not m.allowed_rows:
        return None
    packed = np.frombuffer(m.allowed, dtype=np.uint8).reshape(m.allowed_rows, -1)
    bits = np.unpackbits(packed, axis=-1, bitorder="little")[:, : m.allowed_cols]
    return torch.from_numpy(bits.astype(bool))


def encode_review_reply(reply: ReviewReply) -> bytes:
    v = reply.verdict
    verdict = pb.Verdict(
        accepted=v.accepted,
        token=v.token,
        token_probs=v.token_probs,
        dists=_rows_out(v.dists),
        off_target=v.off_target,
        tv=v.tv,
        ll_loss=v.ll_loss,
        logprobs=[
            pb.TokenLogprob(
                token=t.token,
                logprob=t.logprob,
                top_tokens=[i for i, _ in t.top],
                top_logprobs=[lp for _, lp in t.top],
            )
            for t in v.logprobs
        ],
    )
    return pb.ReviewReply(verdict=verdict, usage=_usage_out(reply.usage)).SerializeToString()


def decode_review_reply(data: bytes) -> ReviewReply | None:
    """The reply; None when the server asks for the whole context (`RESEND`)."""
    m = _parse(pb.ReviewReply, data)
    if m.resend:
        return None
    v = m.verdict
    logprobs = tuple(
        TokenLogprob(t.token, t.logprob, tuple(zip(t.top_tokens, t.top_logprobs, strict=True))) for t in v.logprobs
    )
    verdict = Verdict(
        v.accepted, v.token, list(v.token_probs), _rows_in(v, "dists"), v.off_target, v.tv, v.ll_loss, logprobs
    )
    return ReviewReply(verdict, _usage_in(m.usage))


def encode_release(release: Release, tier: str = "", offset: int = 0) -> bytes:
    """A release; with its final tokens, those past the `offset` the server holds (as a call's)."""
    if not release.tokens:
        return pb.ReleaseRequest(request_id=release.request_id).SerializeToString()
    context = _context_out(Context(list(release.tokens), len(release.tokens)), offset)
    return pb.ReleaseRequest(request_id=release.request_id, tier=tier, context=context).SerializeToString()


def decode_release(data: bytes) -> tuple[Address | None, Release]:
    """(address, release): the address when the release carries final tokens (from address.offset on)."""
    m = _parse(pb.ReleaseRequest, data)
    if not m.HasField("context"):
        return None, Release(m.request_id)
    return _address(m), Release(m.request_id, tuple(_context_in(m.context).tokens))


# --- parts ------------------------------------------------------------------------------------------


def _parse(kind, data: bytes):  # type: ignore[no-untyped-def]  # protobuf's generated classes are untyped
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"a {kind.DESCRIPTOR.name} arrives as bytes, got {type(data).__name__}")
    message = kind()
    try:
        message.ParseFromString(bytes(data))
    except DecodeError as exc:
        raise ValueError(f"malformed {kind.DESCRIPTOR.name}: {exc}") from None
    return message


def _context_out(ctx: Context, offset: int) -> pb.Context:
    if not 0 <= offset <= len(ctx.tokens):
        raise ValueError(f"context offset {offset} outside its {len(ctx.tokens)} tokens")
    if not offset:
        return pb.Context(tokens=ctx.tokens, stable=ctx.stable)
    prefix = prefix_digest(ctx.tokens[:offset])
    return pb.Context(tokens=ctx.tokens[offset:], stable=ctx.stable, offset=offset, prefix=prefix)


def _context_in(m: pb.Context) -> Context:
    """The tokens from m.offset on (the server puts the held prefix before them)."""
    tokens = list(m.tokens)
    if m.stable > m.offset + len(tokens):
        raise ValueError(f"context.stable {m.stable} exceeds its {m.offset + len(tokens)} tokens")
    return Context(tokens, m.stable)


def _address(m) -> Address:  # type: ignore[no-untyped-def]  # a generated DraftRequest or ReviewRequest
    return Address(m.tier, m.context.offset, m.context.prefix)


def _sampling_out(s: SamplingParams) -> pb.Sampling:
    return pb.Sampling(
        temperature=s.temperature,
        top_p=s.top_p,
        rows=s.rows,
        top_k=s.top_k,
        min_p=s.min_p,
        logit_bias=dict(s.logit_bias),
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        output_start=s.output_start,
    )


def _sampling_in(m: pb.Sampling) -> SamplingParams:
    return SamplingParams(
        m.temperature,
        m.top_p if m.top_p else 1.0,
        m.rows,
        m.top_k,
        m.min_p,
        tuple(m.logit_bias.items()),
        repetition_penalty=m.repetition_penalty or 1.0,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        output_start=m.output_start,
    )


def _block_out(d: Draft) -> pb.Block:
    return pb.Block(tokens=d.tokens, token_probs=d.token_probs, dists=_rows_out(d.dists), origins=d.origins)


def _block_in(m: pb.Block) -> Draft:
    tokens = list(m.tokens)
    if len(m.token_probs) != len(tokens) or (m.origins and len(m.origins) != len(tokens)):
        raise ValueError(f"block: {len(tokens)} tokens but {len(m.token_probs)} token_probs, {len(m.origins)} origins")
    dists = _rows_in(m, "dists")
    if dists is not None and dists.shape[0] != len(tokens):
        raise ValueError(f"block: {len(tokens)} tokens but {dists.shape[0]} distribution rows")
    return Draft(tokens, list(m.token_probs), dists, list(m.origins) or [""] * len(tokens))


def _rows_out(rows: torch.Tensor | None) -> pb.Rows | None:
    if rows is None:
        return None
    host = to_host(rows).contiguous()
    n, v = host.shape
    return pb.Rows(rows=n, cols=v, float32=host.numpy().astype("<f4", copy=False).tobytes())


def _rows_in(parent, field: str) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
    if not parent.HasField(field):
        return None
    m = getattr(parent, field)
    if len(m.float32) != 4 * m.rows * m.cols:
        raise ValueError(f"{field}: {len(m.float32)} bytes for a {m.rows} x {m.cols} float32 matrix")
    array = np.frombuffer(m.float32, dtype="<f4").reshape(m.rows, m.cols)
    return torch.from_numpy(array.astype(np.float32))  # a writable copy in native order


def _usage_out(u: Usage) -> pb.Usage:
    return pb.Usage(
        tiers={
            n: pb.TierCounters(
                calls=c.calls,
                tokens_processed=c.tokens_processed,
                tokens_out=c.tokens_out,
                time_s=c.time_s,
                hops=c.hops,
                tokens_cached=c.tokens_cached,
            )
            for n, c in u.tiers.items()
        },
        reviews={
            n: pb.ReviewCounters(
                reviews=r.reviews,
                drafted=r.drafted,
                accepted=r.accepted,
                rejections=r.rejections,
                drafted_by_position=r.drafted_by_position,
                accepted_by_position=r.accepted_by_position,
                drafted_by_drafter=r.drafted_by_drafter,
                accepted_by_drafter=r.accepted_by_drafter,
                ran_by_drafter=r.ran_by_drafter,
                ended_by_drafter=r.ended_by_drafter,
                gated=r.gated,
            )
            for n, r in u.reviews.items()
        },
        off_target=u.off_target,
        tv=u.tv,
        ll_loss=u.ll_loss,
    )


def _usage_in(m: pb.Usage) -> Usage:
    return Usage(
        tiers={
            n: TierCounters(c.calls, c.tokens_processed, c.tokens_out, c.time_s, c.hops, c.tokens_cached)
            for n, c in m.tiers.items()
        },
        reviews={
            n: ReviewCounters(
                r.reviews,
                r.drafted,
                r.accepted,
                r.rejections,
                list(r.drafted_by_position),
                list(r.accepted_by_position),
                _counts(r.drafted_by_drafter),
                _counts(r.accepted_by_drafter),
                _counts(r.ran_by_drafter),
                _counts(r.ended_by_drafter),
                r.gated,
            )
            for n, r in m.reviews.items()
        },
        off_target=m.off_target,
        tv=m.tv,
        ll_loss=m.ll_loss,
    )


def _counts(m: Mapping[str, int]) -> dict[str, int]:
    return dict(m.items())
