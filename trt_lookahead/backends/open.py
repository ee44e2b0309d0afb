"""open_engine: an engine dir opened for the onnxruntime or the TensorRT backend.

    engine = open_engine("engines/NAME", max_batch=4)     # config.json checked against the request
    ex = engine.executor()                                # the batched contract, 4 KV slots
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

from trt_lookahead.backends.graphs import SlotExecutor
from trt_lookahead.engine.format import EngineConfig, load_engine_config
from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import LookaheadConfig

if TYPE_CHECKING:
    from trt_lookahead.backends.onnxruntime import SessionSettings

BACKENDS = ("onnxruntime", "tensorrt")


class Engine(Protocol):
    """An opened engine dir: its config and its batched executors."""

    config: EngineConfig
    lookahead: LookaheadConfig  # the (W, N, G) it was built for
    step_tokens: int  # the most tokens a step row may have
    max_batch: int  # the most rows a step may have
    max_seq_len: int
    dtype: str

    def executor(self, max_batch: int | None = None) -> SlotExecutor: ...


def open_engine(path: str | os.PathLike, backend: str = "onnxruntime", dtype: str | None = None,
                max_seq_len: int | None = None, threads: int | None = None, lookahead: LookaheadConfig | None = None,
                model: str | os.PathLike | None = None, max_batch: int | None = None, verify: bool = True,
                session: SessionSettings | None = None, exact: bool | None = None) -> Engine:
    """Open an engine dir for `backend`, refusing (UserError naming what differs) a mismatching request.

    `model`: a checkpoint dir the engine must have been built from (checked by its weights' sha256).
    `verify`: check every file against the checksums config.json recorded (engine/format.py).
    `session`: onnxruntime's settings (default: SessionSettings() with `threads`).
    `exact`: True requires row-invariant steps (an engine built with --exact, on onnxruntime), False the fast
    ones (an engine built without it); None takes the engine's.
    """
    from trt_lookahead.model.checkpoint import weights_sha256

    if backend not in BACKENDS:
        raise UserError(f"an engine dir runs on the onnxruntime or tensorrt backend, not {backend!r}")
    if exact and backend == "tensorrt":
        raise UserError("the TensorRT backend has no exact step: run an engine built with `trt-lookahead build "
                        "--exact` on --backend onnxruntime, or drop --exact")
    config = load_engine_config(path, verify=verify)
    model_sha = None if model is None else weights_sha256(model)
    config.check_request(lookahead=lookahead, dtype=dtype, max_seq_len=max_seq_len, max_batch=max_batch,
                         model_sha256=model_sha, exact=exact)
    if backend == "tensorrt":
        if config.quantization != "float":
            raise UserError(f"engine {config.path} holds {config.quantization} weights (onnxruntime's MatMulNBits), "
                            "which the TensorRT backend cannot run: use --backend onnxruntime")
        from trt_lookahead.backends.tensorrt import TensorRTEngine

        return TensorRTEngine(config, max_seq_len=max_seq_len, max_batch=max_batch)
    from trt_lookahead.backends.onnxruntime import OnnxRuntimeEngine, SessionSettings

    settings = session or SessionSettings(threads=threads)
    return OnnxRuntimeEngine(config, max_seq_len=max_seq_len, max_batch=max_batch, settings=settings)
