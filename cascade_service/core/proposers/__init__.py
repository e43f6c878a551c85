"""Drafters without weights that propose tokens from what they have seen: MaG's max-gram lookups and
bigram table (`mag`), suffix decoding over recent requests and a corpus (`suffix`), a request's own
predicted output (`prediction`). Each request's state is a `core.local.Proposer`."""
