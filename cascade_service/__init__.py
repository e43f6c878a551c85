"""cascade-service: Cascade Speculative Drafting as a service."""

import os

# gRPC's C core installs fork handlers by default: a child forked while another thread is inside gRPC
# (our edge and tier servers, Ray's own clients) runs gRPC's pollers between fork and exec, and can
# hang or crash there. Ray starts its GCS, raylet and workers with fork + exec from the very process
# that serves gRPC (LocalService, the tests), and CI once saw ray.init time out waiting for a GCS that
# never started. Nothing here uses gRPC across a fork, so the handlers are off unless the operator
# says otherwise; the setting must be in place before gRPC initialises, hence here.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"
