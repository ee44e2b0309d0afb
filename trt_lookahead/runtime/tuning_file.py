"""The tuning file: what the `auto` policy was measured to need, per model, dtype, backend and machine.

    <cache dir>/tuning.json   {"version": 2, "entries": {key: entry}}   (or the file a runtime was given)
    entry: step_cost (c(M, B) points), priors (compression per config), config (the largest `auto` uses),
           and how they were measured (tuning/tune.py TuneReport); AutoPolicy.from_entry reads it
    key = model=<resolved model dir>|dtype=<dtype>|backend=<backend>|machine=<cpu model xcores tthreads>[|tree=<hash>]

The cache dir is trt_lookahead.files.cache_dir() ($TRT_LOOKAHEAD_CACHE, else $XDG_CACHE_HOME/trt-lookahead,
else ~/.cache/trt-lookahead), shared with fetched models. Writes are read-modify-write under a lock with an
atomic rename; an unreadable file or one of another version is ignored when read (with a note on stderr), but
only a tuning file (any version) or an empty one is ever written over: a file `tune` cannot tell for one of its
own (another JSON, a model's weights given by mistake) is refused, before any measuring (`check_tuning_file`).

Below the runtime, which reads it at load (runtime/load.py `auto_policy`); `trt-lookahead tune` and `serve --tune`
(tuning/tune.py, above the runtime) write it. Imports bench.machine, files, lookahead and model only.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from trt_lookahead.bench.machine import machine_key
from trt_lookahead.errors import UserError
from trt_lookahead.files import cache_dir, check_output_file, locked, write_text_atomic
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


def _load(path: Path) -> Any:
    """The JSON value `path` holds: FileNotFoundError if absent, another OSError if unreadable, ValueError if not
    JSON (not UTF-8 included)."""
    try:
        return json.loads(path.read_bytes())
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _is_tuning_file(data: Any) -> bool:
    """Whether a JSON value has a tuning file's shape, of any format version."""
    return isinstance(data, dict) and "version" in data and isinstance(data.get("entries"), dict)


def read_tuning_file(path: Path | None = None) -> dict[str, Any]:
    """The whole tuning file ({"version", "entries": {key: entry}}); an empty one if absent or unreadable."""
    path = path or tuning_path()
    try:
        data = _load(path)
    except FileNotFoundError:
        return _empty()
    except (OSError, ValueError) as exc:
        print(f"trt-lookahead: ignoring unreadable tuning file {path} ({exc})", file=sys.stderr)
        return _empty()
    if not _is_tuning_file(data):
        print(f"trt-lookahead: ignoring {path}: JSON, but not a tuning file", file=sys.stderr)
        return _empty()
    if data["version"] != TUNING_VERSION:
        print(f"trt-lookahead: ignoring tuning file {path} of another format version", file=sys.stderr)
        return _empty()
    return data


def check_tuning_file(path: str | os.PathLike | None, flag: str = "--tuning-file") -> Path:
    """The file a tuning entry is written to (`path`, None: the cache's) if writing it there destroys nothing:
    absent, empty or a tuning file of any version, in a place that can be written; else UserError naming `flag`.
    `tune` calls it before measuring, and write_tuning_entry again under the lock."""
    path = check_output_file(path or tuning_path(), flag)
    try:
        empty = path.stat().st_size == 0
        if empty or _is_tuning_file(_load(path)):
            return path
        what = "JSON, but not a tuning file"
    except FileNotFoundError:
        return path
    except (OSError, ValueError):
        what = "not JSON"
    raise UserError(f"{flag} {path} holds something else ({what}), which a tuning entry would overwrite; give a "
                    f"new path, or remove the file if it is yours to lose")


def write_tuning_entry(key: str, entry: dict[str, Any], path: Path | None = None) -> Path:
    """Insert or replace one entry (read-modify-write under a lock, atomic rename); UserError, writing nothing,
    where `path` holds something other than a tuning file."""
    path = path or tuning_path()
    with locked(path.with_name(f".{path.name}.lock")):
        check_tuning_file(path, "tuning file")
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
