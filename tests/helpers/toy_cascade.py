"""Sampling the cascade over toy models (tests/unit/toy.py), for the exact-distribution tests of every transport."""

from __future__ import annotations

from collections import Counter

import torch

from cascade_service.core.cascade import Lookup, RequestState, build_cascade
from cascade_service.core.decode import decode
from cascade_service.core.local import StatisticalTier, local_tiers
from cascade_service.core.proposers.mag import BigramTable, MaxGram
from cascade_service.core.proposers.prediction import PREDICTION, PredictionProposer
from cascade_service.core.schedule import Schedule
from cascade_service.core.stats import CascadeStats
from cascade_service.tierhost.loopback import loopback

from .toy import ToyGrammar, ToyScorer, exact_distribution

VOCAB, LENGTH, SAMPLES = 4, 3, 4000
PROMPT = [0, 1, 2, 0, 1]


def toy_tiers(target_dtype=torch.float32, drafter_dtype=torch.float32):
    target = ToyScorer("target", VOCAB, seed=1, dtype=target_dtype)
    base = ToyScorer("base", VOCAB, seed=2, base=target, noise=1.5, dtype=drafter_dtype)
    small = ToyScorer("small", VOCAB, seed=3, base=target, noise=3.0, dtype=drafter_dtype)
    return target, base, small


def sample_cascade(
    drafter_names,
    k_matrix,
    leniency,
    sampling,
    samples=SAMPLES,
    seed=0,
    lookup=None,
    dtypes=(torch.float32, torch.float32),
    wire=False,
    wrap=None,
    prediction=None,
    grammar=False,
    policy=None,
    keyed=True,
):
    """Counts of the cascade's 3-token continuations over `samples` requests, and the exact target
    distribution. wire: every tier behind the wire codec in this process; wrap(tier, request_id): any
    other transport (a tier server); prediction: token ids the request predicts (core.proposers.prediction);
    grammar: the request's output constrained by a ToyGrammar (and the exact distribution with it);
    policy(): each request's block policy at the target (the K-matrix as configured when None); keyed:
    a sampled request draws by position, as a lossless served one does (core.sampling `race`), else
    by speculative sampling from its generator, as the inner reviews of a lossy request do."""
    target, base, small = toy_tiers(*dtypes)
    models = {"base": base, "small": small}
    bigram = BigramTable.from_tokens([0, 1, 2, 3, 0, 2, 1, 3, 3, 1], VOCAB)
    schedule = Schedule.parse(k_matrix, drafter_names)
    counts: Counter = Counter()
    for i in range(samples):
        state = RequestState(
            sampling, torch.Generator().manual_seed(seed * 1_000_003 + i), CascadeStats("target"), VOCAB
        )
        state.request_id = f"sample-{seed}-{i}"
        state.seed, state.keyed = seed * 1_000_003 + i, keyed and not sampling.greedy
        if prediction is not None:
            state.prediction = StatisticalTier(PredictionProposer(prediction), VOCAB, PREDICTION)
        if grammar:
            state.grammar = ToyGrammar(VOCAB, PROMPT[-1])  # type: ignore[assignment]  # GrammarMask's interface
        if policy is not None:
            state.policy = policy()
        drafters = [MaxGram(bigram) if n == "mag" else models[n] for n in drafter_names]
        top, below = local_tiers(VOCAB, target, drafters)
        if wire:  # every tier behind the wire codec, as a remote tier is
            top, below = loopback(top), [loopback(t) for t in below]
        if wrap is not None:
            top, below = wrap(top, state.request_id), [wrap(t, state.request_id) for t in below]
        system = build_cascade(top, below, schedule, leniency, state, lookup)
        out = [t for chunk in decode(system, PROMPT, LENGTH, state) for t in chunk]
        counts[tuple(out)] += 1
    rule = ToyGrammar(VOCAB, PROMPT[-1]) if grammar else None
    return counts, exact_distribution(target, PROMPT, LENGTH, sampling, rule)


CASES = {
    "sd_small": (["small"], [[3]], 1.0),
    # PROMPT repeats [0, 1], so the MaG gate opens at the target on the first round and later ones
    "csd_base_mag_lookup": (["base", "mag"], [[2, 0], [0, 3]], 2.0, Lookup(1, 3)),
    "csd_base_mag_lenient": (["base", "mag"], [[2, 2], [0, 3]], 3.0),
    "csd_base_small_mag_lenient": (["base", "small", "mag"], [[2, 1, 1], [0, 2, 2], [0, 0, 3]], 2.0),
}
