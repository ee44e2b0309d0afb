"""OnnxRuntimeExecutor: the batched executor contract (lookahead/executor.py) on an engine dir's ONNX graph, CPU.

    engine = open_engine("engines/NAME")                  # backends/open.py
    ex = engine.executor(max_batch=4)                     # KV for 4 slots x (max_seq_len + T) rows
    x = ex.prefill(slot, prompt_ids, SamplingParams()); out = ex.step(StepBatch(...)); ex.commit(slot, rows)

Buffers are allocated once per executor: per layer K and V caches [max_batch, Hkv, S, D] (S = the
executor's max_seq_len + the built T: the graph's cache length is dynamic), and flat input and output
buffers sized for max_batch rows of T tokens, so that the step arrays of any (B, T, K) are views at fixed
addresses. A step binds those views and the first B physical
slots of every cache by address (IOBinding; one binding per (B, T, K), built on first use), so it copies
only the ids, positions, cache lengths, configs and output slots in and reads next_ids out; the graph reads
the caches in place. `commit` copies a row's accepted K/V (the graph's present outputs) into the slot's
cache rows; prefill runs one-row causal chunks of at most max_input_len tokens bound to the slot's own
cache, with presents of their own so that a pending step's presents survive. The slot bookkeeping, the
compact physical order and the host-side token choice are backends/graphs.py's SlotExecutor.

LookaheadAttention nodes (--attention plugin) have no onnxruntime kernel: in a float32 graph they run as
kernels/onnxruntime_attention.c, row-invariant, built for this machine on first use (SessionSettings
native_kernels; docs/design.md section 6.4), else as their standard-op decomposition (kernels/onnx_op.decompose);
with that library each layer's QKV split and rotary embedding run as its RotaryQKV (kernels/onnx_rotary.py), and
its MLP activation as its SwiGLU (kernels/onnx_swiglu.py).
An engine built with --exact runs the row-invariant decomposition there (section 4.2) and prefills in chunks of
at most EXACT_MAX_TOKENS tokens. A quantized engine's products of int8 activations run as the same library's
QuantizedMatMul where it holds one (engine/quantize.native_products; section 6.9), else as MatMulNBits.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trt_lookahead.backends.cpu_load import IdleWatch, available_memory, idle_cpus
from trt_lookahead.backends.graphs import Logits, OpenedEngine, SlotExecutor
from trt_lookahead.engine.format import INPUTS, OUTPUTS, EngineConfig, cache_names
from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.executor import check_kv_memory, kv_allocation, zeroed_pages

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
_BINDINGS = 32  # IOBindings kept per executor, one per (B, T, K) recently stepped


class OnnxRuntimeUnsupported(UserError):
    """The engine is valid but onnxruntime's CPU kernels cannot run it (e.g. bfloat16)."""


@dataclass(frozen=True)
class SessionSettings:
    """How onnxruntime runs an engine's graph; the defaults are what measured fastest with
    scripts/bench_onnxruntime.py --variants and scripts/cpu_step_vs_llama.py. Intra-op workers that spin between
    parallel sections save waking them before each one on a quiet CPU and take the cores from other work on a
    busy one, so by default they spin only while the machine has a CPU idle for each thread: as the session is
    made, and then as it runs (OnnxRuntimeEngine.current_session; docs/design.md section 6.6)."""

    threads: int | None = None  # intra-op threads; None: torch's thread count
    spinning: bool | None = None  # intra-op workers spin instead of sleeping; None: while the CPUs are idle
    arena: bool = True  # the CPU memory arena for the graph's intermediate tensors
    optimization: str = "all"  # onnxruntime graph optimisation level: disabled, basic, extended, all
    prepacking: bool = True  # MatMul weights repacked for the CPU kernels once, at load
    profile_prefix: str | None = None  # onnxruntime's per-node profiler on, its JSON named from this prefix
    # float32 attention and quantized products by the C kernels where they build here (kernels/onnxruntime_library),
    # else by standard ops and MatMulNBits
    native_kernels: bool = True

    def options(self) -> Any:
        """onnxruntime.SessionOptions for these settings."""
        import onnxruntime as ort

        levels = {"disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                  "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                  "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
        if self.optimization not in levels:
            raise UserError(f"unknown onnxruntime optimisation level {self.optimization!r}; "
                            f"use one of {', '.join(levels)}")
        options = ort.SessionOptions()
        options.graph_optimization_level = levels[self.optimization]
        options.intra_op_num_threads = self.threads or _torch_threads()
        options.inter_op_num_threads = 1
        # native messages would precede our one error line: a failure still raises, and is worded by the caller
        options.log_severity_level = _FATAL_ONLY
        options.enable_cpu_mem_arena = self.arena
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spins() else "0")
        options.add_session_config_entry("session.disable_prepacking", "0" if self.prepacking else "1")
        if self.profile_prefix is not None:  # scripts/profile_cpu_step.py: time per node
            options.enable_profiling = True
            options.profile_file_prefix = self.profile_prefix
        return options

    def spins(self) -> bool:
        """Whether the workers spin: `spinning`, or where that is None whether the CPUs this process may use
        hold an idle one per intra-op thread now (measured over IDLE_SAMPLE_S)."""
        threads = self.threads or _torch_threads()
        if self.spinning is not None or threads < 2:  # one thread has no workers to spin
            return bool(self.spinning) and threads > 1
        return spin_with(idle_cpus(IDLE_SAMPLE_S), threads)


