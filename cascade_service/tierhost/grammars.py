"""A tier server's grammar states (structured output, core.grammar): one per request, following the
committed output that each call's context carries, so the tier's drafter masks every step as a drafter in
the coordinator's process does.

Soft state, like the KV caches: kept under the request id (LRU, bounded), dropped at the request's release;
a call that finds none, or finds one this request's context does not extend (another replica served the
previous rounds), replays the output from the spec's start. A tier without a tokenizer beside its weights
drafts unmasked (the target's review still masks).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from ..config import ModelTierConfig
from ..core.grammar import GrammarMask, GrammarSpec, grammar_tokenizer
from ..core.types import Context
from ..models.hf import load_tokenizer

log = logging.getLogger(__name__)


class TierGrammars:
    def __init__(self, tier: ModelTierConfig, vocab_size: int, max_cached: int):
        self.tier, self.vocab_size, self.max_cached = tier, vocab_size, max_cached
        self._states: OrderedDict[str, GrammarMask] = OrderedDict()
        self._tokenizer: Any = None  # llguidance's view of the tier's tokenizer; False: it has none
        self._lock = threading.Lock()
        self.replays = 0  # states built from the output's start (a miss, or another replica's history)

    def of(self, request_id: str) -> Callable[[GrammarSpec, Context], GrammarMask | None]:
        """What the request's ModelTier calls with a call's spec and context (core.local.ModelTier)."""
        return lambda spec, context: self.follow(request_id, spec, context)

    def follow(self, request_id: str, spec: GrammarSpec, context: Context) -> GrammarMask | None:
        """The request's state, advanced to the committed sequence `spec.at` of `context`."""
        tokenizer = self._grammar_tokenizer()
        if tokenizer is None:
            return None
        with self._lock:
            state = self._states.pop(request_id, None)
        same = state is not None and state.response_format == spec.response_format and state.start == spec.start
        if state is None or not same or state.at > spec.at:
            state = self._replay(tokenizer, spec, context.tokens)
        else:
            try:
                state.follow(context.tokens, spec.at)
            except RuntimeError:  # its history is not this context's: build it again
                state = self._replay(tokenizer, spec, context.tokens)
        with self._lock:
            self._states[request_id] = state
            while len(self._states) > self.max_cached:
                self._states.popitem(last=False)
        return state

    def __len__(self) -> int:
        with self._lock:
            return len(self._states)

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._states.pop(request_id, None)

    def _replay(self, tokenizer: Any, spec: GrammarSpec, tokens: Sequence[int]) -> GrammarMask:
        self.replays += 1
        state = GrammarMask(tokenizer, spec.response_format, self.vocab_size, spec.start)
        state.follow(tokens, spec.at)  # committed tokens the coordinator's grammar took: refused only if forged
        return state

    def _grammar_tokenizer(self) -> Any:
        if self._tokenizer is None:
            try:
                self._tokenizer = grammar_tokenizer(load_tokenizer(self.tier.path))
            except (OSError, ValueError) as exc:  # no tokenizer files beside the weights
                log.warning("tier %r: no tokenizer (%s): it drafts unmasked under a format", self.tier.name, exc)
                self._tokenizer = False
        return self._tokenizer or None
