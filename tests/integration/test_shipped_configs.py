"""Every shipped config runs as its K-matrix says: each drafter it names drafts, and each positive
entry runs in every block of its row that leaves it room (invariant 7, per block: the rows' counters).

The configs point at the shipped family (in the package) and, under configs/presets/, at
`$CASCADE_SERVICE_HOME/zoo/{demo,test,tiny,t5,grown}`. The `test` zoo has the same tier names (large,
base, small, bigram) as the demo zoo and trains in under a minute, so it stands in for `demo` here;
`tiny` is the random-weight family; the `t5-test` preset stands in for `t5`, `grown-test` for `grown`.
Device and dtype are set to CPU float32: the schedule, not the placement, is what this checks (the GPU suite
covers placement). Tiers a config names by address run on tier servers started here on loopback,
built from the same config.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import pytest

from cascade_service.config import ModelTierConfig, StatisticalConfig, SuffixConfig, load_config
from cascade_service.core.stats import Usage, absorb
from cascade_service.inprocess import InProcess
from cascade_service.zoo.tiny import build_family

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
# Configs of a real family fetched with `cascade-service models fetch` (9.6 GB, not in a test home):
# tests/integration/test_real_family.py runs each where it is fetched, and checks its drafters draft.
FETCHED = {"qwen2.5-coder.yaml"}
CONFIGS = sorted(p for p in CONFIGS_DIR.rglob("*.yaml") if str(p.relative_to(CONFIGS_DIR)) not in FETCHED)


@pytest.fixture(scope="module")
def home(test_zoo_home: Path) -> Path:
    zoo = test_zoo_home / "zoo"
    if not (zoo / "demo").exists():
        (zoo / "demo").symlink_to(zoo / "test", target_is_directory=True)
    if not (zoo / "tiny").exists():
        build_family(zoo / "tiny")
    if not (zoo / "t5").exists():  # configs/presets/t5.yaml's family: the t5-test preset stands in (seconds)
        from cascade_service.zoo.t5 import build_t5_zoo

        build_t5_zoo("t5-test", zoo / "t5")
    if not (zoo / "grown").exists():  # configs/presets/grown.yaml's: grown-test stands in (from the test zoo, seconds)
        from cascade_service.zoo.families import family
        from cascade_service.zoo.grown import build_grown

        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("CASCADE_SERVICE_HOME", str(test_zoo_home))
            build_grown("grown-test", zoo / "grown", family("test"), progress=False)
    return test_zoo_home


def _on_cpu(tier):
    return replace(tier, device="cpu", dtype="float32") if isinstance(tier, ModelTierConfig) else tier


def test_every_shipped_config_is_checked():
    names = {str(p.relative_to(CONFIGS_DIR)) for p in CONFIGS}
    assert names >= {"demo.yaml", "presets/demo.yaml", "presets/test.yaml", "cluster.yaml", "heterogeneous.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS_DIR)))
def test_every_configured_drafter_drafts(home, path, monkeypatch):
    monkeypatch.setenv("CASCADE_SERVICE_HOME", str(home))
    monkeypatch.setenv("CASCADE_REDIS_URL", "redis://127.0.0.1:6379/0")  # cluster.yaml reads it; never dialled here
    monkeypatch.setenv("CASCADE_TIER_KEY", "unused")  # heterogeneous.yaml's; its servers here are loopback
    cascade = load_config(path).cascade
    cascade = replace(cascade, target=_on_cpu(cascade.target), drafters=tuple(map(_on_cpu, cascade.drafters)))
    with ExitStack() as servers:
        cascade = _served_here(cascade, servers)
        _drafters_draft(home, path, cascade)


def _served_here(cascade, servers: ExitStack):
    """The cascade with each address replaced by a tier server on loopback hosting those tiers."""
    from cascade_service.cli.tier import tier_group
    from cascade_service.config import Config
    from cascade_service.tierhost.server import start_tier_server

    local = replace(cascade, target=replace(cascade.target, address=()))
    local = replace(local, drafters=tuple(_at(d, ()) for d in cascade.drafters))
    moved = {}
    for address in dict.fromkeys(t.address for t in cascade.tiers if t.address):
        names = [t.name for t in cascade.tiers if t.address == address]
        server = start_tier_server(tier_group(Config(local), names))
        servers.callback(server.stop)
        moved |= {name: (f"127.0.0.1:{server.port}",) for name in names}
    return replace(
        cascade,
        target=replace(cascade.target, address=moved.get(cascade.target.name, ())),
        drafters=tuple(_at(d, moved.get(d.name, ())) for d in cascade.drafters),
    )


def _at(tier, address: tuple[str, ...]):
    """The tier reached at `address` (suffix decoding has none: it runs where the coordinator runs)."""
    return tier if isinstance(tier, SuffixConfig) else replace(tier, address=address)


def _drafters_draft(home: Path, path: Path, cascade) -> None:
    engine = InProcess(cascade)
    prompts = [json.loads(line)["prompt"] for line in (home / "zoo" / "test" / "prompts.jsonl").open()][:3]
    tiers: dict[str, dict[str, int]] = {}
    rows = Usage()
    for prompt in prompts:
        ids = engine.tokenizer.encode(prompt)[-48:]  # the tiny family's vocabulary is smaller
        ids = [t % engine.target.vocab_size for t in ids]
        result = engine.generate(ids, replace(load_config(path).generation, max_new_tokens=48))
        absorb(rows, Usage(reviews=result.stats.reviews))
        for name, counts in result.stats.to_dict()["tiers"].items():
            mine = tiers.setdefault(name, dict.fromkeys(counts, 0))
            for key, value in counts.items():
                mine[key] += value
    for drafter in cascade.drafters:
        # MaG must draft inside the K-matrix, not only through the lookup gate (counted apart).
        assert tiers[drafter.name]["drafted"] > 0, (path.name, drafter.name, tiers)
        assert tiers[drafter.name]["calls"] > 0
    for r, drafter in enumerate([cascade.target, *cascade.drafters]):
        entries = [cascade.drafters[c].name for c, _ in cascade.schedule.row(r)] if r < len(cascade.drafters) else []
        if not entries or drafter.name not in rows.reviews:
            continue  # a leaf, or a reviewer whose system is a tier server's (its rows are counted there)
        row = rows.reviews[drafter.name].row()
        for name in entries:
            assert row["entries"][name]["share"] >= 0.99, (path.name, drafter.name, name, row)
    if cascade.lookup is not None:
        assert f"{cascade.lookup.tier}_lookup" in tiers
    gated = {f"{d.name}_lookup" for d in cascade.drafters if isinstance(d, StatisticalConfig)}
    assert {name for name in tiers if name.endswith("_lookup")} <= gated
