"""Leaf helpers that several layers share: file checksums (remembered in the cache dir), atomic writes, UTF-8
reads, output checks, lock files, the cache directory and a free loopback port. Imports only trt_lookahead.errors."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from trt_lookahead.errors import UserError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS's pick), for a server started on loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


CACHE_ENV = "TRT_LOOKAHEAD_CACHE"  # the environment variable naming the cache dir
DIGESTS_FILE = "sha256.json"  # in the cache dir: {resolved path: [size, mtime_ns, ctime_ns, sha256]}


def file_digests(paths: Sequence[Path], hashing: Callable[[Path], None] | None = None,
                 cache: Path | None = None) -> list[str]:
    """Each file's sha256, read again only when its size, mtime or ctime differ from those remembered with its
    digest in DIGESTS_FILE of `cache` (default: the cache dir): a write changes a file's ctime, which no call can
    set back, so a start-up does not reread a model's gigabytes to recognise them. `hashing(path)` is told before
    a file is read. An unreadable or unwritable index only costs the hashing."""
    index = (cache_dir() if cache is None else cache) / DIGESTS_FILE
    try:
        seen = json.loads(index.read_text(encoding="utf-8"))
        seen = seen if isinstance(seen, dict) else {}
    except (OSError, ValueError):
        seen = {}
    digests, changed = [], False
    for path in paths:
        stat = path.stat()
        key, mark = str(path.resolve()), [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
        entry = seen.get(key)
        if isinstance(entry, list) and entry[:3] == mark and len(entry) == 4 and isinstance(entry[3], str):
            digests.append(entry[3])
            continue
        if hashing is not None:
            hashing(path)
        digests.append(sha256_file(path))
        seen[key], changed = [*mark, digests[-1]], True
    if changed:
        try:
            index.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(index, json.dumps({k: v for k, v in seen.items() if Path(k).exists()}))
        except OSError:
            pass  # nothing remembered: the next start hashes again
    return digests


def cache_dir() -> Path:
    """$TRT_LOOKAHEAD_CACHE, else $XDG_CACHE_HOME/trt-lookahead, else ~/.cache/trt-lookahead."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "trt-lookahead"
    return Path.home() / ".cache" / "trt-lookahead"


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write beside `path` and rename over it, so a reader sees the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left when the write or the rename failed (disk full, signal)


def write_text_atomic(path: Path, text: str) -> None:
    """write_bytes_atomic of `text` as UTF-8."""
    write_bytes_atomic(path, text.encode("utf-8"))


def read_utf8(path: Path, name: str, fix: str = "") -> str:
    """The text of the file `path`; UserError naming it as `name`, then `fix`, where it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{name} {path} is not UTF-8 text ({exc.reason} at byte {exc.start}){fix}") from None


def check_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """`path` if it is a directory or can be made one; else UserError naming `flag` (checked before any work)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a directory; choose another {flag}")
    _check_creatable(path, path.absolute(), flag)
    return path


def check_output_file(path: str | os.PathLike, flag: str) -> Path:
    """`path` if a file can be written there (it and its lock are written beside it and renamed into place);
    else UserError naming `flag`, so that a command finds out before its work, not after."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory, not a file; choose another {flag}")
    _check_creatable(path, path.absolute().parent, flag)
    return path


def _check_creatable(path: Path, place: Path, flag: str) -> None:
    """UserError unless the directory `place` (where `path` is written) exists or can be made, writable."""
    ancestor = place
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{flag} {path} cannot be created: {ancestor} is a file; choose another {flag}")
    if not writable(ancestor):
        raise UserError(f"{flag} {path} cannot be created: {ancestor} is not writable; choose another {flag}")


def writable(directory: Path) -> bool:
    """Whether files can be made in `directory` (a read-only mount says no even to root)."""
    return os.access(directory, os.W_OK | os.X_OK)


def work_dir(target: Path) -> Path:
    """Where a directory for `target` is written before `replace_dir` renames it into place."""
    return target.with_name(f".{target.name}.building-{os.getpid()}")


def remove_stale_work_dirs(target: Path) -> None:
    """Remove what killed writers of `target` left beside it: `work_dir`s and moved-aside olds of dead PIDs."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(building|old)-(\d+)")
    for entry in target.parent.iterdir() if target.parent.is_dir() else ():
        match = pattern.fullmatch(entry.name)
        if match and not _alive(int(match.group(2))):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


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


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on the file `path` (flock), so that two processes never make the same thing at
    once: the second waits, then finds it made."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        f = open(path, "a")  # noqa: SIM115 (closed below; the error is ours to word)
    except IsADirectoryError:
        raise UserError(f"the lock file {path} is a directory; remove it (rmdir {path}) and run again") from None
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
