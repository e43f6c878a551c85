"""The demo's cascade over a zoo family: its tuned schedule, its service layouts, and the config
`cascade-service demo` (and the service benchmarks) write for them."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..core.cascade import Lookup
from ..paths import zoo_dir

# Tuned on the zoo's tune prompts (`cascade-service tune`, see docs/usage.md "tune"), every entry running.
DEMO_K_MATRIX = [[1, 0, 0], [0, 1, 5], [0, 0, 4]]  # = configs/demo.yaml
DEMO_LENIENCY = 2.0
DEMO_LOOKUP = Lookup(min_match=2, tokens=10)
# Service layouts (docs/benchmarks.md "The service against in-process" measures each). "colocated", the default
# on one machine: every model tier inside the coordinator's replica, so a round costs no Ray hop (a handle call is
# 1.1-2 ms here, a round of the demo cascade about 5 ms; on one machine the tiers share its cores either way).
# "embedded": large inside the coordinator and base + small sharing a deployment, where base's whole sub-cascade
# (base reviewing small reviewing MaG) runs in one call. "separate": a deployment per tier, as on a cluster.
LAYOUTS = {
    # One torch thread: with two, the replica's tiny ops stalled on OpenMP barriers beside Ray's processes
    # on a 2-core host (0.30x in-process instead of 0.64-0.71x).
    "colocated": {"colocate": ["large", "base", "small"], "torch_threads": 1},
    "embedded": {"colocate": ["large"], "groups": [["base", "small"]]},
    "separate": {},
}
DEFAULT_LAYOUT = "colocated"
DEFAULT_PRESET = "quality"  # shipped with the package (zoo/shipped.py): the demo trains nothing


def demo_config(preset: str = DEFAULT_PRESET, layout: str = DEFAULT_LAYOUT) -> Path:
    """Find (or make) the family and write the demo's config into $CASCADE_SERVICE_HOME/zoo/<preset>
    (absolute paths, the tuned schedule)."""
    from .families import family

    zoo = family(preset)
    raw = {
        "tiers": {
            "target": {"name": "large", "path": str(zoo["large"])},
            "drafters": [
                # Drafters on the lean forward (models/lean.py), as in configs/demo.yaml.
                {"name": "base", "path": str(zoo["base"]), "backend": "lean"},
                {"name": "small", "path": str(zoo["small"]), "backend": "lean"},
                {"kind": "mag", "bigram": str(zoo["bigram"])},
            ],
        },
        "schedule": {
            "k_matrix": DEMO_K_MATRIX,
            "leniency": DEMO_LENIENCY,
            "lookup": {"min_match": DEMO_LOOKUP.min_match, "tokens": DEMO_LOOKUP.tokens},
        },
        "serving": LAYOUTS[layout],
    }
    path = Path(zoo_dir(preset)) / f"demo-service-{layout}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Written by `cascade-service demo`.\n" + yaml.safe_dump(raw, sort_keys=False))
    return path
