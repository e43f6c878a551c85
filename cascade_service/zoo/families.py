"""Every model family the project can use, by name, and how to get it: the one registry behind
`zoo build --preset` and `demo --preset`.

- shipped: trained once and shipped with the package (zoo/shipped.py); no training on a new machine.
  `zoo build --preset quality` still rebuilds it from its recipe, into $CASCADE_SERVICE_HOME.
- built: trained here from a recipe (zoo/build.py: demo, quality-short, test; zoo/t5.py: t5, t5-test).
- grown: made here from another family in minutes (zoo/grown.py: grown, grown-test).
- lengthened: another family trained further at long contexts, drafters distilled against it
  (zoo/lengthen.py: quality from quality-short, long-test from test).
- tiny: random weights (zoo/tiny.py), for tests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

Paths = dict[str, Path]


def _built(preset: str, out: Path) -> Paths:
    from .build import build_zoo

    return build_zoo(preset, out)


def _t5(preset: str, out: Path) -> Paths:
    from .t5 import build_t5_zoo

    return build_t5_zoo(preset, out)


def _grown(preset: str, out: Path) -> Paths:
    from .grown import GROWN_PRESETS, build_grown

    return build_grown(preset, out, family(GROWN_PRESETS[preset].source))  # shipped, or built here first


def _long(preset: str, out: Path) -> Paths:
    from .lengthen import LONG_PRESETS, build_long

    return build_long(preset, out, family(LONG_PRESETS[preset].source))


def _tiny(preset: str, out: Path) -> Paths:
    from .tiny import build_family

    return build_family(out)


# preset -> (how `zoo build` makes it, a line for --help)
BUILDERS: dict[str, tuple[Callable[[str, Path], Paths], str]] = {
    "demo": (_built, "trained here (about 8-14 minutes on 2 cores)"),
    "quality": (_long, "the shipped family, rebuilt here: quality-short, then lengthened (about 1 h 40 min)"),
    "quality-short": (_built, "the shipped family's first stage: 256-token windows (about 77 minutes)"),
    "test": (_built, "trained, tiny (under a minute)"),
    "tiny": (_tiny, "random weights (seconds)"),
    "t5": (_t5, "an encoder-decoder family, docstring -> code (minutes)"),
    "t5-test": (_t5, "the same, tiny (seconds)"),
    "grown": (_grown, "the shipped family's target grown to 27M parameters, trained briefly, drafters distilled"),
    "grown-test": (_grown, "the same from the test zoo (seconds)"),
    "long-test": (_long, "the test zoo lengthened, drafters distilled (seconds)"),
}


def build(preset: str, out: str | Path) -> Paths:
    """`zoo build --preset`: make (or reuse) the family in `out`."""
    if preset not in BUILDERS:
        raise ValueError(f"unknown zoo preset {preset!r}; expected one of {sorted(BUILDERS)}")
    return BUILDERS[preset][0](preset, Path(out))


def family(preset: str = "quality") -> Paths:
    """A family to use (the demo's): shipped with the package where one is, else made (or reused) in
    $CASCADE_SERVICE_HOME/zoo/<preset>."""
    from ..paths import zoo_dir
    from .shipped import family_dir, shipped_zoo

    return shipped_zoo(preset) if family_dir(preset).is_dir() else build(preset, zoo_dir(preset))
