"""Run the real `tritonserver` binary that the PyPI wheel nvidia-pytriton carries, on 127.0.0.1.

The wheel ships the server, its libraries and the Python backend, but not the python stub in the
backend directory, and the loader must find *this* interpreter's libpython first. `TritonServer`
does both (a private backend dir with the stub for this interpreter's major.minor; PATH starts with
this interpreter's bin, LD_LIBRARY_PATH with its LIBDIR and the wheel's libs), starts the binary,
waits for /v2/health/ready and stops it by PID. `trt-lookahead triton-serve` and the tests share it.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from trt_lookahead.errors import UserError, as_int
from trt_lookahead.files import free_port

HOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


def pytriton_dir() -> Path:
    """The installed `pytriton/tritonserver` directory (found without importing pytriton)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "tritonserver is not installed: pip install 'trt-lookahead[serve]' (nvidia-pytriton==0.7.0)"
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    if not (root / "bin" / "tritonserver").exists():
        raise UserError(f"{root.parent} has no tritonserver binary; reinstall nvidia-pytriton==0.7.0")
    return root


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def prepare_backend_dir(dest: Path) -> Path:
    """Make `dest/python/` with the Python backend and the stub for this interpreter; returns `dest`."""
    root = pytriton_dir()
    stub = root / "python_backend_stubs" / python_version() / "triton_python_backend_stub"
    if not stub.exists():
        raise UserError(f"nvidia-pytriton has no python backend stub for Python {python_version()} (looked for {stub})")
    python = Path(dest) / "python"
    python.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        link = python / name
        if not link.exists():
            link.symlink_to(root / "backends" / "python" / name)
    target = python / "triton_python_backend_stub"
    if not target.exists():
        shutil.copy2(stub, target)
    return Path(dest)


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the server and its stubs need: this interpreter's bin first on PATH, its
    libpython first on LD_LIBRARY_PATH (else the loader may pick the system's libpython of another
    patch release, which breaks the stdlib), then the wheel's vendored libraries."""
    env = dict(os.environ if base is None else base)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in (bin_dir, env.get("PATH", "")) if p)
    libs = pytriton_dir().parent.parent / "nvidia_pytriton.libs"
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, str(libs), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def check_ports(ports: dict[str, int | None]) -> None:
    """UserError unless every given port (name -> port; 0 or None: pick a free one) is in 1..65535, distinct,
    and free on HOST now (else tritonserver would wait forever, or our readiness probe reach another server)."""
    given = {name: as_int(name, port) for name, port in ports.items() if port not in (None, 0)}
    for name, port in given.items():
        if not 1 <= port <= 65535:
            raise UserError(f"{name} {port} is not a TCP port; give one in 1..65535 (or 0 for any free port)")
        if list(given.values()).count(port) > 1:
            raise UserError(f"{name} {port} is given twice; the HTTP, gRPC and metrics ports must differ")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no conflict
            try:
                s.bind((HOST, port))
            except OSError as exc:
                raise UserError(f"{name} {port} is not free on {HOST} ({exc.strerror}); choose another port") from None


def _die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to the server when the process that started it dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class TritonServer:
    """One tritonserver process on loopback. Ports of 0 or None are picked free.

    `log` is a file path for the server's output (None: inherit this process's stdout/stderr).
    `die_with_parent` sets PR_SET_PDEATHSIG so a killed parent never leaves a server behind.
    """

    def __init__(
        self,
        repo: str | os.PathLike,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        log: str | os.PathLike | None = None,
        backend_dir: str | os.PathLike | None = None,
        die_with_parent: bool = True,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.repo = Path(repo).resolve()
        if not self.repo.is_dir():
            raise UserError(f"model repository {self.repo} does not exist; write one with `trt-lookahead triton-repo`")
        check_ports({"--http-port": http_port, "--grpc-port": grpc_port, "--metrics-port": metrics_port})
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log_path = Path(log) if log is not None else None
        self._own_backend_dir = backend_dir is None
        self.backend_dir = Path(backend_dir or tempfile.mkdtemp(prefix="trt-lookahead-backends-"))
        self.die_with_parent = die_with_parent
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"{HOST}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    def command(self) -> list[str]:
        return [
            str(pytriton_dir() / "bin" / "tritonserver"),
            f"--model-repository={self.repo}",
            f"--backend-directory={self.backend_dir}",
            f"--http-address={HOST}", f"--http-port={self.http_port}",
            f"--grpc-address={HOST}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={HOST}", f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            "--exit-timeout-secs=30",  # unloading a torch model takes 3+ s on a busy machine
            *self.extra_args,
        ]

    def start(self) -> TritonServer:
        prepare_backend_dir(self.backend_dir)
        out = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
            out = self._log_file
        self.proc = subprocess.Popen(
            self.command(),
            env=server_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            # own session: a terminal's Ctrl-C reaches only us, and we stop the server once, cleanly
            start_new_session=True,
            preexec_fn=_die_with_parent if self.die_with_parent else None,
        )
        return self

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 120.0) -> TritonServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"tritonserver exited with code {code} before it was ready{self._tail_note()}")
            if self.is_ready():
                return self
            time.sleep(0.1)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s{self._tail_note()}")

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        if self._log_file is not None:
            with contextlib.suppress(ValueError):
                self._log_file.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def _tail_note(self) -> str:
        tail = self.log_tail()
        return f"; server log ({self.log_path}) ends:\n{tail}" if tail else ""

    def stop(self, timeout: float = 45.0) -> int | None:
        """SIGINT to the server's PID (graceful: unloads models, ends stubs), SIGKILL after `timeout`."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            code = self.proc.returncode
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._own_backend_dir:
            shutil.rmtree(self.backend_dir, ignore_errors=True)
        return code

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(repo: str | os.PathLike, http_port: int, grpc_port: int, metrics_port: int) -> int:
    """`trt-lookahead triton-serve`: serve `repo` on loopback until SIGINT or SIGTERM; returns the exit code."""
    repo = Path(repo)
    if not repo.is_dir() or not any(repo.glob("*/config.pbtxt")):
        raise UserError(
            f"{repo} is not a Triton model repository (no */config.pbtxt); write one with `trt-lookahead triton-repo`"
        )
    server = TritonServer(repo, http_port, grpc_port, metrics_port)
    stopping: list[int] = []

    def on_signal(signum, _frame):
        stopping.append(signum)
        if server.proc is not None and server.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                server.proc.send_signal(signal.SIGINT)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        try:
            server.wait_ready(timeout=600)
        except (RuntimeError, TimeoutError) as exc:
            if stopping:
                return 130
            raise UserError(f"{exc}; the server's log is above") from None
        print(
            f"tritonserver ready: http://{server.http_url} (POST /v2/models/<name>/generate_stream), "
            f"grpc {server.grpc_url}, metrics http://{HOST}:{server.metrics_port}/metrics; Ctrl-C stops it",
            file=sys.stderr, flush=True,
        )
        assert server.proc is not None  # started above
        code = server.proc.wait()  # a signal runs on_signal, which stops the server; wait() then returns
        return 0 if stopping else code
    finally:
        server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
