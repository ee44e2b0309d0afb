"""TensorRT: build engine.plan from an engine dir, and run it through the executor contract on a GPU.

This is the only module that imports `tensorrt`, and only lazily (`_tensorrt()`); everything else
in the package runs without it. TensorRT cannot be installed on the project's CPU machines (see
shared/reference/dependencies.md), so this layer is kept thin and written to the TensorRT 11 Python
API as documented (shared/reference/tensorrt.md); its tests skip where TensorRT or a GPU is missing.

Build (`build_plan`, also `python -m trt_lookahead.executors.tensorrt ENGINE_DIR`):
    register the LookaheadAttention QDP (plugins/tensorrt_plugin.py), parse prefill.onnx (the
    dynamic-length graph) with trt.OnnxParser into a strongly typed network, add the optimisation
    profiles below, build and serialize engine.plan, record it in config.json.

    profile 0  prefill   input_ids/positions [1 .. max_input_len], output_slots [1 .. max_input_len]
    profile 1  step      T = (W+G)(N-1) fixed, output_slots [1 .. T]
    profile 2  single    T = 1 (greedy baseline, CUDA graph too); absent when the step T is 1

Run (`TensorRTEngine.make_executor(layout)` -> `TensorRTExecutor`): one execution context per
profile sharing one block of device memory (USER_MANAGED); every buffer is a torch CUDA tensor
allocated once and bound by address once; the step (host-to-device copy of ids/positions/p from pinned
memory, execute_async_v3, argmax ids back) is captured once in a CUDA graph and replayed. p and
(W, N, G) live in device tensors, so the replay is valid for every step. `commit` moves the accepted
slots' K/V (graph outputs) into the cache rows p.. with torch ops on the same stream.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from trt_lookahead.builder import PLAN_FILE, PREFILL_GRAPH, EngineConfig, cache_names, load_engine_config
from trt_lookahead.errors import UserError
from trt_lookahead.executors.base import check_commit, check_prompt
from trt_lookahead.layout import StepLayout
from trt_lookahead.sampling import SamplingParams, select_tokens

CAUSAL = (0, 0, 0)
PREFILL, STEP, SINGLE = 0, 1, 2


def _tensorrt():
    import tensorrt as trt

    return trt


def gpu_count() -> int:
    """CUDA devices visible through cuda-python's runtime API (0 where cuda-python or a driver is missing)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return 0
    err, count = runtime.cudaGetDeviceCount()
    return int(count) if err == runtime.cudaError_t.cudaSuccess else 0


def unavailable_reason() -> str | None:
    """Why TensorRT cannot build or run here, or None when it can."""
    try:
        _tensorrt()
    except ImportError as exc:
        return f"`import tensorrt` fails: {exc}"
    if gpu_count() == 0:
        return "no CUDA device (cuda-python's cudaGetDeviceCount found none)"
    return None


def _profiles(config: EngineConfig) -> list[dict[str, tuple[int, int, int]]]:
    """Per profile, (min, opt, max) of the token count and of the output row count."""
    T = config.tokens_per_step
    longest = config.max_input_len
    profiles = [
        {"tokens": (1, min(longest, 128), longest), "rows": (1, 1, longest)},  # prefill: last row only
        {"tokens": (T, T, T), "rows": (1, T, T)},  # step; a smaller config padded to T reads fewer rows
    ]
    if T != 1:
        profiles.append({"tokens": (1, 1, 1), "rows": (1, 1, 1)})  # single token: the greedy baseline
    return profiles


