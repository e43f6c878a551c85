"""Every command README.md and docs/*.md show runs as written on a fresh clone (issue 48): each config a
documented `cascade-service ...` (or `python -m cascade_service...`) command names with --config or
--tuned is in the repository and loads (load_config), and each model, bigram and head directory it
names either exists after the README's install (the shipped family, in the package) or lies in
$CASCADE_SERVICE_HOME/zoo/<preset> for a preset that a documented `zoo build --preset` makes, or in
$CASCADE_SERVICE_HOME/models/<family> for a family that a documented `models fetch` makes. A
command's --tuned configs name its --config's family: a schedule tuned on one family says nothing
about another. And every shipped config names the shipped family or a fetched real one, except those
under configs/presets/, whose file names start with the preset they need.

Placeholders (C, P, configs/FAMILY.yaml: any name with a capital letter, or not ending in .yaml) are
not files and are skipped; a YAML a documented `tune --out` writes counts as the family it was tuned on.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from cascade_service.config import ConfigError, load_config
from cascade_service.paths import families
from cascade_service.zoo.families import BUILDERS
from cascade_service.zoo.packaged import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIGS = ROOT / "configs"
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # an inline code span, which may wrap onto one more line
COMMAND = re.compile(r"cascade-service|python -m cascade_service")
PATH_FIELDS = {"path", "bigram", "head", "corpus"}  # the config fields that name files on disk


def commands(text: str) -> list[list[str]]:
    """The tokens of each cascade-service command in `text`: fenced lines (with `\\` continuations
    joined) first, then inline code spans, in document order within each."""
    lines = [
        line
        for block in FENCE.findall(text)
        for line in re.sub(r"\\\n\s*", " ", block).splitlines()
        if COMMAND.search(line)
    ]
    lines += [" ".join(span.split()) for span in SPAN.findall(FENCE.sub("", text)) if COMMAND.search(span)]
    return [_tokens(line) for line in lines]


def _tokens(line: str) -> list[str]:
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an apostrophe in prose, e.g. "<first 6 lines of the zoo's prompts.jsonl>"
        words = line.split(" #")[0].split()
    return [word.strip("[]()|") for word in words]  # "[--tuned C2]" in a synopsis is still --tuned


def option(tokens: list[str], name: str) -> list[str]:
    """The values given to `name` (`--x V` or `--x=V`)."""
    after = [tokens[i + 1] for i, tok in enumerate(tokens[:-1]) if tok == name]
    return after + [tok.split("=", 1)[1] for tok in tokens if tok.startswith(name + "=")]


def _runs(tokens: list[str], *words: str) -> bool:
    """Whether the command's subcommand is `words` (e.g. "zoo", "build"), after whatever runs it."""
    return any(tokens[i : i + len(words)] == list(words) for i in range(len(tokens)))


def documented_builds(texts: list[str]) -> set[str]:
    """The presets a documented `zoo build --preset P` (into the default home) makes."""
    built = set()
    for tokens in (t for text in texts for t in commands(text)):
        if _runs(tokens, "zoo", "build") and not option(tokens, "--out"):
            built |= {p for p in option(tokens, "--preset") if p in BUILDERS}
    return built


def documented_fetches(texts: list[str]) -> set[str]:
    """The packaged families a documented `models fetch F` (into the default home) makes."""
    runs = (t for text in texts for t in commands(text) if _runs(t, "models", "fetch") and not option(t, "--root"))
    return {word for tokens in runs for word in tokens if word in FAMILIES}


def documented_heads(texts: list[str]) -> set[str]:
    """The presets a documented `train-head --preset P` writes a head into (its zoo, by default)."""
    runs = (t for text in texts for t in commands(text) if _runs(t, "train-head"))
    return {p for tokens in runs for p in option(tokens, "--preset")}


def _files(node, name: str = "") -> list[str]:
    """Every path-naming string in a loaded config's tree."""
    if is_dataclass(node) and not isinstance(node, type):
        return [path for f in fields(node) for path in _files(getattr(node, f.name), f.name)]
    if isinstance(node, dict):
        return [path for value in node.values() for path in _files(value)]
    if isinstance(node, (tuple, list)):
        return [path for item in node for path in _files(item, name)]
    return [node] if name in PATH_FIELDS and isinstance(node, str) and node else []


