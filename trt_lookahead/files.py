"""Leaf helpers that several layers share: file checksums, atomic writes and the cache directory."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def cache_dir() -> Path:
    """$TRT_LOOKAHEAD_CACHE, else $XDG_CACHE_HOME/trt-lookahead, else ~/.cache/trt-lookahead."""
    env = os.environ.get("TRT_LOOKAHEAD_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "trt-lookahead"
    return Path.home() / ".cache" / "trt-lookahead"


def write_text_atomic(path: Path, text: str) -> None:
    """Write beside `path` and rename over it, so a reader sees the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def replace_dir(new: Path, target: Path) -> None:
    """Rename the finished directory `new` to `target`; an old `target` is moved aside first and removed after."""
    old = None
    if target.exists() or target.is_symlink():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(new, target)
    if old is not None:
        if old.is_symlink():
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)
