"""Probability rows on the wire between the coordinator and tier replicas.

Rows leave a process as numpy float32 arrays on the CPU (`core.placement.to_host`: the receiver may
have no GPU, and numpy holds neither GPU memory nor bfloat16) and arrive as CPU tensors; the reviewer
that takes them moves them to its device (`core.placement.to_reviewer`). Kept out of `core`, which
imports only the standard library and torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..core.placement import to_host


def rows_out(rows: torch.Tensor | None) -> np.ndarray | None:
    """Rows as they leave this process (None passes through)."""
    return None if rows is None else to_host(rows).numpy()


def rows_in(array: Any) -> torch.Tensor | None:
    """Rows as they arrive from another process: float32 on the CPU (None passes through)."""
    return None if array is None else torch.from_numpy(np.asarray(array, dtype=np.float32))
