"""The servers `bench --peers llama-server` starts, one at a time, on 127.0.0.1: our `trt-lookahead serve` and
llama.cpp's `llama-server` on a GGUF of the same checkpoint in the same dtype.

    binary = find_llama_server(None)                 # --llama-server, else PATH, else scripts/build_llama_cpp.sh's
    gguf = cached_gguf(Path("models/smollm2"), "float32")      # <cache>/gguf/<name>-float32-<content>.gguf
    argv = llama_server_argv(binary, gguf, port=free_port(), threads=2, slots=8, context=8 * 512)
    with ServerProcess("llama-server", argv, port, log_dir) as server:
        stream_completion(server.url, {...})

Each server's output goes to a log file; a server that exits before it is healthy, or is not healthy (GET
/health answering 200) within the start-up limit, is a UserError naming it, the fix, and its log's last lines.
A server is always stopped when its `with` block ends, also on an error or Ctrl-C (SIGTERM, then SIGKILL), and
runs in its own session so the terminal's Ctrl-C reaches only the bench, which stops it.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from trt_lookahead.errors import UserError
from trt_lookahead.files import cache_dir, locked, sha256_file

LLAMA_SERVER = "llama-server"
DEFAULT_SPECS = "ngram-map-k"  # --llama-spec: the --spec-type rows besides the plain one
LLAMA_CPP_VERSION = "11434.0.0"  # the default of scripts/build_llama_cpp.sh, whose build is looked for last
BUILD_HINT = "build it with `bash scripts/build_llama_cpp.sh`, or give --llama-server PATH"
START_TIMEOUT = 600.0  # seconds a server may take to become healthy (ours may build its engine first)
STOP_TIMEOUT = 30.0  # seconds between SIGTERM and SIGKILL
LOG_TAIL_LINES = 15
GGUF_FORMAT = 1  # bump when write_gguf's output changes, so cached files are rewritten


def find_llama_server(path: str | None) -> Path:
    """`path` (--llama-server), else `llama-server` on PATH, else <cache>/llama.cpp/<version>/bin/llama-server;
    UserError naming what was looked for and how to build one."""
    if path is not None:
        found = Path(path).expanduser()
        if not found.is_file():
            raise UserError(f"--llama-server {path} does not exist; {BUILD_HINT}")
        if not os.access(found, os.X_OK):
            raise UserError(f"--llama-server {path} is not executable; chmod +x it or {BUILD_HINT}")
        return found
    on_path = shutil.which(LLAMA_SERVER)
    if on_path:
        return Path(on_path)
    built = cache_dir() / "llama.cpp" / LLAMA_CPP_VERSION / "bin" / LLAMA_SERVER
    if built.is_file() and os.access(built, os.X_OK):
        return built
    raise UserError(f"no llama-server found (not on PATH, not at {built}); {BUILD_HINT}")


def parse_specs(text: str) -> list[str]:
    """`--llama-spec ngram-map-k,ngram-simple` -> the --spec-type values, one llama-server row each besides the
    plain one ("" or none: the plain row only). llama-server itself checks the names at start-up."""
    specs = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    return [s for s in specs if s != "none"]


def llama_server_argv(binary: Path, gguf: Path, port: int, threads: int, slots: int, context: int,
                      spec: str | None = None) -> list[str]:
    """llama-server on loopback with `slots` parallel sequences sharing `context` KV cells, `threads` for
    generation and prompt batches alike; `spec`: an n-gram --spec-type."""
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(slots), "-c", str(context), "--no-webui"]
    return argv + (["--spec-type", spec] if spec else [])


def serve_argv(model: Path, port: int, threads: int, max_batch: int, dtype: str, max_seq_len: int | None,
               extra: Sequence[str] = ()) -> list[str]:
    """Our `trt-lookahead serve` serving `auto` (greedy requests send `"lookahead": false`)."""
    argv = [sys.executable, "-m", "trt_lookahead.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--threads", str(threads), "--max-batch", str(max_batch), "--max-queue",
            str(max_batch), "--dtype", dtype, "--lookahead_config", "auto", "--shutdown-grace", "1", *extra]
    return argv + ([] if max_seq_len is None else ["--max-seq-len", str(max_seq_len)])


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty log)"


class ServerProcess:
    """One server process: started and waited for in `__enter__`, stopped in `__exit__` (always)."""

    def __init__(self, name: str, argv: Sequence[str], port: int, log_dir: Path, hint: str = "",
                 start_timeout: float = START_TIMEOUT, env: dict[str, str] | None = None) -> None:
        """`env`: the server's environment (default: this process's)."""
        self.name, self.argv, self.port, self.hint, self.env = name, list(argv), port, hint, env
        self.log = log_dir / f"{name.replace(' ', '-')}.log"
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerProcess:
        try:
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True, env=self.env)
        except OSError as exc:
            raise UserError(f"{self.name} cannot be started ({exc}); {self.hint or 'check the command'}") from None
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout
        while not _healthy(self.port):
            code = self.proc.poll()
            if code is not None:
                raise UserError(f"{self.name} exited at start-up (status {code}); {self.hint or 'see its log'}. "
                                f"Last lines of {self.log}:\n{log_tail(self.log)}")
            if time.monotonic() > deadline:
                raise UserError(f"{self.name} was not healthy (GET /health) within {self.start_timeout:.0f} s; "
                                f"{self.hint or 'see its log'}. Last lines of {self.log}:\n{log_tail(self.log)}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT; the whole session, so a server's own children go too."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT), (signal.SIGKILL, STOP_TIMEOUT)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def checkpoint_digest(model: Path) -> str:
    """A digest of what a GGUF of the checkpoint depends on: its weights, config and tokenizer files."""
    from trt_lookahead.model.checkpoint import weights_sha256

    names = ("config.json", "tokenizer.json", "tokenizer_config.json")
    parts = [weights_sha256(model), *(f"{n}:{sha256_file(model / n)}" for n in names if (model / n).is_file())]
    return hashlib.sha256(f"{GGUF_FORMAT}\n{chr(10).join(parts)}".encode()).hexdigest()


def cached_gguf(model: Path, dtype: str, cache: Path | None = None) -> Path:
    """The checkpoint as a GGUF in `dtype` (model.gguf_convert.write_gguf), written once into <cache>/gguf/ under
    a name keyed by the checkpoint's content, atomically (written aside, renamed; a lock keeps two benches from
    writing it at once)."""
    from trt_lookahead.model.gguf_convert import write_gguf

    folder = (cache or cache_dir()) / "gguf"
    target = folder / f"{model.name}-{dtype}-{checkpoint_digest(model)[:16]}.gguf"
    if target.is_file():
        return target
    with locked(folder / f".{target.name}.lock"):
        if target.is_file():
            return target
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            write_gguf(model, tmp, dtype)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return target
