"""Fixtures the kernel tests share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory):
    """A stories260K engine dir (2,3,2, 128 tokens, 2 slots) that the tests only read: the graph rewrites at session
    creation (onnx_rotary, onnx_swiglu, onnx_stack, the attention's merged heads) run on its graph."""
    from trt_lookahead.cli import main

    out = tmp_path_factory.mktemp("stories") / "engine"
    assert main(["build", "--model", str(STORIES), "--output", str(out), "--lookahead_config", "2,3,2",
                 "--max_seq_len", "128", "--max-batch", "2"]) == 0
    return out


class GreedyRun(NamedTuple):
    tokens: list[int]  # the prefill's token, then 12 greedy tokens
    logits: np.ndarray  # the last step's
    keys: np.ndarray  # slot 0's key cache over the committed positions
    ops: list[str]  # the op types of the graph onnxruntime ran


Patch = Callable[[pytest.MonkeyPatch], None]  # sets something for one run, e.g. a graph rewrite to a no-op


@pytest.fixture
def greedy_run(engine_dir, monkeypatch) -> Callable[[Patch | None], GreedyRun]:
    """run(patch=None) -> a prompt's greedy run on engine_dir, one token a step, the engine opened after
    patch(monkeypatch) (to compare a rewritten graph with the exported nodes), undone after the run."""
    from trt_lookahead.backends.onnxruntime import SessionSettings
    from trt_lookahead.backends.open import open_engine
    from trt_lookahead.lookahead.executor import StepBatch
    from trt_lookahead.lookahead.sampling import SamplingParams

    def run(patch: Patch | None = None) -> GreedyRun:
        if patch is not None:
            patch(monkeypatch)
        engine = open_engine(engine_dir, session=SessionSettings(threads=2))
        ops = [node.op_type for node in engine.graph().graph.node]
        ex = engine.executor()
        tokens = [int(ex.prefill(0, np.arange(1, 30), SamplingParams()))]
        for position in range(29, 41):
            ex.step(StepBatch(np.array([0]), np.array([[tokens[-1]]]), np.array([[position]]),
                              np.array([[1, 2, 0]], np.int32), np.array([[0]])))
            logits = ex.step_logits().copy()
            tokens.append(int(np.argmax(logits[0, 0])))
            ex.commit(0, np.array([0]))
        monkeypatch.undo()
        return GreedyRun(tokens, logits, np.asarray(ex.k_cache)[:, 0, :, :41].copy(), ops)

    return run