def spin_with(spare: float, threads: int) -> bool:
    """Whether `threads` intra-op workers may spin with `spare` CPUs left by other processes: one each, about."""
    return spare >= threads - IDLE_SLACK


IDLE_SAMPLE_S = 0.1  # how long `idle_cpus` watches the machine before a session's workers may spin
IDLE_SLACK = 0.25  # CPUs short of one per thread that still count as idle (a sample's own noise)
FOLLOW_PERIOD_S = 1.0  # how often an engine whose spinning follows the machine re-reads its spare CPUs
FOLLOW_PERIODS = 2  # readings in a row that must disagree with the session's spinning before the first replacement
# each replacement doubles the readings the next one needs, at most 2**FOLLOW_BACKOFF times: a load that comes and
# goes rebuilds the session about once a minute at most
FOLLOW_BACKOFF = 5


_FATAL_ONLY = 4  # onnxruntime's log severities: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal


class OnnxRuntimeEngine(OpenedEngine):
    """An engine dir's graph as one onnxruntime session (created on first use, shared by its executors)."""

    def __init__(self, config: EngineConfig, max_seq_len: int | None = None, max_batch: int | None = None,
                 settings: SessionSettings = SessionSettings()) -> None:
        if config.dtype not in _NUMPY_DTYPES:
            raise OnnxRuntimeUnsupported(
                f"engine {config.path} holds {config.dtype} weights, which onnxruntime's CPU kernels cannot run "
                "(no bfloat16 MatMul); build a float32 engine for the onnxruntime backend, or use --backend tensorrt"
            )
        super().__init__(config, max_seq_len, max_batch)
        self.settings = settings
        if config.exact:
            from trt_lookahead.kernels.onnx_op import EXACT_MAX_TOKENS

            if config.step_tokens > EXACT_MAX_TOKENS:
                raise UserError(f"engine {config.path} is marked exact but its steps hold {config.step_tokens} tokens "
                                f"(an exact graph holds at most {EXACT_MAX_TOKENS}); rebuild it")
            if not settings.prepacking:  # unpacked weights take a 1-row MatMul path that rounds another way
                raise UserError(f"engine {config.path} is exact, and its projections are row-invariant only with "
                                "prepacked weights: run it with prepacking on (the default)")
            self.exact = True
            if config.quantization != "float" and not self.native_products:
                self.min_rows = 2  # MatMulNBits rounds a 1-row product another way (design 6.9)
            # exact graphs hold at most EXACT_MAX_TOKENS tokens per row: longer prompts are prefilled in chunks
            self.prefill_tokens = min(config.max_input_len, EXACT_MAX_TOKENS)
        self.spinning: bool | None = None  # the current session's workers spin; None: no session yet
        self.respins = 0  # sessions replaced because the machine's spare CPUs changed (`current_session`)
        self._session: Any = None
        self._lock = threading.Lock()
        self._threads = 0  # the sessions' intra-op threads, fixed when the first is made
        self._watch: IdleWatch | None = None  # set while the workers' spinning follows the machine
        self._votes = 0  # readings in a row that disagreed with the session's spinning
        self._builder: threading.Thread | None = None  # making a replacement session

    def session(self) -> Any:
        """The onnxruntime InferenceSession of the engine's graph: the first one made, or its replacement."""
        with self._lock:
            if self._session is None:
                self._threads = self.settings.threads or _torch_threads()
                spinning = self.settings.spins()
                self._session = self._create_session(self._settings(spinning))
                self.spinning = spinning
                if self.settings.spinning is None and self._threads > 1:  # the machine's choice: follow it
                    watch = IdleWatch(FOLLOW_PERIOD_S)
                    self._watch = watch if watch.readable else None
            return self._session

    def current_session(self) -> Any:
        """The session for the next run. Where the workers' spinning is the machine's choice (SessionSettings
        spinning None), the spare CPUs are re-read every FOLLOW_PERIOD_S (IdleWatch), and after FOLLOW_PERIODS
        readings in a row (doubled by each replacement so far) that disagree with the session's spinning, a session
        with the other setting is made in a background thread; runs move to it once it is ready. Other processes
        that start (or stop) using the CPUs after the session was made then cost seconds, not the rest of a server's
        life (docs/design.md section 6.6). A replacement holds a second copy of the weights while it is made:
        without the memory for it, or if making it fails, the engine keeps its session and stops following."""
        session = self._session if self._session is not None else self.session()  # no lock on the step's path
        watch = self._watch
        if watch is None or self._builder is not None or (spare := watch.poll()) is None:
            return session
        wanted = spin_with(spare, self._threads)
        self._votes = self._votes + 1 if wanted != self.spinning else 0
        if self._votes >= FOLLOW_PERIODS << min(self.respins, FOLLOW_BACKOFF):
            available = available_memory()
            if available is None or available < 2 * self._weight_bytes():
                self._watch = None
                return session
            self._builder = threading.Thread(target=self._replace, args=(wanted,), name="trt-lookahead-respin",
                                             daemon=True)
            self._builder.start()
        return session

    def _replace(self, spinning: bool) -> None:
        """`current_session`'s background half: make the session, then hand it over."""
        try:
            session = self._create_session(self._settings(spinning))
        except Exception:  # it loaded once, so this is the machine (memory): keep the session that runs
            self._watch, session = None, None
        with self._lock:
            if session is not None:
                self._session, self.spinning = session, spinning
                self.respins += 1
            self._votes, self._builder = 0, None

    def _settings(self, spinning: bool) -> SessionSettings:
        return dataclasses.replace(self.settings, threads=self._threads, spinning=spinning)

    @functools.cached_property
    def native_library(self) -> Path | None:
        """The C kernels built here (kernels/onnxruntime_library.py), where the settings ask for them and the graph is
        float32 (else, or where they cannot be built, the graph runs the standard-op decomposition)."""
        if not self.settings.native_kernels or self.config.dtype != "float32":
            return None
        from trt_lookahead.kernels.onnxruntime_library import native_library

        return native_library().path

    @functools.cached_property
    def native_products(self) -> bool:
        """Whether the quantized products run as the library's QuantizedMatMul: int8 activations, and a library
        built with it (this CPU has AVX2, FMA and F16C)."""
        if self.config.quantization == "float" or self.config.activations != "int8" or self.native_library is None:
            return False
        from trt_lookahead.kernels.onnxruntime_library import native_library

        return native_library().quantized

    def _weight_bytes(self) -> int:
        """The engine dir's file sizes: about what a second session's weights take."""
        return sum(f.stat().st_size for f in self.config.path.iterdir() if f.is_file())

    def graph(self) -> Any:
        """The onnx.ModelProto onnxruntime runs: the engine's graph, checked, with LookaheadAttention decomposed."""
        import onnx

        from trt_lookahead.kernels import onnx_op
        from trt_lookahead.kernels.onnx_rotary import native_rotary
        from trt_lookahead.kernels.onnx_stack import concat_stacks
        from trt_lookahead.kernels.onnx_swiglu import native_swiglu

        path = self.config.graph
        try:
            proto = onnx.load(str(path), load_external_data=False)
        except Exception as exc:  # protobuf's DecodeError and friends: a truncated or replaced file
            raise UserError(f"engine file {path} is not a readable ONNX graph ({exc}); rebuild the engine") from exc
        self.config.check_graph_io({
            value.name: tuple(dim.dim_value if dim.HasField("dim_value") else None
                              for dim in value.type.tensor_type.shape.dim)
            for value in (*proto.graph.input, *proto.graph.output)
        })
        proto, _ = concat_stacks(proto)  # the layers' new keys and values stacked by one Concat
        if self.native_library is not None:  # each layer's QKV split and rotary embedding, and its SwiGLU, as nodes
            proto, _ = native_rotary(proto)
            proto, _ = native_swiglu(proto)
        try:
            # a tree engine's nodes carry its subtree ends (an initializer over the graph's most tokens)
            proto = onnx_op.decompose(proto, exact=self.config.exact, native=self.native_library is not None)
        except ValueError as exc:
            raise UserError(f"engine {self.config.path}: {exc}; rebuild it without --exact") from exc
        if self.native_products:
            from trt_lookahead.engine.quantize import native_products

            proto, left = native_products(proto)
            if left:  # min_rows is 1: a MatMulNBits left would round a 1-row step another way
                raise UserError(f"engine {self.config.path}: {left} quantized products multiply float activations "
                                "although config.json says int8; rebuild the engine")
        return proto

    def session_options(self, settings: SessionSettings) -> Any:
        """onnxruntime.SessionOptions for `graph()` at these settings: the engine's weight files found beside its
        graph, and the native attention kernel registered where the graph has its nodes."""
        options = settings.options()
        if self.native_library is not None:
            options.register_custom_ops_library(str(self.native_library))
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(self.config.graph.parent))
        return options

    def _create_session(self, settings: SessionSettings) -> Any:
        import onnxruntime as ort

        path = self.config.graph
        proto = self.graph()
        options = self.session_options(settings)
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

    def executor(self, max_batch: int | None = None) -> OnnxRuntimeExecutor:
        """A batched executor with its own KV cache for `max_batch` slots (default: the engine's)."""
        return OnnxRuntimeExecutor(self, max_batch)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


