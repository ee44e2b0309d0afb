"""OnnxRuntimeExecutor: the executor contract (lookahead/executor.py) on an engine dir's ONNX graphs, on CPU.

    engine = open_engine("engines/NAME")                  # backends/open.py
    ex = engine.make_executor(StepLayout(cfg, padded_tokens=engine.step_tokens))
    ex.reset(SamplingParams()); x = ex.prefill(prompt); ids = ex.step(input_ids, positions); ex.commit(slots)

Buffers are allocated once per executor: the KV cache ([Hkv, max_seq_len + T, D] per layer), the
step inputs and outputs. They are bound to the step session by address (IOBinding), so a step copies
only the T input ids and positions in and the chosen ids out; the graph reads the cache in place.
`commit` copies the accepted slots' K/V (a graph output) to cache rows cache_len, cache_len+1, ...

Which graph runs: a layout of the engine's T runs step.onnx with step_config = the layout's
(W, N, G) (a smaller config padded to T runs on the same graph: the mask is computed from
step_config in the graph); a one-token layout (greedy) runs prefill.onnx at T = 1, causal. Prefill
runs prefill.onnx in chunks of at most max_input_len tokens.

LookaheadAttention nodes (--attention plugin) run as their standard-op decomposition
(kernels/onnx_op.decompose): onnxruntime has no kernel for them. Token choice: argmax in the graph;
seeded sampling on the host from the graph's float32 logits with `sampling.select_tokens`, keyed by
absolute positions like the torch executor.
"""

from __future__ import annotations

import threading

import numpy as np

from trt_lookahead.backends.graphs import EngineExecutor, OpenedEngine, choose_tokens, prefill_chunks
from trt_lookahead.engine.format import EngineConfig, cache_names
from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.executor import check_kv_memory, check_prompt, check_room
from trt_lookahead.lookahead.layout import StepLayout

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


class OnnxRuntimeUnsupported(UserError):
    """The engine is valid but onnxruntime's CPU kernels cannot run it (e.g. bfloat16)."""


class OnnxRuntimeEngine(OpenedEngine):
    """An engine dir's graphs as onnxruntime sessions (created on first use, shared by its executors)."""

    def __init__(self, config: EngineConfig, max_seq_len: int | None = None, threads: int | None = None) -> None:
        if config.dtype not in _NUMPY_DTYPES:
            raise OnnxRuntimeUnsupported(
                f"engine {config.path} holds {config.dtype} weights, which onnxruntime's CPU kernels cannot run "
                "(no bfloat16 MatMul); build a float32 engine for the onnxruntime backend, or use --backend tensorrt"
            )
        super().__init__(config, max_seq_len)
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

        from trt_lookahead.kernels import onnx_op

        path = self.config.graph(which)
        try:
            proto = onnx.load(str(path), load_external_data=False)
        except Exception as exc:  # protobuf's DecodeError and friends: a truncated or replaced file
            raise UserError(f"engine file {path} is not a readable ONNX graph ({exc}); rebuild the engine") from exc
        self.config.check_graph_io(which, {
            value.name: tuple(dim.dim_value if dim.HasField("dim_value") else None
                              for dim in value.type.tensor_type.shape.dim)
            for value in (*proto.graph.input, *proto.graph.output)
        })
        proto = onnx_op.decompose(proto)
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
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"onnxruntime cannot load {path.name} of engine {self.config.path} ({first_line}); its files are "
                "damaged or from different builds: rebuild the engine (loading without --no-verify checks them)"
            ) from exc

    def make_executor(self, layout: StepLayout) -> OnnxRuntimeExecutor:
        return OnnxRuntimeExecutor(self, layout)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


class OnnxRuntimeExecutor(EngineExecutor):
    """Executor contract on an OnnxRuntimeEngine; see the module docstring."""

    def __init__(self, engine: OnnxRuntimeEngine, layout: StepLayout) -> None:
        super().__init__(engine, layout)
        cfg, run, T = engine.config, self.run, self.step_tokens
        self.engine = engine
        dtype = _NUMPY_DTYPES[cfg.dtype]
        L, Hkv, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        self._layers = L
        self._rows = cfg.cache_rows
        check_kv_memory((L, Hkv, self._rows, D), np.dtype(dtype).itemsize, engine.max_seq_len)
        self.k_cache = np.zeros((L, Hkv, self._rows, D), dtype)
        self.v_cache = np.zeros((L, Hkv, self._rows, D), dtype)
        K = len(self.output_slots)
        self._inputs = {
            "input_ids": np.zeros(T, np.int32),
            "positions": np.zeros(T, np.int32),
            "cache_len": np.zeros(1, np.int32),
            "step_config": np.array(run.step_config, np.int32),
            "output_slots": self.output_slots.astype(np.int32),
        }
        self._outputs = {
            "next_ids": np.zeros(K, np.int32),
            "logits": np.zeros((K, self.vocab_size), np.float32),
            "present_keys": np.zeros((L, Hkv, T, D), dtype),
            "present_values": np.zeros((L, Hkv, T, D), dtype),
        }
        self._session = engine.session("step" if run.step_graph else "prefill")
        self._binding = self._bind(self._session, self._inputs, self._outputs)

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

    def prefill(self, prompt_ids: np.ndarray) -> int:
        ids = check_prompt(prompt_ids, self.max_seq_len, self.vocab_size)
        P = len(ids)
        session = self.engine.session("prefill")
        chunk = self.engine.config.max_input_len
        self._cache_len = 0
        outputs: dict[str, np.ndarray] = {}
        for start, inputs in prefill_chunks(ids, chunk):
            n = len(inputs["input_ids"])
            outputs = {
                "next_ids": np.zeros(1, np.int32),
                "logits": np.zeros((1, self.vocab_size), np.float32),
                "present_keys": np.zeros((*self.k_cache.shape[:2], n, self.k_cache.shape[3]), self.k_cache.dtype),
                "present_values": np.zeros((*self.v_cache.shape[:2], n, self.v_cache.shape[3]), self.v_cache.dtype),
            }
            session.run_with_iobinding(self._bind(session, inputs, outputs))
            self.k_cache[:, :, start : start + n] = outputs["present_keys"]
            self.v_cache[:, :, start : start + n] = outputs["present_values"]
        self._cache_len = P
        return int(self._select(outputs, np.array([P - 1]))[0])

    def step(self, input_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        check_room(self._cache_len, self.max_seq_len)
        inputs = self._inputs
        inputs["input_ids"][:] = input_ids
        inputs["positions"][:] = positions
        inputs["cache_len"][0] = self._cache_len
        self._session.run_with_iobinding(self._binding)
        out = self._outputs
        chosen = self._select(out, inputs["positions"][self.output_slots])
        return self._at_output_slots(chosen)

    def _keep(self, slots: np.ndarray, row: int) -> None:
        end = row + len(slots)
        self.k_cache[:, :, row:end] = self._outputs["present_keys"][:, :, slots]
        self.v_cache[:, :, row:end] = self._outputs["present_values"][:, :, slots]

    def _select(self, outputs: dict[str, np.ndarray], positions: np.ndarray) -> np.ndarray:
        return choose_tokens(self.sampling, outputs["next_ids"], lambda: outputs["logits"], positions)

