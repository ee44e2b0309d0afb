"""OnnxRuntimeExecutor: the executor contract (executors/base.py) on an engine dir's ONNX graphs, on CPU.

    engine = open_engine("engines/NAME")                  # config.json checked against the request
    ex = engine.make_executor(StepLayout(cfg, padded_tokens=engine.tokens_per_step))
    ex.reset(SamplingParams()); x = ex.prefill(prompt); ids = ex.step(input_ids, positions); ex.commit(slots)

Buffers are allocated once per executor: the KV cache ([Hkv, max_seq_len + T, D] per layer), the
step inputs and outputs. They are bound to the step session by address (IOBinding), so a step copies
only the T input ids and positions in and the chosen ids out; the graph reads the cache in place.
`commit` copies the accepted slots' K/V (a graph output) to cache rows p, p+1, ...

Which graph runs: a layout of the engine's T runs step.onnx with step_config = the layout's
(W, N, G) (a smaller config padded to T runs on the same graph: the mask is computed from
step_config in the graph); a one-token layout (greedy) runs prefill.onnx at T = 1, causal. Prefill
runs prefill.onnx in chunks of at most max_input_len tokens.

LookaheadAttention nodes (--attention plugin) run as their standard-op decomposition
(plugins/onnx_op.decompose): onnxruntime has no kernel for them. Token choice: argmax in the graph;
seeded sampling on the host from the graph's float32 logits with `sampling.select_tokens`, keyed by
absolute positions like the torch executor.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from trt_lookahead.builder import EngineConfig, cache_names, load_engine_config, weights_sha256
from trt_lookahead.config import LookaheadConfig
from trt_lookahead.errors import UserError
from trt_lookahead.executors.base import check_commit, check_prompt
from trt_lookahead.layout import StepLayout
from trt_lookahead.sampling import SamplingParams, select_tokens

__all__ = ["OnnxRuntimeEngine", "OnnxRuntimeExecutor", "OnnxRuntimeUnsupported", "load_engine_config", "open_engine"]

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
CAUSAL = (0, 0, 0)


class OnnxRuntimeUnsupported(UserError):
    """The engine is valid but onnxruntime's CPU kernels cannot run it (e.g. bfloat16)."""


def open_engine(path: str | os.PathLike, backend: str = "onnxruntime", dtype: str | None = None,
                max_seq_len: int | None = None, threads: int | None = None, lookahead: LookaheadConfig | None = None,
                model: str | os.PathLike | None = None):
    """Open an engine dir for `backend`, refusing (UserError naming what differs) a mismatching request.

    `model`: a checkpoint dir the engine must have been built from (checked by its weights' sha256).
    """
    config = load_engine_config(path)
    model_sha = None if model is None else weights_sha256(model)
    config.check_request(lookahead=lookahead, dtype=dtype, max_seq_len=max_seq_len, model_sha256=model_sha)
    if backend == "tensorrt":
        from trt_lookahead.executors.tensorrt import TensorRTEngine

        return TensorRTEngine(config, max_seq_len=max_seq_len)
    if backend != "onnxruntime":
        raise UserError(f"an engine dir runs on the onnxruntime or tensorrt backend, not {backend!r}")
    return OnnxRuntimeEngine(config, max_seq_len=max_seq_len, threads=threads)


class OnnxRuntimeEngine:
    """An engine dir's graphs as onnxruntime sessions (created on first use, shared by its executors)."""

    def __init__(self, config: EngineConfig, max_seq_len: int | None = None, threads: int | None = None) -> None:
        if config.dtype not in _NUMPY_DTYPES:
            raise OnnxRuntimeUnsupported(
                f"engine {config.path} holds {config.dtype} weights, which onnxruntime's CPU kernels cannot run "
                "(no bfloat16 MatMul); build a float32 engine for the onnxruntime backend, or use --backend tensorrt"
            )
        self.config = config
        self.lookahead: LookaheadConfig = config.lookahead
        self.tokens_per_step = config.tokens_per_step
        self.max_seq_len = config.max_seq_len if max_seq_len is None else int(max_seq_len)
        self.dtype = config.dtype
        self.threads = threads
        self._sessions: dict[str, object] = {}
        self._lock = threading.Lock()

    def session(self, which: str):
        """The onnxruntime InferenceSession of graph `which` ("step" or "prefill")."""
        with self._lock:
            if which not in self._sessions:
                self._sessions[which] = self._create_session(which)
            return self._sessions[which]

    def _create_session(self, which: str):
        import onnx
        import onnxruntime as ort

        from trt_lookahead.plugins import onnx_op

        path = self.config.graph(which)
        proto = onnx_op.decompose(onnx.load(str(path), load_external_data=False))
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = self.threads or _torch_threads()
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
        try:
            return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types
            if "NOT_IMPLEMENTED" in str(exc):
                raise OnnxRuntimeUnsupported(
                    f"onnxruntime's CPU kernels cannot run {path.name} of {self.config.path} ({exc})"
                ) from exc
            raise

    def make_executor(self, layout: StepLayout) -> OnnxRuntimeExecutor:
        return OnnxRuntimeExecutor(self, layout)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


