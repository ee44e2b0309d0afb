"""TensorRT executor: an engine dir's engine.plan through the executor contract on a GPU (docs/design.md section 5).

`TensorRTEngine.make_executor(layout)` -> `TensorRTExecutor`: one execution context per profile sharing one
block of device memory (USER_MANAGED); every buffer is a torch CUDA tensor allocated once and bound by
address once; the step (host-to-device copy of ids/positions/cache_len from pinned memory,
execute_async_v3, argmax ids back) is captured once in a CUDA graph and replayed. cache_len and (W, N, G)
live in device tensors, so the replay is valid for every step. `commit` moves the accepted slots' K/V
(graph outputs) into the cache rows cache_len.. with torch ops on the same stream. The plan itself is
built by engine/tensorrt_plan.py. TensorRT is imported lazily, so everything else runs without it; it
cannot be installed on the project's CPU machines, so this path is written to the TensorRT 11 API as
documented and its tests skip where TensorRT or a GPU is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from trt_lookahead.backends.devices import import_tensorrt, tensorrt_unavailable_reason
from trt_lookahead.backends.graphs import EngineExecutor, OpenedEngine, choose_tokens, prefill_chunks
from trt_lookahead.engine.format import (
    PLAN_FILE,
    PREFILL_PROFILE,
    SINGLE_PROFILE,
    STEP_PROFILE,
    EngineConfig,
    cache_names,
    plan_command,
)
from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.executor import check_prompt, check_room
from trt_lookahead.lookahead.layout import StepLayout


def bind(ctx, shapes: Mapping[str, tuple[int, ...]], addresses: Mapping[str, int]) -> None:
    """Set input shapes and tensor addresses on an execution context, refusing what TensorRT refuses.

    TensorRT answers a wrong name or an out-of-profile shape with False (and a log line), not an
    exception; unchecked, the mistake would surface only as a failed execute_async_v3.
    """
    for name, shape in shapes.items():
        if not ctx.set_input_shape(name, shape):
            raise RuntimeError(f"TensorRT refused shape {shape} for input {name!r} (unknown name, or outside "
                               "the optimisation profile the context runs)")
    for name, address in addresses.items():
        if not ctx.set_tensor_address(name, address):
            raise RuntimeError(f"TensorRT refused the address of tensor {name!r} (unknown name, or not 256-byte "
                               "aligned)")
    unresolved = ctx.infer_shapes()
    if unresolved:
        raise RuntimeError(f"TensorRT could not infer the shapes of {unresolved}")


class TensorRTEngine(OpenedEngine):
    """engine.plan deserialized once; executors share its weights and device memory."""

    def __init__(self, config: EngineConfig, max_seq_len: int | None = None) -> None:
        reason = tensorrt_unavailable_reason()
        if reason is not None:
            raise UserError(f"the tensorrt backend cannot run here: {reason}; use --backend onnxruntime")
        plan = config.path / PLAN_FILE
        if not plan.is_file():
            raise UserError(
                f"engine {config.path} has no {PLAN_FILE}; build it on this GPU host with "
                f"`{plan_command(config.path)}`"
            )
        trt = import_tensorrt()
        import tensorrt.plugin as trtp
        import torch

        from trt_lookahead.kernels import tensorrt_plugin

        tensorrt_plugin.register(trt, trtp)
        super().__init__(config, max_seq_len)
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
        trt = import_tensorrt()
        ctx = self.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        ctx.set_device_memory(self._memory.data_ptr(), self.engine.device_memory_size_v2)
        ctx.set_optimization_profile_async(profile, self.stream.cuda_stream)
        return ctx

    def make_executor(self, layout: StepLayout) -> TensorRTExecutor:
        return TensorRTExecutor(self, layout)


class TensorRTExecutor(EngineExecutor):
    """Executor contract on a TensorRTEngine (static CUDA buffers, the step replayed as a CUDA graph)."""

    def __init__(self, engine: TensorRTEngine, layout: StepLayout) -> None:
        import torch

        super().__init__(engine, layout)
        cfg, run, T = engine.config, self.run, self.step_tokens
        self.engine: TensorRTEngine = engine
        dev, dtype = engine.device, getattr(torch, cfg.dtype)
        L, Hkv, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        K = len(self.output_slots)
        self._stream = engine.stream
        self.k_cache = torch.zeros(L, Hkv, cfg.cache_rows, D, dtype=dtype, device=dev)
        self.v_cache = torch.zeros_like(self.k_cache)
        # per-step values: one pinned staging row [ids | positions | cache_len] copied to the device inside the
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
            "step_config": torch.tensor(run.step_config, dtype=torch.int32, device=dev),
            "output_slots": torch.from_numpy(self.output_slots.astype(np.int32)).to(dev),
            "next_ids": torch.zeros(K, dtype=torch.int32, device=dev),
            "logits": torch.zeros(K, self.vocab_size, dtype=torch.float32, device=dev),
            "present_keys": torch.zeros(L, Hkv, T, D, dtype=dtype, device=dev),
            "present_values": torch.zeros(L, Hkv, T, D, dtype=dtype, device=dev),
        }
        for name, layer in zip(cache_names(L), [*self.k_cache, *self.v_cache], strict=True):
            self._buffers[name] = layer
        self._h_out = torch.zeros(K, dtype=torch.int32, pin_memory=True)
        self._ctx = engine.context(STEP_PROFILE if run.step_graph else SINGLE_PROFILE)
        self._bind(self._ctx, self._buffers, T, K)
        self._graph = self._capture()
        self._prefill_ctx: Any = None  # the prefill profile's context, made on first use

    @staticmethod
    def _bind(ctx, buffers: dict, tokens: int, rows: int) -> None:
        shapes = {"input_ids": (tokens,), "positions": (tokens,), "output_slots": (rows,)}
        bind(ctx, shapes, {name: tensor.data_ptr() for name, tensor in buffers.items()})

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

    def prefill(self, prompt_ids: np.ndarray) -> int:
        import torch

        ids = check_prompt(prompt_ids, self.max_seq_len, self.vocab_size)
        P = len(ids)
        if self._prefill_ctx is None:
            self._prefill_ctx = self.engine.context(PREFILL_PROFILE)
        ctx = self._prefill_ctx
        cfg, dev = self.engine.config, self.engine.device
        chunk = cfg.max_input_len
        buffers: dict = {}
        with torch.cuda.stream(self._stream):
            for start, inputs in prefill_chunks(ids, chunk):
                n = len(inputs["input_ids"])
                buffers = {name: torch.from_numpy(array).to(dev) for name, array in inputs.items()}
                buffers |= {
                    "next_ids": torch.zeros(1, dtype=torch.int32, device=dev),
                    "logits": torch.zeros(1, self.vocab_size, dtype=torch.float32, device=dev),
                    "present_keys": self.k_cache.new_zeros(*self.k_cache.shape[:2], n, self.k_cache.shape[3]),
                    "present_values": self.v_cache.new_zeros(*self.v_cache.shape[:2], n, self.v_cache.shape[3]),
                }
                for name, layer in zip(cache_names(cfg.num_layers), [*self.k_cache, *self.v_cache], strict=True):
                    buffers[name] = layer
                self._bind(ctx, buffers, n, 1)
                if not ctx.execute_async_v3(self._stream.cuda_stream):
                    raise RuntimeError("TensorRT execute_async_v3 failed")
                self.k_cache[:, :, start : start + n] = buffers["present_keys"]
                self.v_cache[:, :, start : start + n] = buffers["present_values"]
        self._stream.synchronize()
        self._cache_len = P
        chosen = choose_tokens(self.sampling, buffers["next_ids"].cpu().numpy(),
                               lambda: buffers["logits"].cpu().numpy(), np.array([P - 1]))
        return int(chosen[0])

    def step(self, input_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        check_room(self._cache_len, self.max_seq_len)
        import torch

        T, stride = self.step_tokens, self._stride
        h = self._h_in_np
        h[:T] = input_ids
        h[stride : stride + T] = positions
        h[2 * stride] = self._cache_len
        with torch.cuda.stream(self._stream):
            self._graph.replay()
        self._stream.synchronize()
        chosen = choose_tokens(self.sampling, self._h_out.numpy(), lambda: self._buffers["logits"].cpu().numpy(),
                               np.asarray(positions)[self.output_slots])
        return self._at_output_slots(chosen)

    def _keep(self, slots: np.ndarray, row: int) -> None:
        import torch

        end = row + len(slots)
        with torch.cuda.stream(self._stream):
            index = torch.from_numpy(slots).to(self.engine.device)
            self.k_cache[:, :, row:end] = self._buffers["present_keys"].index_select(2, index)
            self.v_cache[:, :, row:end] = self._buffers["present_values"].index_select(2, index)