def build_plan(engine_dir: str | Path) -> float:
    """Parse the engine dir's prefill graph with the plugin registered and write engine.plan; -> seconds."""
    trt = _tensorrt()
    import tensorrt.plugin as trtp

    from trt_lookahead.plugins import tensorrt_plugin

    start = time.perf_counter()
    config = load_engine_config(engine_dir)
    tensorrt_plugin.register(trt, trtp)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if int(trt.__version__.split(".")[0]) < 11:  # TensorRT 11 networks are always strongly typed
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(config.path / PREFILL_GRAPH)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise UserError(f"TensorRT could not parse {config.path / PREFILL_GRAPH}: {errors}")
    build_config = builder.create_builder_config()
    for ranges in _profiles(config):
        profile = builder.create_optimization_profile()
        for name, dim in (("input_ids", "tokens"), ("positions", "tokens"), ("output_slots", "rows")):
            low, opt, high = ranges[dim]
            profile.set_shape(name, (low,), (opt,), (high,))
        build_config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, build_config)
    if plan is None:
        raise UserError(f"TensorRT failed to build a plan from {config.path / PREFILL_GRAPH} (see its log above)")
    (config.path / PLAN_FILE).write_bytes(bytes(plan))
    seconds = time.perf_counter() - start
    raw = dict(config.raw)
    raw.setdefault("targets", {})["tensorrt"] = {
        "built": True, "plan": PLAN_FILE, "tensorrt": trt.__version__, "profiles": _profiles(config),
        "build_seconds": round(seconds, 2),
    }
    (config.path / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    return seconds


class TensorRTEngine:
    """engine.plan deserialized once; executors share its weights and device memory."""

    def __init__(self, config: EngineConfig, max_seq_len: int | None = None) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise UserError(f"the tensorrt backend cannot run here: {reason}; use --backend onnxruntime")
        plan = config.path / PLAN_FILE
        if not plan.is_file():
            raise UserError(
                f"engine {config.path} has no {PLAN_FILE}; build it on this GPU host with "
                f"`python -m trt_lookahead.executors.tensorrt {config.path}`"
            )
        trt = _tensorrt()
        import tensorrt.plugin as trtp
        import torch

        from trt_lookahead.plugins import tensorrt_plugin

        tensorrt_plugin.register(trt, trtp)
        self.config = config
        self.lookahead = config.lookahead
        self.tokens_per_step = config.tokens_per_step
        self.max_seq_len = config.max_seq_len if max_seq_len is None else int(max_seq_len)
        self.dtype = config.dtype
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(plan.read_bytes())
        if self.engine is None:
            raise UserError(f"TensorRT could not deserialize {plan}; rebuild it with this TensorRT version")
        self.device = torch.device("cuda")
        self.stream = torch.cuda.Stream(self.device)
        # one block of activation memory for every context (they never run at the same time)
        self._memory = torch.empty(self.engine.device_memory_size_v2, dtype=torch.uint8, device=self.device)

    def context(self, profile: int):
        """A new execution context on `profile`, using the shared activation memory."""
        trt = _tensorrt()
        ctx = self.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        ctx.set_device_memory(self._memory.data_ptr(), self.engine.device_memory_size_v2)
        ctx.set_optimization_profile_async(profile, self.stream.cuda_stream)
        return ctx

    def make_executor(self, layout: StepLayout) -> TensorRTExecutor:
        return TensorRTExecutor(self, layout)


class TensorRTExecutor:
    """Executor contract on a TensorRTEngine (static CUDA buffers, the step replayed as a CUDA graph)."""

    def __init__(self, engine: TensorRTEngine, layout: StepLayout) -> None:
        import torch

        cfg = engine.config
        T = layout.tokens
        if engine.tokens_per_step == T:
            layout.config.check_fits(engine.lookahead)
            profile, step_config = STEP, (layout.config.W, layout.config.N, layout.config.G)
        elif T == 1:
            profile, step_config = SINGLE, CAUSAL
        else:
            raise UserError(f"a {T}-slot step does not fit engine {cfg.path} (T={engine.tokens_per_step})")
        if T == 1 and engine.tokens_per_step == 1:
            profile = STEP
        self.engine = engine
        self.layout = layout
        self.vocab_size = int(cfg.model["vocab_size"])
        self.max_seq_len = engine.max_seq_len
        self.step_tokens = T
        self.output_slots = layout.output_slots if T > 1 else np.array([0])
        dev, dtype = engine.device, getattr(torch, cfg.dtype)
        L, Hkv, D = cfg.layers, int(cfg.model["num_kv_heads"]), int(cfg.model["head_dim"])
        K = len(self.output_slots)
        self._stream = engine.stream
        self.k_cache = torch.zeros(L, Hkv, cfg.cache_rows, D, dtype=dtype, device=dev)
        self.v_cache = torch.zeros_like(self.k_cache)
        # per-step values: one pinned staging row [ids | positions | p] copied to the device inside the
        # graph; each part starts on a 256-byte boundary, as TensorRT wants its I/O addresses aligned
        stride = -(-T // 64) * 64
        self._h_in = torch.zeros(3 * stride, dtype=torch.int32, pin_memory=True)
        self._h_in_np = self._h_in.numpy()
        self._d_in = torch.zeros(3 * stride, dtype=torch.int32, device=dev)
        self._stride = stride
        self._buffers = {
            "input_ids": self._d_in[:T],
            "positions": self._d_in[stride : stride + T],
            "cache_len": self._d_in[2 * stride : 2 * stride + 1],
            "step_config": torch.tensor(step_config, dtype=torch.int32, device=dev),
            "output_slots": torch.from_numpy(self.output_slots.astype(np.int32)).to(dev),
            "next_ids": torch.zeros(K, dtype=torch.int32, device=dev),
            "logits": torch.zeros(K, self.vocab_size, dtype=torch.float32, device=dev),
            "present_keys": torch.zeros(L, Hkv, T, D, dtype=dtype, device=dev),
            "present_values": torch.zeros(L, Hkv, T, D, dtype=dtype, device=dev),
        }
        for name, layer in zip(cache_names(L), [*self.k_cache, *self.v_cache], strict=True):
            self._buffers[name] = layer
        self._h_out = torch.zeros(K, dtype=torch.int32, pin_memory=True)
        self._ctx = engine.context(profile)
        self._bind(self._ctx, self._buffers, T, K)
        self._graph = self._capture()
        self._prefill_ctx = None
        self._result = np.full(T, -1, np.int64)
        self._p = 0
        self.sampling = SamplingParams()

    @staticmethod
    def _bind(ctx, buffers: dict, tokens: int, rows: int) -> None:
        ctx.set_input_shape("input_ids", (tokens,))
        ctx.set_input_shape("positions", (tokens,))
        ctx.set_input_shape("output_slots", (rows,))
        for name, tensor in buffers.items():
            ctx.set_tensor_address(name, tensor.data_ptr())
        unresolved = ctx.infer_shapes()
        if unresolved:
            raise RuntimeError(f"TensorRT could not infer the shapes of {unresolved}")

    def _run_step(self) -> None:
        self._d_in.copy_(self._h_in, non_blocking=True)
        if not self._ctx.execute_async_v3(self._stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        self._h_out.copy_(self._buffers["next_ids"], non_blocking=True)

    def _capture(self):
        """Warm up (TensorRT's deferred shape work must not be captured), then capture one step."""
        import torch

        with torch.cuda.stream(self._stream):
            self._run_step()
        self._stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self._stream):
            self._run_step()
        return graph

    # -- contract ---------------------------------------------------------------------------------

    @property
    def cached_tokens(self) -> int:
        return self._p

    def reset(self, sampling: SamplingParams | None = None) -> None:
        self.sampling = sampling or SamplingParams()
        self._p = 0

    def prefill(self, prompt_ids: np.ndarray) -> int:
        import torch

        ids = check_prompt(prompt_ids, self.max_seq_len, self.vocab_size)
        P = len(ids)
        if self._prefill_ctx is None:
            self._prefill_ctx = self.engine.context(PREFILL)
        cfg, dev = self.engine.config, self.engine.device
        chunk = cfg.max_input_len
        with torch.cuda.stream(self._stream):
            for start in range(0, P, chunk):
                part = torch.from_numpy(ids[start : start + chunk].astype(np.int32)).to(dev)
                n = len(part)
                buffers = {
                    "input_ids": part,
                    "positions": torch.arange(start, start + n, dtype=torch.int32, device=dev),
                    "cache_len": torch.tensor([start], dtype=torch.int32, device=dev),
                    "step_config": torch.tensor(CAUSAL, dtype=torch.int32, device=dev),
                    "output_slots": torch.tensor([n - 1], dtype=torch.int32, device=dev),
                    "next_ids": torch.zeros(1, dtype=torch.int32, device=dev),
                    "logits": torch.zeros(1, self.vocab_size, dtype=torch.float32, device=dev),
                    "present_keys": self.k_cache.new_zeros(*self.k_cache.shape[:2], n, self.k_cache.shape[3]),
                    "present_values": self.v_cache.new_zeros(*self.v_cache.shape[:2], n, self.v_cache.shape[3]),
                }
                for name, layer in zip(cache_names(cfg.layers), [*self.k_cache, *self.v_cache], strict=True):
                    buffers[name] = layer
                self._bind(self._prefill_ctx, buffers, n, 1)
                if not self._prefill_ctx.execute_async_v3(self._stream.cuda_stream):
                    raise RuntimeError("TensorRT execute_async_v3 failed")
                self.k_cache[:, :, start : start + n] = buffers["present_keys"]
                self.v_cache[:, :, start : start + n] = buffers["present_values"]
        self._stream.synchronize()
        self._p = P
        if self.sampling.greedy:
            return int(buffers["next_ids"].item())
        return int(select_tokens(buffers["logits"].cpu().numpy(), np.array([P - 1]), self.sampling)[0])

    def step(self, input_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        if self._p > self.max_seq_len:
            raise ValueError(f"KV cache full: {self._p} tokens cached, max_seq_len={self.max_seq_len}")
        import torch

        T, stride = self.step_tokens, self._stride
        h = self._h_in_np
        h[:T] = input_ids
        h[stride : stride + T] = positions
        h[2 * stride] = self._p
        with torch.cuda.stream(self._stream):
            self._graph.replay()
        self._stream.synchronize()
        if self.sampling.greedy:
            chosen = self._h_out.numpy().astype(np.int64)
        else:
            logits = self._buffers["logits"].cpu().numpy()
            chosen = select_tokens(logits, np.asarray(positions)[self.output_slots], self.sampling)
        result = self._result.copy()
        result[self.output_slots] = chosen
        return result

    def commit(self, slots: np.ndarray) -> None:
        import torch

        slots = check_commit(slots, self.step_tokens, self._p, self.max_seq_len)
        k = len(slots)
        if k == 0:
            return
        p = self._p
        with torch.cuda.stream(self._stream):
            index = torch.from_numpy(slots).to(self.engine.device)
            self.k_cache[:, :, p : p + k] = self._buffers["present_keys"].index_select(2, index)
            self.v_cache[:, :, p : p + k] = self._buffers["present_values"].index_select(2, index)
        self._p += k


def main(argv: list[str] | None = None) -> int:
    """`python -m trt_lookahead.executors.tensorrt ENGINE_DIR`: build engine.plan on a GPU host."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m trt_lookahead.executors.tensorrt ENGINE_DIR", file=sys.stderr)
        return 2
    reason = unavailable_reason()
    if reason is not None:
        print(f"error: cannot build a TensorRT plan here: {reason}", file=sys.stderr)
        return 2
    try:
        seconds = build_plan(argv[0])
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{Path(argv[0]) / PLAN_FILE} built in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
