"""The code the benchmarks judge a family on, and the check that keeps it out of every training text.

A family is judged on code it never trained on:

- the evaluation packages (`zoo.evaluate.EVAL_PACKAGES`: a built family's prompts.jsonl, its report's
  figures, the t5 family's prompts, `distill`'s reports in the family recipes);
- the packages every prompt set under `cascade_service/bench/prompts` is cut from (each line's
  `"source"`, "<package> <version>: <module>"; `bench.prompt_sets.SOURCES` made disagree.jsonl).

A recipe that trains on installed packages (zoo/lengthen.py) names them by import name; before any
training, `check_training_packages` refuses one that is judged, one that depends on a judged package
(fastapi is written against starlette and anyio: training on it teaches their API and their idioms),
one whose dependencies cannot be read (a package installed without metadata, a dependency missing),
and one that is not installed here (the training text would then depend on the machine, and the family
built under the recipe's name and cache key would be a different one). The evidence for "depends on" is
the installed distributions' metadata, `importlib.metadata.requires()`, followed transitively through
the requirements that hold on this machine; a requirement that holds only on another platform or Python
is checked by name. Optional extras are not followed: they are not dependencies (markdown-it-py's `rtd`
extra names PyYAML to build its documentation; its code does not use it).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

# Pure-Python, documented library code that an install of this project always brings along: click (for
# uvicorn), jinja2 (for torch), packaging (for transformers), tqdm (ours). Missing ones are skipped.
EVAL_PACKAGES = ("click", "jinja2", "packaging", "tqdm")


def eval_package_files(packages: Sequence[str] = EVAL_PACKAGES) -> dict[str, list[Path]]:
    """Package name -> its *.py files, sorted, for the packages installed here (tests excluded)."""
    found = {}
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        files = sorted(p for p in root.rglob("*.py") if not {"test", "tests"} & set(p.relative_to(root).parts))
        if files:
            found[name] = files
    return found


# The benchmarks' shipped prompt sets (package data of cascade_service.bench, read by path: the zoo's
# layer does not import the bench's).
PROMPTS_DIR = Path(__file__).resolve().parents[1] / "bench" / "prompts"

# (package, module file inside it) that bench/prompts/disagree.jsonl is cut from (bench.prompt_sets
# rebuilds it): permissively licensed (BSD-3 / MIT) code, installed with the service's own dependencies
# (starlette and uvicorn with the HTTP API, anyio and h11 under them, PyYAML with the configs), two
# modules each.
SOURCES = (
    ("starlette", "routing.py"),
    ("starlette", "datastructures.py"),
    ("uvicorn", "config.py"),
    ("uvicorn", "protocols/http/h11_impl.py"),
    ("yaml", "emitter.py"),
    ("yaml", "constructor.py"),
    ("h11", "_connection.py"),
    ("h11", "_readers.py"),
    ("anyio", "_core/_fileio.py"),
    ("anyio", "streams/memory.py"),
    ("attr", "_make.py"),
    ("attr", "validators.py"),
)

# Distribution names of judged import names that differ from them, for a judged package not installed
# here (an installed one's distribution is read from its metadata).
_ALIASES = {"yaml": "PyYAML", "attr": "attrs"}
_SOURCE = re.compile(r"\s*([A-Za-z0-9_.\-]+)")


class JudgedCodeError(ValueError):
    """A recipe would train on judged code, or on code the check cannot clear; the message names each."""


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution_version(package: str, provided: Mapping[str, Sequence[str]] | None = None) -> str:
    """The installed version of the distribution that provides import name `package` (markdown_it:
    markdown-it-py's), or "unknown" where no metadata names it."""
    provided = importlib.metadata.packages_distributions() if provided is None else provided
    for name in sorted(set(provided.get(package, ()))) or [_ALIASES.get(package, package)]:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def prompt_set_packages(directory: Path | None = None) -> dict[str, list[str]]:
    """Import name -> the prompt sets under `directory` (the benchmarks' shipped ones) cut from it, from
    each line's "source"; a line without one is an error, since what it was cut from is then unknown."""
    root = PROMPTS_DIR if directory is None else directory
    named: dict[str, list[str]] = {}
    for path in sorted(root.glob("*.jsonl")):
        where = f"bench/prompts/{path.name}"
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            source = json.loads(line).get("source")
            match = _SOURCE.match(source) if isinstance(source, str) else None
            if match is None:
                raise JudgedCodeError(
                    f'{path} line {number}: no "source" naming the package it was cut from, so the code '
                    "it judges on cannot be kept out of training"
                )
            named.setdefault(match.group(1), [])
            if where not in named[match.group(1)]:
                named[match.group(1)].append(where)
    return named


def judged_packages() -> dict[str, list[str]]:
    """Import name -> where it is named as code a benchmark or report judges on."""
    named: dict[str, list[str]] = {name: ["zoo.evaluate.EVAL_PACKAGES"] for name in EVAL_PACKAGES}
    for name, _ in SOURCES:
        if "bench.prompt_sets.SOURCES" not in named.setdefault(name, []):
            named[name].append("bench.prompt_sets.SOURCES")
    for name, sets in prompt_set_packages().items():
        named.setdefault(name, []).extend(s for s in sets if s not in named[name])
    return dict(sorted(named.items()))


def check_training_packages(
    packages: Sequence[str], judged: Mapping[str, Sequence[str]] | None = None, who: str = "training"
) -> dict[str, dict]:
    """For each package a recipe trains on (import names): its distribution, version and the
    distributions it depends on, transitively. Raises JudgedCodeError naming every package that is
    judged (`judged`, default `judged_packages()`), depends on a judged one (with the chain), cannot be
    cleared (unknown metadata) or is not installed here."""
    judged = judged_packages() if judged is None else judged
    provided = importlib.metadata.packages_distributions()
    judged_by: dict[str, str] = {}  # canonical distribution name -> the judged import name
    for name in judged:
        for dist in [*provided.get(name, ()), _ALIASES.get(name, name)]:
            judged_by.setdefault(canonical(dist), name)
    installed = eval_package_files(packages)
    problems: dict[str, list[str]] = {}
    found: dict[str, dict] = {}
    for package in packages:
        same = [judged_by[canonical(d)] for d in provided.get(package, ()) if canonical(d) in judged_by]
        if package in judged or same:
            named = judged[package] if package in judged else judged[same[0]]
            problems[package] = [f"judged code (named by {', '.join(named)})"]
            continue
        if package not in installed:
            problems[package] = ["not installed here (no package of that name with Python files)"]
            continue
        dists = sorted(set(provided.get(package, ())))
        if not dists:
            problems[package] = [
                "unknown: no installed distribution's metadata names it, so its dependencies cannot be read"
            ]
            continue
        depends, trouble = _dependencies(dists, judged_by, judged)
        if trouble:
            problems[package] = trouble
            continue
        found[package] = {
            "distribution": dists[0],
            "version": distribution_version(package, provided),
            "depends_on": sorted(depends),
        }
    if problems:
        listed = "; ".join(f"{package}: {' and '.join(reasons)}" for package, reasons in problems.items())
        raise JudgedCodeError(f"{who}: refusing to train on {', '.join(problems)}: {listed}")
    return found


def _dependencies(
    dists: Sequence[str], judged_by: Mapping[str, str], judged: Mapping[str, Sequence[str]]
) -> tuple[set[str], list[str]]:
    """The distributions `dists` depend on, transitively (canonical names), and what disqualifies them:
    a chain to a judged distribution, or one whose metadata cannot be read."""
    from packaging.requirements import InvalidRequirement, Requirement  # transformers' own dependency

    seen = {canonical(d) for d in dists}
    chains = {canonical(d): d for d in dists}
    queue = list(dists)
    depends: set[str] = set()
    trouble: list[str] = []
    while queue:
        dist = queue.pop(0)
        chain = chains[canonical(dist)]
        try:
            requires = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            trouble.append(f"unknown: depends on {chain}, whose metadata cannot be read (not installed here)")
            continue
        except (OSError, ValueError) as exc:
            trouble.append(f"unknown: the metadata of {chain} cannot be read ({exc})")
            continue
        for text in requires:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                trouble.append(f"unknown: {chain} names a requirement that cannot be read: {text!r}")
                continue
            marker = req.marker
            here = marker is None or marker.evaluate({"extra": ""})
            if not here and "extra" in str(marker):
                continue  # an optional extra: not a dependency
            name = canonical(req.name)
            if name in judged_by:
                judged_name = judged_by[name]
                trouble.append(
                    f"depends on judged code: {chain} -> {req.name} ({judged_name}, named by "
                    f"{', '.join(judged[judged_name])})"
                )
                continue
            if here and name not in seen:
                seen.add(name)
                depends.add(name)
                chains[name] = f"{chain} -> {req.name}"
                queue.append(req.name)
    return depends, trouble
