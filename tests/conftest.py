"""Session setup that must happen before any test module imports triton."""

import contextlib
import multiprocessing
import os
import time
from collections.abc import Iterator

import pytest

from trt_lookahead.backends.devices import gpu_count

# Triton decides at decoration time whether a @triton.jit function is interpreted; without a GPU the
# kernel tests run under the interpreter on CPU tensors.
if gpu_count() == 0:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def interpreted_float32_dot():
    """Skip a float32 bit-exactness test of the interpreted Triton kernels where this machine's numpy cannot pass
    it. The interpreter's tl.dot is numpy's matmul, and OpenBLAS's AVX2 sgemm kernel rounds a row by where it
    stands in the tile (rows 0-5 and 6-11 of a 32-row tile differ on an AMD EPYC with AVX2), so a row alone (at
    row 0) and the same row in a batch get other bits there whatever the kernel does. Compiled on a GPU (and
    interpreted where numpy keeps a row's bits) the tests run; call the fixture with the test's dtype."""
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    b, row = rng.standard_normal((64, 64), dtype=np.float32), rng.standard_normal(64, dtype=np.float32)
    at = []
    for p in range(32):
        a = np.zeros((32, 64), np.float32)
        a[p] = row
        at.append((a @ b)[p])
    keeps_rows = gpu_count() > 0 or all(np.array_equal(at[0], r) for r in at)

    def check(dtype: "torch.dtype") -> None:
        if dtype == torch.float32 and not keeps_rows:
            pytest.skip("numpy's float32 matmul (the interpreter's tl.dot) rounds a row by its place in the tile "
                        "on this CPU; the test runs on a GPU or where numpy keeps a row's bits")

    return check


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module (tiny models run fastest so); the old count is restored."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class CliWorker:
    """`trt-lookahead` argument vectors run one after another in a long-lived subprocess (torch imported once).

    Each case gets its own stdout/stderr capture at the file-descriptor level (what a terminal would show,
    C libraries' output included) and a time limit: a case that hangs fails the test, and the worker is
    replaced. A traceback is reported as it is, never hidden.
    """

    CODE = r"""
import contextlib, io, json, os, sys, tempfile, traceback
from trt_lookahead.cli import main
reply = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    argv = json.loads(line)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = -1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
        out.seek(0)
        err.seek(0)
        reply.write(json.dumps({"code": code, "out": out.read().decode(errors="replace"),
                                "err": err.read().decode(errors="replace")}) + "\n")
        reply.flush()
"""

    def __init__(self, cwd, env: dict[str, str]) -> None:
        self.cwd, self.env, self.proc = cwd, env, None
        self.cases = 0

    def _start(self):
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE], cwd=self.cwd, env=self.env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def run(self, argv: list[str], timeout: float = 120) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) of `trt-lookahead *argv`; pytest.fail if it runs past `timeout`."""
        import json
        import select

        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.cases += 1
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            pytest.fail(f"trt-lookahead {argv} hung or died (no answer within {timeout} s)")
        result = json.loads(line)
        return result["code"], result["out"], result["err"]

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="module")
def cli_worker(tmp_path_factory):
    """A CliWorker in a scratch directory, with its own cache dir (so nothing touches the user's)."""
    root = tmp_path_factory.mktemp("cli-worker")
    worker = CliWorker(root, {**os.environ, "TRT_LOOKAHEAD_CACHE": str(root / "cache")})
    yield worker
    worker.close()


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@contextlib.contextmanager
def busy_cpus(seconds: float) -> Iterator[None]:
    """Other processes keep every CPU this one may use busy for up to `seconds` (stopped on leaving)."""
    busy = [multiprocessing.get_context("fork").Process(target=_spin, args=(seconds,))
            for _ in range(len(os.sched_getaffinity(0)))]
    for process in busy:
        process.start()
    try:
        yield
    finally:
        for process in busy:
            process.terminate()
            process.join()


@pytest.fixture(name="busy_cpus")
def busy_cpus_fixture():
    """`busy_cpus` for a test: `with busy_cpus(seconds): ...`."""
    return busy_cpus
