"""A draft call's grammar (structured output, core.grammar) on the tier wire: its spec out, checked in."""

from __future__ import annotations

from ..core.grammar import GrammarMask, GrammarSpec, ResponseFormat
from ..proto.tier.v1 import tier_pb2 as pb


def grammar_out(grammar: GrammarMask | GrammarSpec | None) -> pb.Grammar | None:
    """A draft call's grammar on the tier wire (transport.codec): its spec, whether it is a state here."""
    spec = grammar.spec() if isinstance(grammar, GrammarMask) else grammar
    if spec is None:
        return None
    fmt = spec.response_format
    return pb.Grammar(kind=fmt.kind, text=fmt.text, whitespace=fmt.whitespace, start=spec.start, at=spec.at)


def grammar_in(m: pb.DraftRequest) -> GrammarSpec | None:
    """The spec a draft call carries, checked against its context (ValueError naming the field)."""
    if not m.HasField("grammar"):
        return None
    g = m.grammar
    if not g.start <= g.at <= len(m.context.tokens) + m.context.offset:
        raise ValueError(f"grammar.at: {g.at} is not within the context (output from {g.start})")
    return GrammarSpec(ResponseFormat(g.kind, g.text, g.whitespace), g.start, g.at)  # ValueError naming response_format
