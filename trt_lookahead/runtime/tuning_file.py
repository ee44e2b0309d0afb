"""The tuning file: what the `auto` policy was measured to need, per model, dtype, backend and machine.

    <cache dir>/tuning.json   {"version": 2, "entries": {key: entry}}   (or the file a runtime was given)
    entry: step_cost (c(M, B) points), priors (compression per config), config (the largest `auto` uses),
           and how they were measured (tuning/tune.py TuneReport); AutoPolicy.from_entry reads it
    key = model=<resolved model dir>|dtype=<dtype>|backend=<backend>|machine=<cpu model xcores tthreads>[|tree=<hash>]

The cache dir is trt_lookahead.files.cache_dir() ($TRT_LOOKAHEAD_CACHE, else $XDG_CACHE_HOME/trt-lookahead,
else ~/.cache/trt-lookahead), shared with fetched models. Writes are read-modify-write under a lock with an
atomic rename; an unreadable file or one of another version is ignored (with a note on stderr).

Below the runtime, which reads it at load (runtime/load.py `auto_policy`); `trt-lookahead tune` and `serve --tune`
(tuning/tune.py, above the runtime) write it. Imports bench.machine, files, lookahead and model only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trt_lookahead.bench.machine import machine_key
from trt_lookahead.files import cache_dir, write_text_atomic
from trt_lookahead.lookahead.tree import TreeTemplate
from trt_lookahead.model.fetch import KNOWN_MODELS, model_dir

TUNING_FILE = "tuning.json"
TUNING_VERSION = 2  # 2: the policy's step cost and priors (1 held one chosen config)


def tuning_path() -> Path:
    return cache_dir() / TUNING_FILE


def model_key(model_id: str | os.PathLike) -> str:
    """A stable name for a model: the resolved directory of a path or of a known (fetched) name."""
    text = os.fspath(model_id)
    path = Path(text).expanduser()
    if path.exists():
        return str(path.resolve())
    if text.strip().lower() in KNOWN_MODELS:
        return str(model_dir(text.strip().lower()).resolve())
    return text


def tuning_key(model_id: str | os.PathLike, dtype: str, backend: str, machine: str | None = None,
               tree: TreeTemplate | str | None = None, weights: str | None = None) -> str:
    """The entry's key; `tree` (a draft tree, or its parent list as TreeTemplate's str writes it) changes what
    every rung accepts, and quantized `weights` ("int4", "int4+int8": runtime/load.py weights_label) what a step
    costs."""
    key = f"model={model_key(model_id)}|dtype={dtype}|backend={backend}|machine={machine or machine_key()}"
    key = key if tree is None else f"{key}|tree={hashlib.sha256(str(tree).encode()).hexdigest()[:12]}"
    return key if weights is None else f"{key}|weights={weights}"


def _empty() -> dict[str, Any]:
    return {"version": TUNING_VERSION, "entries": {}}


def read_tuning_file(path: Path | None = None) -> dict[str, Any]:
    """The whole tuning file ({"version", "entries": {key: entry}}); an empty one if absent or unreadable."""
    path = path or tuning_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return _empty()
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        print(f"trt-lookahead: ignoring unreadable tuning file {path} ({exc})", file=sys.stderr)
        return _empty()
    if not isinstance(data, dict) or data.get("version") != TUNING_VERSION or not isinstance(data.get("entries"), dict):
        print(f"trt-lookahead: ignoring tuning file {path} of another format version", file=sys.stderr)
        return _empty()
    return data


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except (ImportError, OSError):  # pragma: no cover - no flock: last writer wins
            pass
        yield


def write_tuning_entry(key: str, entry: dict[str, Any], path: Path | None = None) -> Path:
    """Insert or replace one entry (read-modify-write under a lock, atomic rename)."""
    path = path or tuning_path()
    with _locked(path):
        data = read_tuning_file(path)
        data["entries"][key] = entry
        write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def lookup_tuning(model_id: str | os.PathLike, dtype: str, backend: str, machine: str | None = None,
                  path: Path | None = None, tree: TreeTemplate | str | None = None) -> dict[str, Any] | None:
    """The entry for this model, dtype, backend, machine (this one if None) and draft tree, or None."""
    return read_tuning_file(path)["entries"].get(tuning_key(model_id, dtype, backend, machine, tree))


def tuned_step_cost(model_id: str | os.PathLike, dtype: str, backend: str, threads: int | None,
                    path: Path | None = None, tree: TreeTemplate | str | None = None) -> dict[str, float] | None:
    """One request's step cost by step tokens (ms) that tuning measured on this machine at `threads`, if any."""
    entry = lookup_tuning(model_id, dtype, backend, machine_key(threads), path, tree)
    if not entry or "1" not in entry.get("step_cost", {}):
        return None
    return {str(int(m)): float(ms) for m, ms in entry["step_cost"]["1"]}
