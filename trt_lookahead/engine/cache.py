"""The engine cache: a checkpoint run on the onnxruntime backend (the default on CPU) runs a compiled engine,
built once per checkpoint content, dtype and engine shape and kept in the cache dir (docs/design.md section 6.8).

    path, why = cached_engine(model_dir, dtype="float32", lookahead=LookaheadConfig(8, 5, 8),
                              max_seq_len=2048, max_batch=8)

<cache dir>/engines/<checkpoint name>-<first 16 hex digits of the sha256 of the build key>/ is one engine dir;
the build key (engine/build.py's BuildRequest.key) holds the format version, the sha256 of the checkpoint's
weights, the dtype and the shape. A dir is used only when it loads clean (engine/format.py's checks) and
records the same key; anything else (a crash left nothing, an older format, an edited or truncated file) is
rebuilt in a work dir and renamed into place, under a lock file so that concurrent processes build it once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from trt_lookahead.engine.build import BuildRequest, build, build_request
from trt_lookahead.engine.format import load_engine_config
from trt_lookahead.errors import UserError
from trt_lookahead.files import CACHE_ENV, cache_dir, locked, writable
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.tree import TreeTemplate

ENGINES = "engines"  # the cache dir's subfolder of cached engine dirs


def cache_request(model_dir: str | os.PathLike, *, dtype: str, lookahead: LookaheadConfig, max_seq_len: int,
                  max_batch: int, root: Path | None = None, tree: TreeTemplate | None = None,
                  weights: str = "float", activations: str | None = None) -> tuple[BuildRequest, dict]:
    """The build of the cached engine of this checkpoint and shape (its output: the engine's place under
    `root`, default the cache dir's engines/) and its build key."""
    from trt_lookahead.model.checkpoint import weights_sha256

    root = cache_dir() / ENGINES if root is None else root
    # the output is only named here: a read-only cache that holds the engine is used as it is
    request = build_request(model_dir, root, lookahead=lookahead, max_seq_len=max_seq_len,
                            max_batch=max_batch, dtype=dtype, force=True, tree=tree, check_output=False,
                            weights=weights, activations=activations)
    key = request.key(weights_sha256(request.model_dir))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return BuildRequest(**{**vars(request), "output": root / f"{request.model_dir.name}-{digest}"}), key


def cached_engine(model_dir: str | os.PathLike, *, dtype: str, lookahead: LookaheadConfig, max_seq_len: int,
                  max_batch: int, root: Path | None = None, tree: TreeTemplate | None = None,
                  weights: str = "float", activations: str | None = None) -> tuple[Path, str | None]:
    """The cached engine dir of this checkpoint and shape, built first if needed (`cache_request`).

    A usable engine is used as it is, without the lock or any write (a read-only cache works); a build
    takes the lock and checks again, so that a second process waits, then uses it.
    -> (path, why it was built: None when the cache already held it).
    """
    from trt_lookahead.model.checkpoint import check_weights, load_tokenizer

    check_weights(model_dir)  # a broken checkpoint is one error line, before any build starts
    request, key = cache_request(model_dir, dtype=dtype, lookahead=lookahead, max_seq_len=max_seq_len,
                                 max_batch=max_batch, root=root, tree=tree, weights=weights,
                                 activations=activations)
    path = request.output
    why = _unusable(path, key)
    if why is None:
        return path, None
    load_tokenizer(request.model_dir)  # a checkpoint without a readable tokenizer cannot run: say so before building
    _check_writable(path.parent, request.model_dir)
    with locked(path.with_name(f".{path.name}.lock")):
        why = _unusable(path, key)
        if why is not None:
            print(f"trt-lookahead: building the engine of {request.model_dir.name} once, cached in {path} ({why})",
                  file=sys.stderr, flush=True)
            if path.is_dir() and not path.is_symlink():  # the cache's own dir: whatever it holds is not used
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)  # a file or a link where the engine dir belongs
            build(request)
    return path, why


def _check_writable(engines: Path, model_dir: Path) -> None:
    """UserError naming the fix when the engine must be built but the cache dir cannot take it."""
    place = engines
    while not place.exists():
        place = place.parent
    if place.is_dir() and writable(place):
        return
    raise UserError(
        f"the engine cache {engines} is read-only (or not a writable directory) and does not hold the engine of "
        f"{model_dir.name} for this shape; set {CACHE_ENV} to a writable directory, or build an engine "
        f"with `trt-lookahead build --model {model_dir} --output DIR` and pass it as --engine DIR"
    )


def _unusable(path: Path, key: dict) -> str | None:
    """Why the cached dir cannot be used as this build (None: it can)."""
    if not path.exists():
        return "not built yet"
    if not path.is_dir():
        return "the cached engine's place holds a file, not an engine dir"
    try:
        config = load_engine_config(path)
    except UserError as exc:
        return f"the cached engine is unusable ({exc})"
    if config.raw.get("build_key") != key:
        return "the cached engine was built differently"
    return None
