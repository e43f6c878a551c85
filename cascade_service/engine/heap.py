"""A serving process's startup heap, frozen once it is ready to serve (`freeze_startup_heap`).

Everything alive when a server has loaded its models and warmed them (modules and parameters, tokenizers,
KV pools, the gRPC server, CUDA graphs' buffers) lives as long as the process, yet CPython's cyclic
collector walks all of it at every collection of its oldest generation, on whichever thread allocated
last: under load that is the engine loop, and the walk is a stall of every request in flight. What
requests allocate per round (drafts, verdicts, stats) is freed by reference counting and never needs the
collector. `gc.freeze()` moves the startup objects to a permanent generation the collector skips, as
vLLM's engine core, SGLang and TensorRT-LLM do after warm-up. A cycle among the frozen objects that
becomes garbage later is never collected: bounded by the startup heap, and nothing of it is replaced
per request. The serving entry points call it (`serve`, `tier`, the Ray app's replicas), under
`serving.freeze_heap` (on by default); the library (`InProcess`) never does: its process is the caller's.
"""

from __future__ import annotations

import atexit
import gc
import logging

from ..metrics import default_metrics

log = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect once (garbage of the start-up goes now, not frozen), then freeze every object alive: the
    collector's later walks see only what was allocated since. Returns the objects frozen (the process's
    total: a second call adds what came since the first)."""
    gc.collect()
    gc.freeze()
    # Back to the collector before the interpreter's own shutdown tears modules down: C extensions'
    # objects left frozen through finalization have crashed other projects' exits (a Cython/DuckDB
    # service's tests aborted at exit until it unfroze on shutdown). Registered once, however many calls.
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
    frozen = gc.get_freeze_count()
    default_metrics().heap_frozen.set(frozen)
    log.info("%s: %d objects alive at start-up frozen out of the cyclic collector's walks", what, frozen)
    return frozen
