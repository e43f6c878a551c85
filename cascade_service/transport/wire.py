"""The tier API's service on the wire: its name and how large a message may be, for both ends."""

from __future__ import annotations

from ..core.tier import TierFacts
from ..proto.tier.v1 import tier_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["Tier"].full_name  # cascade.tier.v1.Tier
# Sampling sends full distribution rows (block x vocabulary float32): room for a long block of a large
# vocabulary, and a bound on what one call can make the server buffer.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def facts_from_pb(info: pb.TierInfo) -> TierFacts:
    """A tier's facts from the tier API's `TierInfo` (a tier server's or deployment's `info()`; 0
    max_positions: no limit)."""
    return TierFacts(
        int(info.vocab_size),
        int(info.num_parameters),
        tuple(int(t) for t in info.eos_token_ids),
        int(info.max_positions) or None,
        str(info.device),
        int(info.decoder_start) if info.encoder_decoder else None,
    )
