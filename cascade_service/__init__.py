"""cascade-service: Cascade Speculative Drafting as a service."""

import os

# gRPC's C core installs fork handlers by default: a child forked while another thread is inside gRPC
# (our edge and tier servers, Ray's own clients) runs gRPC's pollers between fork and exec, and can
# hang or crash there. Ray starts its GCS, raylet and workers with fork + exec from the very process
# that serves gRPC (LocalService, the tests), and CI once saw ray.init time out waiting for a GCS that
# never started. Nothing here uses gRPC across a fork, so the handlers are off unless the operator
# says otherwise; the setting must be in place before gRPC initialises, hence here.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# torch's CPU allocator backs its allocations of 2 MB and more with transparent huge pages (aligned, and
# madvise(MADV_HUGEPAGE)) where this is set: the weights and the KV pools, which a pass streams through
# (a batched pass gathers every row's blocks, each layer). Without it, a server process's pages fell
# where they fell, and the process kept that luck for its life: two identical plain servers read 0.76-
# 1.19x each other at 64 streams on a 2-core host; with it, 0.93-1.01x, and a plain server ran a median
# 1.09x faster than one without (7 paired fresh pairs; docs/benchmarks.md, "Under load"). The allocator
# reads it once, at its first allocation, so it must be set before torch allocates: here, before any
# module of this package imports torch. An operator's own setting (0 turns it off) stands. The other side:
# a tensor of 2 MB or more allocated afresh is new pages every time (548 us against 36 us to refill a kept
# one), so a hot path keeps its large buffers (models.kvpool KVPool.window) rather than allocating them.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
