"""kernels/onnxruntime_library.py: the C kernels are built once per machine into the cache dir and reused;
without a working compiler there is no library, one line says why, and engines run the standard-op attention."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from trt_lookahead.backends.onnxruntime import SessionSettings
from trt_lookahead.backends.open import open_engine
from trt_lookahead.cli import main
from trt_lookahead.kernels import onnxruntime_library
from trt_lookahead.kernels.onnxruntime_library import KERNELS, native_library
from trt_lookahead.lookahead.executor import StepBatch
from trt_lookahead.lookahead.sampling import SamplingParams

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache dir and no library built yet in this process (and none left cached for the next test)."""
    monkeypatch.setenv("TRT_LOOKAHEAD_CACHE", str(tmp_path / "cache"))
    native_library.cache_clear()
    yield tmp_path / "cache" / KERNELS
    native_library.cache_clear()


def test_the_library_is_built_once_and_reused(fresh):
    built = native_library()
    assert built.path is not None and built.path.parent == fresh, built.why
    stamp = built.path.stat().st_mtime_ns
    native_library.cache_clear()  # another process: finds the file
    assert native_library().path == built.path and built.path.stat().st_mtime_ns == stamp
    assert os.listdir(fresh) == [built.path.name]  # no temporary file left


def test_no_compiler_no_library_and_one_line_says_why(fresh, monkeypatch, capsys):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    built = native_library()
    assert built.path is None and "no C compiler" in built.why and "/nonexistent/cc" in built.why
    native_library()
    err = capsys.readouterr().err
    assert err.count("trt-lookahead: float32 attention runs as standard onnxruntime ops and quantized products as "
                     "MatMulNBits") == 1, err


def test_a_failing_build_leaves_nothing_behind(fresh, monkeypatch, tmp_path):
    compiler = tmp_path / "cc"
    compiler.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "cc 1.0"; exit 0; fi\necho "no such flag" >&2\n'
                        "exit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    built = native_library()
    assert built.path is None and "failed" in built.why and "no such flag" in built.why
    assert os.listdir(fresh) == []


def test_the_key_follows_the_source(fresh, monkeypatch, tmp_path):
    """An edited kernel is a new library, not the old file."""
    first = native_library().path
    edited = tmp_path / "onnxruntime_attention.c"
    edited.write_text(onnxruntime_library.SOURCE.read_text() + "\n/* edited */\n")
    monkeypatch.setattr(onnxruntime_library, "SOURCES", tuple(edited if path == onnxruntime_library.SOURCE else path
                                                            for path in onnxruntime_library.SOURCES))
    native_library.cache_clear()
    second = native_library().path
    assert first is not None and second is not None and second != first and first.is_file()


def test_the_key_follows_the_compilers_arguments(fresh, monkeypatch):
    """CC with arguments (as `CC="cc -mno-avx512f"` builds the AVX2 code paths) is a library of its own, not the
    plain compiler's file."""
    plain = native_library().path
    monkeypatch.setenv("CC", "cc -DTRT_LOOKAHEAD_TEST_ARGUMENT")
    native_library.cache_clear()
    other = native_library().path
    assert plain is not None and other is not None and other != plain and sorted(os.listdir(fresh)) == sorted(
        [plain.name, other.name])


def test_an_engine_without_the_kernel_runs_standard_ops(fresh, monkeypatch, tmp_path):
    """No compiler: the engine's graph has no native node and its logits are the native engine's to rounding."""
    out = tmp_path / "engine"
    assert main(["build", "--model", str(STORIES), "--output", str(out), "--lookahead_config", "2,2,1",
                 "--max_seq_len", "128", "--max-batch", "1", "--tree", "off"]) == 0
    logits = {}
    for name, cc in (("native", None), ("ops", "/nonexistent/cc")):
        if cc:
            monkeypatch.setenv("CC", cc)
        native_library.cache_clear()
        engine = open_engine(out, session=SessionSettings(threads=1))
        assert (engine.native_library is not None) == (name == "native")
        ops = {node.domain for node in engine.graph().graph.node}
        assert ("trt_lookahead.cpu" in ops) == (name == "native")
        ex = engine.executor()
        token = ex.prefill(0, np.arange(1, 40), SamplingParams())
        ex.step(StepBatch(np.array([0]), np.array([[token]]), np.array([[39]]), np.array([[1, 2, 0]], np.int32),
                          np.array([[0]])))
        logits[name] = ex.step_logits()[0, 0]
    np.testing.assert_allclose(logits["native"], logits["ops"], rtol=1e-4, atol=1e-4)
