"""Fixtures the kernel tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory):
    """A stories260K engine dir (2,3,2, 128 tokens, 2 slots) that the tests only read: the graph rewrites for the
    C kernels (onnx_rotary, onnx_swiglu) run on its graph."""
    from trt_lookahead.cli import main

    out = tmp_path_factory.mktemp("stories") / "engine"
    assert main(["build", "--model", str(STORIES), "--output", str(out), "--lookahead_config", "2,3,2",
                 "--max_seq_len", "128", "--max-batch", "2"]) == 0
    return out
