"""The tier protocol's wire codec: every message survives the round trip, and malformed bytes fail clearly."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cascade_service.core.adaptive import AdaptiveLength
from cascade_service.core.review import Verdict
from cascade_service.core.sampling import SamplingParams
from cascade_service.core.stats import ReviewCounters, TierCounters, Usage
from cascade_service.core.tier import DraftReply, DraftRequest, Release, ReviewReply, ReviewRequest
from cascade_service.core.types import Context, Draft
from cascade_service.core.verify import RULES, Verification
from cascade_service.transport import codec

NAMES = st.text(
    st.characters(min_codepoint=33, max_codepoint=0x2FFF, blacklist_categories=("Cs",)), min_size=1, max_size=12
)
TOKENS = st.lists(st.integers(0, 2**31 - 1), max_size=12)
PROB = st.floats(0.0, 1.0, allow_nan=False)
COUNT = st.integers(0, 2**53)


@st.composite
def contexts(draw):
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40))
    return Context(tokens, draw(st.integers(0, len(tokens))))


@st.composite
def samplings(draw):
    temperature = draw(st.one_of(st.just(0.0), st.floats(1e-6, 100.0)))
    return SamplingParams(temperature, draw(st.floats(1e-6, 1.0)), draw(st.booleans()))


@st.composite
def drafts(draw, rows: bool | None = None):
    tokens = draw(TOKENS)
    n = len(tokens)
    with_rows = draw(st.booleans()) if rows is None else rows
    vocab = draw(st.integers(1, 9))
    dists = (
        torch.tensor(
            draw(st.lists(st.lists(PROB, min_size=vocab, max_size=vocab), min_size=n, max_size=n)), dtype=torch.float32
        ).reshape(n, vocab)
        if with_rows
        else None
    )
    return Draft(
        tokens, draw(st.lists(PROB, min_size=n, max_size=n)), dists, draw(st.lists(NAMES, min_size=n, max_size=n))
    )


@st.composite
def usages(draw):
    tiers = draw(
        st.dictionaries(NAMES, st.builds(TierCounters, COUNT, COUNT, COUNT, st.floats(0, 1e6), COUNT), max_size=4)
    )
    reviews = draw(
        st.dictionaries(
            NAMES,
            st.builds(
                ReviewCounters,
                COUNT,
                COUNT,
                COUNT,
                COUNT,
                st.lists(COUNT, max_size=5),
                st.lists(COUNT, max_size=5),
                st.dictionaries(NAMES, COUNT, max_size=3),
                st.dictionaries(NAMES, COUNT, max_size=3),
            ),
            max_size=3,
        )
    )
    return Usage(tiers, reviews, draw(COUNT), draw(st.floats(0, 1e6)), draw(st.floats(-1e6, 1e6)))


ADAPTIVE = st.one_of(
    st.builds(AdaptiveLength, st.just("confidence"), st.floats(1e-6, 0.999999)),
    st.builds(AdaptiveLength, st.just("specdec"), st.floats(1e-6, 0.999999), NAMES),
)


@st.composite
def verifications(draw):
    rule = draw(st.sampled_from(RULES))
    low, high = {"exact": (0.0, 0.0), "lossy": (0.0, 0.99)}.get(rule, (-1.0, 1.0))
    if rule.startswith("fuzzy"):
        low, high = 0.0, 10.0
    alpha = draw(st.one_of(st.none(), st.floats(low, high)))
    beta = draw(st.one_of(st.none(), st.floats(2.0, 10.0))) if rule == "lossy" else 1.0
    return Verification(rule, alpha, beta)


def _same_draft(a: Draft, b: Draft) -> None:
    assert (a.tokens, a.token_probs, a.origins) == (b.tokens, b.token_probs, b.origins)
    _same_rows(a.dists, b.dists)


def _same_rows(a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    assert (a is None) == (b is None)
    if a is not None and b is not None:
        assert b.dtype == torch.float32 and b.device.type == "cpu" and torch.equal(a, b)


@settings(max_examples=150, deadline=None)
@given(
    request_id=NAMES,
    tier=NAMES,
    context=contexts(),
    want=st.integers(0, 2**20),
    limit=st.integers(0, 2**20),
    sampling=samplings(),
    seed=st.integers(0, 2**62),
    eos=st.frozensets(st.integers(0, 2**31 - 1), max_size=4),
    adaptive=st.dictionaries(NAMES, ADAPTIVE, max_size=3),
    min_match=st.integers(0, 256),
    keyed=st.booleans(),
)
def test_a_draft_request_round_trips(
    request_id, tier, context, want, limit, sampling, seed, eos, adaptive, min_match, keyed
):
    request = DraftRequest(request_id, context, want, limit, sampling, seed, eos, adaptive, min_match, keyed=keyed)
    assert codec.decode_draft_request(codec.encode_draft_request(request, tier)) == (codec.Address(tier), request)


@settings(max_examples=150, deadline=None)
@given(draft=drafts(), usage=usages(), stopped=st.booleans())
def test_a_draft_reply_round_trips(draft, usage, stopped):
    reply = codec.decode_draft_reply(codec.encode_draft_reply(DraftReply(draft, usage, stopped)))
    _same_draft(draft, reply.draft)
    assert (reply.usage, reply.stopped) == (usage, stopped)


@settings(max_examples=150, deadline=None)
@given(
    request_id=NAMES,
    tier=NAMES,
    context=contexts(),
    block=drafts(),
    leniency=st.floats(1.0, 1e6),
    sampling=samplings(),
    seed=st.integers(0, 2**62),
    verification=verifications(),
    keyed=st.booleans(),
    unread=st.booleans(),
)
def test_a_review_request_round_trips(
    request_id, tier, context, block, leniency, sampling, seed, verification, keyed, unread
):
    keyed = keyed and verification.rule == "exact"  # keyed draws go with the exact rule only
    request = ReviewRequest(
        request_id, context, block, leniency, sampling, seed, verification, keyed=keyed, probs_unread=unread
    )
    address, back = codec.decode_review_request(codec.encode_review_request(request, tier))
    assert address == codec.Address(tier)
    _same_draft(block, back.block)
    got = (back.request_id, back.context, back.leniency, back.sampling, back.seed, back.verification, back.keyed)
    assert got == (request_id, context, leniency, sampling, seed, verification, keyed)
    assert back.probs_unread == unread


def test_keyed_draws_under_a_lossy_rule_are_refused_naming_the_rule():
    with pytest.raises(ValueError, match="verification.rule"):
        ReviewRequest("r", Context([1], 1), Draft(), verification=Verification("lossy", 0.3, None), keyed=True)


@settings(max_examples=150, deadline=None)
@given(
    block=drafts(),
    token=st.integers(0, 2**31 - 1),
    usage=usages(),
    off=st.integers(0, 2**31),
    tv=st.floats(0, 100),
    loss=st.floats(-100, 100),
)
def test_a_review_reply_round_trips(block, token, usage, off, tv, loss):
    verdict = Verdict(
        len(block),
        token,
        block.token_probs + [0.5],
        None if block.dists is None else torch.cat([block.dists, block.dists[:1] if len(block) else block.dists]),
        off,
        tv,
        loss,
    )
    back = codec.decode_review_reply(codec.encode_review_reply(ReviewReply(verdict, usage)))
    v = back.verdict
    assert (v.accepted, v.token, v.token_probs, v.off_target, v.tv, v.ll_loss) == (
        verdict.accepted,
        token,
        verdict.token_probs,
        off,
        tv,
        loss,
    )
    _same_rows(verdict.dists, v.dists)
    assert back.usage == usage


@settings(max_examples=100, deadline=None)
@given(context=contexts(), data=st.data())
def test_a_context_crosses_as_the_tokens_after_the_offset_with_a_digest_of_the_rest(context, data):
    offset = data.draw(st.integers(0, len(context.tokens)))
    request = DraftRequest("r", context, 1, 1)
    address, back = codec.decode_draft_request(codec.encode_draft_request(request, "t", offset))
    assert back.context.tokens == context.tokens[offset:] and back.context.stable == context.stable
    assert address == codec.Address("t", offset, codec.prefix_digest(context.tokens[:offset]) if offset else 0)


def test_an_offset_outside_the_context_is_refused():
    with pytest.raises(ValueError, match="offset 3 outside its 2 tokens"):
        codec.encode_draft_request(DraftRequest("r", Context([1, 2], 2), 1, 1), "t", 3)


def test_a_resend_reply_decodes_to_none():
    assert codec.decode_draft_reply(codec.RESEND["draft"]) is None
    assert codec.decode_review_reply(codec.RESEND["review"]) is None


def test_a_release_round_trips():
    assert codec.decode_release(codec.encode_release(Release("r-1"))) == (None, Release("r-1"))
    address, release = codec.decode_release(codec.encode_release(Release("r-1", (5, 6, 7, 8)), "mid", 2))
    assert address == codec.Address("mid", 2, codec.prefix_digest([5, 6])) and release == Release("r-1", (7, 8))


def test_rows_cross_as_float32_on_the_cpu_whatever_their_dtype():
    rows = torch.softmax(torch.randn(3, 7), -1).to(torch.bfloat16)
    back = codec.decode_draft_reply(codec.encode_draft_reply(DraftReply(Draft([1, 2, 3], [0.1] * 3, rows, ["x"] * 3))))
    assert back.draft.dists.dtype == torch.float32 and torch.equal(back.draft.dists, rows.float())


def test_hidden_states_never_cross_the_wire():
    request = ReviewRequest("r", Context([1, 2], 2), Draft(), hidden=True)
    with pytest.raises(ValueError, match="hidden states do not cross the wire"):
        codec.encode_review_request(request, "t")


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\xff\xff\xff", "malformed DraftRequest"),
        ("not bytes", "arrives as bytes"),
    ],
)
def test_malformed_bytes_fail_as_value_errors(data, message):
    with pytest.raises(ValueError, match=message):
        codec.decode_draft_request(data)


def test_decoding_checks_what_the_types_check():
    from cascade_service.proto.tier.v1 import tier_pb2 as pb

    hot = pb.DraftRequest(context=pb.Context(tokens=[1], stable=1), sampling=pb.Sampling(temperature=math.inf))
    with pytest.raises(ValueError, match="temperature"):
        codec.decode_draft_request(hot.SerializeToString())
    beyond = pb.DraftRequest(context=pb.Context(tokens=[1], stable=2))
    with pytest.raises(ValueError, match="context.stable 2 exceeds"):
        codec.decode_draft_request(beyond.SerializeToString())
    short = pb.DraftReply(block=pb.Block(tokens=[1, 2], token_probs=[0.5]))
    with pytest.raises(ValueError, match="block: 2 tokens but 1 token_probs"):
        codec.decode_draft_reply(short.SerializeToString())
    torn = pb.DraftReply(
        block=pb.Block(tokens=[1], token_probs=[0.5], dists=pb.Rows(rows=1, cols=4, float32=b"\0" * 3))
    )
    with pytest.raises(ValueError, match="dists: 3 bytes for a 1 x 4 float32 matrix"):
        codec.decode_draft_reply(torn.SerializeToString())
    unknown = pb.ReviewRequest(context=pb.Context(tokens=[1], stable=1), verification=pb.FinalRule(rule="bogus"))
    with pytest.raises(ValueError, match="verification.rule"):
        codec.decode_review_request(unknown.SerializeToString())


def test_a_grammar_crosses_as_its_format_and_positions_and_is_checked():
    from cascade_service.core.grammar import GrammarSpec, ResponseFormat

    spec = GrammarSpec(ResponseFormat("regex", "[0-9]{3}"), 2, 4)
    request = DraftRequest("r", Context([5, 6, 7, 8, 9], 4), 3, 3, grammar=spec)
    _, decoded = codec.decode_draft_request(codec.encode_draft_request(request, "close"))
    assert decoded.grammar == spec
    # A JSON format's whitespace style crosses too: a drafter masking with another would draft tokens
    # the target's grammar refuses.
    spaced = GrammarSpec(ResponseFormat("json_object", "", "spaced"), 2, 4)
    _, decoded = codec.decode_draft_request(codec.encode_draft_request(replace(request, grammar=spaced), "close"))
    assert decoded.grammar == spaced
    _, plain = codec.decode_draft_request(codec.encode_draft_request(DraftRequest("r", Context([5], 1), 1, 1), "close"))
    assert plain.grammar is None
    for bad, message in (
        (GrammarSpec(ResponseFormat("regex", "[0-9]"), 2, 9), "^grammar.at: 9"),  # past the context
        (GrammarSpec(ResponseFormat("regex", "[0-9]"), 3, 2), "^grammar.at: 2"),  # before the output
    ):
        with pytest.raises(ValueError, match=message):
            codec.decode_draft_request(codec.encode_draft_request(replace(request, grammar=bad), "close"))
    forged = codec.pb.DraftRequest.FromString(codec.encode_draft_request(request, "close"))
    forged.grammar.kind = "xml"
    with pytest.raises(ValueError, match="^response_format must be one of"):
        codec.decode_draft_request(forged.SerializeToString())
    forged = codec.pb.DraftRequest.FromString(codec.encode_draft_request(request, "close"))
    forged.grammar.whitespace = "tabs"
    with pytest.raises(ValueError, match="^response_format.whitespace must be one of"):
        codec.decode_draft_request(forged.SerializeToString())