class Fresh:
    """What a fresh clone has: the shipped families, an empty $CASCADE_SERVICE_HOME, and what the
    documented `zoo build` and `train-head` commands make there."""

    def __init__(self, home: Path, texts: list[str]):
        self.zoo = home / "zoo"
        self.models = home / "models"
        self.builds = documented_builds(texts)
        self.fetches = documented_fetches(texts)
        self.heads = documented_heads(texts)

    def origin(self, file: str) -> tuple[str | None, str]:
        """(the family `file` belongs to, or None; why not, where it has none)."""
        path = Path(file).resolve()
        if path.is_relative_to(families()):
            name = path.relative_to(families()).parts[0]
            return (f"shipped {name}", "") if path.exists() else (None, f"{file} is not in the package")
        if path.is_relative_to(self.models):
            family = path.relative_to(self.models).parts[0]
            if family not in self.fetches:
                return None, f"{file}: no documented `cascade-service models fetch {family}` makes it"
            return f"fetched {family}", ""
        if not path.is_relative_to(self.zoo):
            return ("a file", "") if path.exists() else (None, f"{file} does not exist")
        preset, *rest = path.relative_to(self.zoo).parts
        if preset not in BUILDERS:
            return None, f"{file}: no zoo preset {preset!r} builds it"
        if rest and rest[0].startswith("head-") and preset not in self.heads:
            return None, f"{file}: no documented `train-head --preset {preset}` writes it"
        if preset not in self.builds:
            return None, f"{file}: no documented `cascade-service zoo build --preset {preset}` makes it"
        return f"preset {preset}", ""

    def family(self, config: Path) -> tuple[str | None, list[str]]:
        """(the family of `config`'s target, or None; the problems with the files it names)."""
        try:
            cascade = load_config(config).cascade
        except ConfigError as exc:
            return None, [f"{config}: {exc}"]
        origins = {file: self.origin(file) for file in _files(cascade)}
        wrong = [why for _, why in origins.values() if why]
        named = {family for family, _ in origins.values() if family and family != "a file"}
        if len(named) > 1:
            wrong.append(f"{config} names several families: {sorted(named)}")
        return origins.get(cascade.target.path, (None, ""))[0], wrong


def _placeholder(value: str) -> bool:
    return not value.endswith((".yaml", ".yml")) or bool(re.search(r"[A-Z$<]", Path(value).name))


def problems(text: str, fresh: Fresh, doc: str = "doc") -> list[str]:
    """What keeps `text`'s commands from running as written on a fresh clone, in document order."""
    found: list[str] = []
    tuned: dict[str, str | None] = {}  # a YAML a documented `tune --out` writes -> the family it was tuned on
    for tokens in commands(text):
        family: dict[str, list[str | None]] = {}  # flag -> the family of each config it names
        for flag in ("--config", "--tuned"):
            for value in option(tokens, flag):
                if value in tuned:
                    family.setdefault(flag, []).append(tuned[value])
                    continue
                if _placeholder(value):
                    continue
                path = ROOT / value.removeprefix("/app/")  # the image's copy of configs/ (Dockerfile)
                if not path.is_file():
                    found.append(f"{doc}: `{' '.join(tokens)}` names {value}, which is not in the repository")
                    continue
                name, wrong = fresh.family(path)
                found += [f"{doc}: {why}" for why in wrong]
                family.setdefault(flag, []).append(name)
        config = (family.get("--config") or [None])[0]
        for other in family.get("--tuned", []):
            if config and other and other != config:
                found.append(f"{doc}: `{' '.join(tokens)}` runs {config} with a schedule tuned on {other}")
        if _runs(tokens, "tune"):
            tuned |= {out: config for out in option(tokens, "--out")}
    return found


def shipped_config_problems(path: Path, fresh: Fresh, relative: Path | None = None) -> list[str]:
    """A config at configs/*.yaml names the shipped family only; one at configs/presets/P[-...].yaml
    names only preset P's zoo, which a documented command builds. `relative`: where under configs/."""
    relative = relative or path.relative_to(CONFIGS)
    try:
        cascade = load_config(path).cascade
    except ConfigError as exc:
        return [f"{relative}: {exc}"]
    origins = {fresh.origin(file) for file in _files(cascade)}
    found = [f"{relative}: {why}" for _, why in origins if why]
    families_named = {family for family, _ in origins if family}
    if relative.parts[0] != "presets":
        named = [f for f in sorted(families_named) if not f.startswith(("shipped", "fetched"))]
        return found + [f"{relative} names {f}" for f in named]
    stem = relative.stem
    preset = max((p for p in BUILDERS if stem == p or stem.startswith(p + "-")), key=len, default=None)
    if preset is None:
        return found + [f"{relative}: its name starts with no zoo preset ({sorted(BUILDERS)})"]
    return found + [f"{relative} names {f}" for f in sorted(families_named) if f != f"preset {preset}"]


