"""gRPC helpers both sides of every wire share: API keys and TLS (`auth`), server reflection
(`reflection`). Neutral: the client edge (api/), the tier transport (transport/) and tier hosting
(tierhost/) import them; they import only the stubs (proto/)."""