class OnnxRuntimeExecutor(SlotExecutor):
    """The batched executor contract on an OnnxRuntimeEngine; see the module docstring."""

    def __init__(self, engine: OnnxRuntimeEngine, max_batch: int | None = None) -> None:
        super().__init__(engine, max_batch)
        cfg, B, T = engine.config, self.max_batch, self.step_tokens
        dtype = _NUMPY_DTYPES[cfg.dtype]
        L, Hkv, D, V = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
        self._engine = engine
        self._session = engine.session()
        S = self.max_seq_len + T  # the graph's cache length is dynamic: rows for this executor's max_seq_len
        check_kv_memory((L, B, Hkv, S, D), np.dtype(dtype).itemsize, self.max_seq_len, B)
        with kv_allocation(self.max_seq_len, B):
            self.k_cache = zeroed_pages((L, B, Hkv, S, D), dtype)  # per layer [max_batch, Hkv, S, D]
            self.v_cache = zeroed_pages((L, B, Hkv, S, D), dtype)
        self._caches = [*self.k_cache, *self.v_cache]  # graph order: every key cache, then every value cache
        self._cache_shape = (Hkv, S, D)
        # flat buffers: the arrays of any (B, T, K) are views at their start, so bindings keep their addresses
        step = {"input_ids": B * T, "positions": B * T, "cache_len": B, "step_config": B * 3, "output_slots": B * T,
                "next_ids": B * T}
        self._flat = {name: np.zeros(size, np.int32) for name, size in step.items()}
        self._flat["logits"] = np.zeros(B * T * V, np.float32)
        for name in OUTPUTS[2:]:  # present_keys, present_values [L, B, Hkv, T, D]
            self._flat[name] = np.zeros(L * B * Hkv * T * D, dtype)
        prefill, K = max(cfg.max_input_len, engine.min_rows), engine.min_rows  # a prefill chunk's outputs (one row)
        self._prefill_out = {"next_ids": np.zeros((1, K), np.int32), "logits": np.zeros((1, K, V), np.float32),
                             **{name: np.zeros(L * Hkv * prefill * D, dtype) for name in OUTPUTS[2:]}}
        self._bindings: OrderedDict[tuple[int, int, int], tuple[Any, dict[str, np.ndarray]]] = OrderedDict()
        self._current: dict[str, np.ndarray] = {}

    def _shapes(self, B: int, T: int, K: int) -> dict[str, tuple[int, ...]]:
        L, V = self.config.num_layers, self.vocab_size
        Hkv, _, D = self._cache_shape
        return {"input_ids": (B, T), "positions": (B, T), "cache_len": (B,), "step_config": (B, 3),
                "output_slots": (B, K), "next_ids": (B, K), "logits": (B, K, V),
                "present_keys": (L, B, Hkv, T, D), "present_values": (L, B, Hkv, T, D)}

    def _binding(self, B: int, T: int, K: int) -> tuple[Any, dict[str, np.ndarray]]:
        """The IOBinding of a (B, T, K) step and its array views, built on first use (least recently used out)."""
        key = (B, T, K)
        if key not in self._bindings:
            views = {name: self._flat[name][: int(np.prod(shape))].reshape(shape)
                     for name, shape in self._shapes(B, T, K).items()}
            caches = [layer[:B] for layer in self._caches]  # the first B physical slots, in place
            self._bindings[key] = (_bind(self._session, {name: views[name] for name in INPUTS}, caches,
                                         {name: views[name] for name in OUTPUTS}), views)
        self._bindings.move_to_end(key)
        while len(self._bindings) > _BINDINGS:
            self._bindings.popitem(last=False)
        return self._bindings[key]

    def _follow(self) -> None:
        """Run on the engine's current session (OnnxRuntimeEngine.current_session), rebinding after a change."""
        session = self._engine.current_session()
        if session is not self._session:
            self._session, self._bindings = session, OrderedDict()

    def _inputs(self, B: int, T: int, K: int) -> dict[str, np.ndarray]:
        self._follow()
        self._current = self._binding(B, T, K)[1]
        return self._current

    def _run(self, B: int, T: int, K: int) -> tuple[np.ndarray, Logits]:
        binding, views = self._binding(B, T, K)
        self._execute(binding)
        return views["next_ids"], lambda: views["logits"]

    def _prefill_chunk(self, physical: int, start: int, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, Logits]:
        n = inputs["input_ids"].shape[1]
        L, (Hkv, _, D) = self.config.num_layers, self._cache_shape
        outputs = {name: self._prefill_out[name] for name in OUTPUTS[:2]}
        outputs |= {name: self._prefill_out[name][: L * Hkv * n * D].reshape(L, 1, Hkv, n, D) for name in OUTPUTS[2:]}
        caches = [layer[physical : physical + 1] for layer in self._caches]  # the slot's own cache, in place
        self._follow()
        self._execute(_bind(self._session, inputs, caches, outputs))
        self.k_cache[:, physical, :, start : start + n] = outputs["present_keys"][:, 0]
        self.v_cache[:, physical, :, start : start + n] = outputs["present_values"][:, 0]
        return outputs["next_ids"], lambda: outputs["logits"]

    def _execute(self, binding: Any) -> None:
        """Run the graph; a failure inside it (a damaged graph that loaded, e.g. under --no-verify) is one UserError."""
        try:
            self._session.run_with_iobinding(binding)
        except RuntimeError as exc:  # onnxruntime's Fail and friends
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(
                f"onnxruntime failed running engine {self.config.path} ({first}); its files are damaged or from "
                "different builds: rebuild the engine (loading without --no-verify checks them)"
            ) from exc

    def _keep(self, physical: int, row: int, rows: np.ndarray, start: int) -> None:
        end = start + len(rows)
        self.k_cache[:, physical, :, start:end] = self._current["present_keys"][:, row][:, :, rows]
        self.v_cache[:, physical, :, start:end] = self._current["present_values"][:, row][:, :, rows]

    def _move(self, src: int, dst: int, length: int) -> None:
        for cache in (self.k_cache, self.v_cache):
            cache[:, dst, :, :length] = cache[:, src, :, :length]

    def _swap(self, a: int, b: int, length: int) -> None:
        for cache in (self.k_cache, self.v_cache):
            held = cache[:, a, :, :length].copy()
            cache[:, a, :, :length] = cache[:, b, :, :length]
            cache[:, b, :, :length] = held


def _bind(session: Any, inputs: dict[str, np.ndarray], caches: list[np.ndarray], outputs: dict[str, np.ndarray]) -> Any:
    """IOBinding of the graph's inputs, per-layer caches and outputs to these numpy arrays, by address."""
    binding = session.io_binding()
    names = [*inputs, *cache_names(len(caches) // 2)]
    for name, array in zip(names, [*inputs.values(), *caches], strict=True):
        binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
    for name, array in outputs.items():
        binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
    return binding