@pytest.fixture
def fresh(tmp_path, monkeypatch) -> Fresh:
    home = tmp_path / "fresh-home"  # nothing built: a fresh clone after the README's install
    monkeypatch.setenv("CASCADE_SERVICE_HOME", str(home))
    monkeypatch.delenv("CASCADE_SERVICE_FAMILIES", raising=False)  # the package's own families
    monkeypatch.setenv("CASCADE_REDIS_URL", "redis://127.0.0.1:6379/0")  # cluster.yaml's; never dialled
    monkeypatch.setenv("CASCADE_TIER_KEY", "unused")  # heterogeneous.yaml's
    return Fresh(home, [doc.read_text() for doc in DOCS])


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_command_names_configs_that_run_on_a_fresh_clone(doc, fresh):
    assert problems(doc.read_text(), fresh, doc.name) == []


def test_the_docs_document_commands_with_configs_and_builds(fresh):
    # The check above is only as good as its extraction: it must find the commands that are there.
    texts = [doc.read_text() for doc in DOCS]
    named = [v for text in texts for tokens in commands(text) for v in option(tokens, "--config")]
    assert "configs/demo.yaml" in named and any(v.startswith("configs/presets/") for v in named)
    assert {"demo", "grown", "quality"} <= fresh.builds


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_shipped_config_names_the_shipped_family_or_says_its_preset_in_its_name(path, fresh):
    assert shipped_config_problems(path, fresh) == []


# Negative controls: each made-up document or config breaks one rule, and the check says which.


def test_a_command_naming_a_config_not_in_the_repository_fails(fresh):
    (found,) = problems("```\ncascade-service generate --config configs/nonesuch.yaml --prompt x\n```", fresh)
    assert "configs/nonesuch.yaml, which is not in the repository" in found


def test_an_inline_command_wrapped_onto_two_lines_is_checked(fresh):
    text = "Run `cascade-service serve --config\nconfigs/nonesuch.yaml` first."
    assert problems(text, fresh) and commands(text)[0][-2:] == ["--config", "configs/nonesuch.yaml"]


def _config(tmp_path: Path, root: str, name: str = "made-up.yaml") -> Path:
    path = tmp_path / name
    path.write_text(
        f"tiers:\n  target:\n    name: large\n    path: {root}/large\n  drafters:\n"
        f"    - name: small\n      path: {root}/small\n    - kind: mag\n      bigram: {root}/bigram.json\n"
        "schedule: {k_matrix: [[2, 0], [0, 4]]}\n"
    )
    return path


@pytest.mark.parametrize(
    ("root", "why"),
    [
        ("${CASCADE_SERVICE_HOME}/zoo/nonesuch", "no zoo preset 'nonesuch' builds it"),
        ("${CASCADE_SERVICE_HOME}/zoo/grown-test", "no documented `cascade-service zoo build --preset grown-test`"),
        ("${CASCADE_SERVICE_FAMILIES}/nonesuch", "is not in the package"),
    ],
)
def test_a_config_naming_a_family_no_documented_command_makes_fails(tmp_path, fresh, root, why):
    config = _config(tmp_path, root)
    found = problems(f"```\ncascade-service serve --config {config}\n```", fresh)
    assert found and all(why in line for line in found), found


def test_a_schedule_tuned_on_another_family_fails(fresh):
    text = "```\ncascade-service bench --config configs/demo.yaml --tuned configs/presets/demo-base-mag.yaml\n```"
    (found,) = problems(text, fresh)
    assert "runs shipped quality with a schedule tuned on preset demo" in found


def test_a_tune_output_keeps_the_family_it_was_tuned_on(fresh):
    text = (
        "```\ncascade-service tune --config configs/presets/grown.yaml --prompts P --out t.yaml\n"
        "cascade-service bench --config configs/bench-quality.yaml --tuned t.yaml --prompts P\n```"
    )
    (found,) = problems(text, fresh)
    assert "runs shipped quality with a schedule tuned on preset grown" in found
    assert problems(text.replace("bench-quality.yaml", "presets/grown-bench.yaml"), fresh) == []


def test_a_shipped_config_outside_presets_naming_a_trained_zoo_fails(tmp_path, fresh):
    config = _config(tmp_path, "${CASCADE_SERVICE_HOME}/zoo/demo")
    found = shipped_config_problems(config, fresh, Path("demo-base-mag.yaml"))
    assert found == ["demo-base-mag.yaml names preset demo"]
    assert shipped_config_problems(config, fresh, Path("presets/demo-base-mag.yaml")) == []


def test_a_preset_config_naming_another_preset_fails(tmp_path, fresh):
    config = _config(tmp_path, "${CASCADE_SERVICE_HOME}/zoo/demo")
    found = shipped_config_problems(config, fresh, Path("presets/grown-bench.yaml"))
    assert found == ["presets/grown-bench.yaml names preset demo"]
    found = shipped_config_problems(config, fresh, Path("presets/nonesuch.yaml"))
    assert found == [f"presets/nonesuch.yaml: its name starts with no zoo preset ({sorted(BUILDERS)})"]
