"""The SpecDec++ acceptance prediction head (arXiv 2405.19715, Sec. 4.3).

A (D+1)-layer ResNet on the frozen drafter's final hidden state e_i (the post-norm input of its LM
head): D residual blocks x + SiLU(W x + b), then Linear(H, 1) to one logit; sigmoid of it is the
predicted probability that candidate y_i is accepted given y_<i were. The official code ends in two
logits (softmax[1] = sigmoid(l1 - l0)); one logit is the same function with fewer parameters.

Stored as `head.safetensors` (weights) + `head.json` (shape, drafter, training summary): loading
never unpickles anything.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from cascade_service.core.adaptive import AdaptiveLength, DraftStopper, make_stopper

FORMAT = "cascade-service/acceptance-head/1"
WEIGHTS, CONFIG = "head.safetensors", "head.json"


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class AcceptanceHead(nn.Module):
    """hidden [..., H] -> acceptance logit [...].

    `tie_blocks=True` applies ONE block D times: what the released code does by accident
    (`[ResBlock(h)] * D` repeats one instance). The default follows the paper's text,
    D separate blocks. `meta` carries what `save` writes beside the weights (drafter, training).
    """

    def __init__(self, hidden_size: int, depth: int = 3, tie_blocks: bool = False, meta: dict | None = None):
        super().__init__()
        if hidden_size < 1 or depth < 0:
            raise ValueError(f"need hidden_size >= 1 and depth >= 0, got {hidden_size}, {depth}")
        self.hidden_size, self.depth, self.tie_blocks = hidden_size, depth, tie_blocks
        self.blocks = nn.ModuleList(ResBlock(hidden_size) for _ in range(min(depth, 1) if tie_blocks else depth))
        self.out = nn.Linear(hidden_size, 1)
        self.meta = dict(meta or {})

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.to(self.out.weight)  # the head runs in float32 on any drafter dtype (official code)
        for i in range(self.depth):
            x = self.blocks[0 if self.tie_blocks else i](x)
        return self.out(x).squeeze(-1)

    @torch.inference_mode()
    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted acceptance probability: [..., H] -> [...] in [0, 1]."""
        return torch.sigmoid(self(hidden))

    def config(self) -> dict:
        return {
            "format": FORMAT,
            "hidden_size": self.hidden_size,
            "depth": self.depth,
            "tie_blocks": self.tie_blocks,
            **self.meta,
        }

    def save(self, out_dir: str | Path) -> Path:
        """Write head.safetensors + head.json into `out_dir` (created if missing); returns the dir."""
        out = Path(out_dir).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS), metadata={"format": FORMAT})
        (out / CONFIG).write_text(json.dumps(self.config(), indent=1) + "\n")
        return out

    @classmethod
    def load(cls, head_dir: str | Path, device: str | torch.device = "cpu") -> AcceptanceHead:
        """Load a head written by `save`; raises FileNotFoundError / ValueError on anything else."""
        path = Path(head_dir).expanduser()
        if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
            raise FileNotFoundError(f"{str(path)!r} has no {CONFIG} + {WEIGHTS}; not an acceptance head")
        config = json.loads((path / CONFIG).read_text())
        if config.get("format") != FORMAT:
            raise ValueError(f"{path / CONFIG}: format {config.get('format')!r}, expected {FORMAT!r}")
        meta = {k: v for k, v in config.items() if k not in ("format", "hidden_size", "depth", "tie_blocks")}
        head = cls(int(config["hidden_size"]), int(config["depth"]), bool(config["tie_blocks"]), meta)
        head.load_state_dict(load_file(str(path / WEIGHTS)), strict=True)
        return head.to(device).eval()


class HeadCache:
    """Acceptance heads loaded once per process and shared by requests (a head is read-only).

    `stopper(spec, hidden_size)` builds one request's stopper; a head trained on a drafter with
    another hidden size is refused (ValueError naming the head) instead of failing mid-draft.
    """

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = device
        self._heads: dict[str, AcceptanceHead] = {}
        self._lock = threading.Lock()

    def load(self, head_dir: str) -> AcceptanceHead:
        with self._lock:
            head = self._heads.get(head_dir)
            if head is None:
                head = self._heads[head_dir] = AcceptanceHead.load(head_dir, self.device)
            return head

    def stopper(self, spec: AdaptiveLength, hidden_size: int | None = None) -> DraftStopper:
        if spec.head is not None and hidden_size is not None and self.load(spec.head).hidden_size != hidden_size:
            raise ValueError(
                f"head {spec.head!r} was trained on hidden size {self.load(spec.head).hidden_size}, "
                f"this drafter has {hidden_size}"
            )
        return make_stopper(spec, self.load)