class OnnxRuntimeExecutor:
    """Executor contract on an OnnxRuntimeEngine; see the module docstring."""

    def __init__(self, engine: OnnxRuntimeEngine, layout: StepLayout) -> None:
        cfg = engine.config
        T = layout.tokens
        if engine.tokens_per_step == T:
            layout.config.check_fits(engine.lookahead)
            self._graph, self._step_config = "step", (layout.config.W, layout.config.N, layout.config.G)
        elif T == 1:
            self._graph, self._step_config = "prefill", CAUSAL
        else:
            raise UserError(
                f"a {T}-slot step ({layout.config}) does not fit engine {cfg.path}, "
                f"built for T={engine.tokens_per_step} "
                f"({engine.lookahead}); pad the layout to the engine's T or rebuild"
            )
        self.engine = engine
        self.layout = layout
        self.vocab_size = int(cfg.model["vocab_size"])
        self.max_seq_len = engine.max_seq_len
        self.step_tokens = T
        self.output_slots = layout.output_slots if T > 1 else np.array([0])
        dtype = _NUMPY_DTYPES[cfg.dtype]
        L, Hkv, D = cfg.layers, int(cfg.model["num_kv_heads"]), int(cfg.model["head_dim"])
        self._layers = L
        self._rows = cfg.cache_rows
        self.k_cache = np.zeros((L, Hkv, self._rows, D), dtype)
        self.v_cache = np.zeros((L, Hkv, self._rows, D), dtype)
        K = len(self.output_slots)
        self._inputs = {
            "input_ids": np.zeros(T, np.int32),
            "positions": np.zeros(T, np.int32),
            "cache_len": np.zeros(1, np.int32),
            "step_config": np.array(self._step_config, np.int32),
            "output_slots": self.output_slots.astype(np.int32),
        }
        self._outputs = {
            "next_ids": np.zeros(K, np.int32),
            "logits": np.zeros((K, self.vocab_size), np.float32),
            "present_keys": np.zeros((L, Hkv, T, D), dtype),
            "present_values": np.zeros((L, Hkv, T, D), dtype),
        }
        self._session = engine.session(self._graph)
        self._binding = self._bind(self._session, self._inputs, self._outputs)
        self._result = np.full(T, -1, np.int64)
        self._p = 0
        self.sampling = SamplingParams()

    def _bind(self, session, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]):
        """IOBinding of every graph input and output to these numpy buffers, by address (no copies)."""
        binding = session.io_binding()
        arrays = dict(inputs)
        for name, layer in zip(cache_names(self._layers), [*self.k_cache, *self.v_cache], strict=True):
            arrays[name] = layer
        for name, array in arrays.items():
            binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        for name, array in outputs.items():
            binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        return binding

    # -- contract ---------------------------------------------------------------------------------

    @property
    def cached_tokens(self) -> int:
        return self._p

    def reset(self, sampling: SamplingParams | None = None) -> None:
        self.sampling = sampling or SamplingParams()
        self._p = 0

    def prefill(self, prompt_ids: np.ndarray) -> int:
        ids = check_prompt(prompt_ids, self.max_seq_len, self.vocab_size)
        P = len(ids)
        session = self.engine.session("prefill")
        chunk = self.engine.config.max_input_len
        self._p = 0
        for start in range(0, P, chunk):
            part = ids[start : start + chunk]
            n = len(part)
            inputs = {
                "input_ids": part.astype(np.int32),
                "positions": np.arange(start, start + n, dtype=np.int32),
                "cache_len": np.array([start], np.int32),
                "step_config": np.array(CAUSAL, np.int32),
                "output_slots": np.array([n - 1], np.int32),
            }
            outputs = {
                "next_ids": np.zeros(1, np.int32),
                "logits": np.zeros((1, self.vocab_size), np.float32),
                "present_keys": np.zeros((*self.k_cache.shape[:2], n, self.k_cache.shape[3]), self.k_cache.dtype),
                "present_values": np.zeros((*self.v_cache.shape[:2], n, self.v_cache.shape[3]), self.v_cache.dtype),
            }
            session.run_with_iobinding(self._bind(session, inputs, outputs))
            self.k_cache[:, :, start : start + n] = outputs["present_keys"]
            self.v_cache[:, :, start : start + n] = outputs["present_values"]
        self._p = P
        return int(self._select(outputs["next_ids"], outputs["logits"], np.array([P - 1]))[0])

    def step(self, input_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        if self._p > self.max_seq_len:
            raise ValueError(f"KV cache full: {self._p} tokens cached, max_seq_len={self.max_seq_len}")
        inputs = self._inputs
        inputs["input_ids"][:] = input_ids
        inputs["positions"][:] = positions
        inputs["cache_len"][0] = self._p
        self._session.run_with_iobinding(self._binding)
        out = self._outputs
        chosen = self._select(out["next_ids"], out["logits"], inputs["positions"][self.output_slots])
        result = self._result.copy()
        result[self.output_slots] = chosen
        return result

    def commit(self, slots: np.ndarray) -> None:
        slots = check_commit(slots, self.step_tokens, self._p, self.max_seq_len)
        k = len(slots)
        if k == 0:
            return
        p = self._p
        self.k_cache[:, :, p : p + k] = self._outputs["present_keys"][:, :, slots]
        self.v_cache[:, :, p : p + k] = self._outputs["present_values"][:, :, slots]
        self._p += k

    def _select(self, argmax: np.ndarray, logits: np.ndarray, positions: np.ndarray) -> np.ndarray:
        if self.sampling.greedy:
            return argmax.astype(np.int64)
        return select_tokens(logits, positions, self.sampling)

