"""Tier hosting: what a tier server process runs (`cascade-service tier`, a Ray tier replica).

`group.TierGroup` serves a process's tiers (model tiers, MaG, sub-cascades) from its engine core
(engine.core), `host.TierHost` decodes each call and keeps the contexts it was sent,
`server` serves them as the gRPC tier API. transport/ is the wire and the coordinator's view of a
remote tier; it imports nothing of this package.
"""
