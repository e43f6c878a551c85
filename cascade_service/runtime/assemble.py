"""One way to assemble a coordinator, whatever loads the tiers.

The in-process engine and the standalone server hold their models; the Ray app asks its tier replicas
(and loads the tiers colocated with it). Each describes its model tiers by the same `TierFacts`, and
`assemble_coordinator` turns those into what the coordinator is told: the target's vocabulary and
end-of-sequence ids, each drafter's parameter cost, the context every tier holds, after checking that
the vocabularies agree. Sessions come from `session_store`: Redis where the config names it, else the
wiring's own store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..config import CascadeConfig, GenerationConfig, ServingConfig
from ..coordinator import Coordinator, LeafFactory, TierFactory, Tokenizer, smallest_context
from ..core.adaptive import StopperFactory
from ..core.policy import PolicyFactory
from ..core.tier import TierFacts
from ..engine.leaves import Leaves
from ..engine.loop import Blocking, TaskLoop
from ..extras import require
from ..metrics import default_metrics
from ..models.detokenize import text_decoder
from ..sessions import SessionStore
from ..startup import check_vocabularies


def hf_tokenizer(tokenizer: Any) -> Tokenizer:
    """The coordinator's view of a `transformers` tokenizer."""
    return Tokenizer(lambda text: list(tokenizer(text)["input_ids"]), text_decoder(tokenizer), tokenizer)


def assemble_coordinator(
    cascade: CascadeConfig,
    facts: Mapping[str, TierFacts],
    tokenizer: Tokenizer,
    tiers: TierFactory,
    store: SessionStore,
    defaults: GenerationConfig,
    *,
    leaves: LeafFactory | None = None,
    make_stopper: StopperFactory | None = None,
    policies: PolicyFactory | None = None,
    loop: TaskLoop | None = None,
) -> Coordinator:
    """A coordinator over model tiers described by `facts` (tier name -> TierFacts, the target's
    included). A drafter whose vocabulary is not the target's fails here, before any request.
    `leaves`: the wiring's statistical drafters (engine.leaves), made from `cascade` when not given."""
    check_vocabularies(cascade, {name: f.vocab_size for name, f in facts.items()}, tokenizers=False)
    target = facts[cascade.target.name]
    if leaves is None:
        leaves = Leaves(cascade.drafters, target.vocab_size, tokenizer.encode)
    return Coordinator(
        cascade,
        tokenizer,
        target.vocab_size,
        frozenset(target.eos_token_ids),
        tiers=tiers,
        store=store,
        defaults=defaults,
        leaves=leaves,
        make_stopper=make_stopper,
        policies=policies,
        param_costs={
            name: f.num_parameters / target.num_parameters for name, f in facts.items() if name != cascade.target.name
        },
        max_context=smallest_context(f.max_positions for f in facts.values()),
        decoder_start=target.decoder_start,
        metrics=default_metrics(),
        loop=loop,
    )


def session_store(
    serving: ServingConfig, embedded: Callable[[], SessionStore], redis_url: str | None = None
) -> SessionStore:
    """Redis where `redis_url` (the command line's, which wins) or serving.redis_url names it, else
    `embedded()`: the wiring's own store (in memory for one process, an actor for a Ray cluster)."""
    url = redis_url or serving.redis_url
    if url:
        require("redis", "a Redis session store (serving.redis_url, --redis-url)")
        from ..sessions.redis_store import RedisStore

        # Its calls wait on the network: an engine loop task runs them on the loop's executor.
        return Blocking(  # type: ignore[return-value]  # a SessionStore, its calls parked
            RedisStore(
                url,
                namespace=serving.session_namespace,
                ttl_s=serving.session_ttl_s,
                max_sessions_per_owner=serving.max_sessions_per_key,
            )
        )
    return embedded()
