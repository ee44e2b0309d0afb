"""TensorRT executor: an engine dir's engine.plan through the batched executor contract on a GPU (docs/design.md
sections 5 and 6.7).

`TensorRTEngine.executor(max_batch)` -> `TensorRTExecutor`: the KV caches are torch CUDA tensors
[max_batch, Hkv, S, D] per layer, allocated once. A step of B rows x T tokens runs at its bucket (Bb, Tb):
B padded up to the next of 1, 2, 4, .., max_batch with inert rows (causal, cache_len 0, token 0), T padded
to the built T (or 1 when every row is one token) with pad tokens at the row's cache_len, which no real
token sees. Each bucket has its own execution context on its own optimisation profile (engine/format.py's
`plan_profiles`), all sharing one block of activation memory (USER_MANAGED), and its step captured once in
a CUDA graph: the host-to-device copy of the pinned staging inputs (ids, positions, cache_len, step_config,
output_slots), execute_async_v3, the argmax ids back. Every per-step value lives in device memory, so a
replay is valid for every step and every mix of rows; the caches are bound at the first physical slots,
which backends/graphs.py's SlotExecutor keeps compact. Prefill chunks run eagerly on profile 0, bound to
the slot's own cache. `commit` moves a row's accepted K/V (graph outputs) into the slot's cache rows with
torch ops on the same stream. Token choice (greedy ids, or the seeded draw from the float32 logits) is on
the host, per slot.

TensorRT is imported lazily, so everything else runs without it; it cannot be installed on the project's
CPU machines, so this path is written to the TensorRT 11 API as documented and its tests skip where
TensorRT or a GPU is missing. The plan itself is built by engine/tensorrt_plan.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from trt_lookahead.backends.devices import import_tensorrt, tensorrt_unavailable_reason
from trt_lookahead.backends.graphs import Logits, OpenedEngine, SlotExecutor
from trt_lookahead.engine.format import (
    INPUTS,
    OUTPUTS,
    PLAN_FILE,
    EngineConfig,
    batch_buckets,
    cache_names,
    plan_command,
    step_buckets,
)
from trt_lookahead.errors import UserError

PREFILL_PROFILE = 0  # then profile 1 + k for step bucket k (engine/format.py's plan_profiles)
_ALIGN = 64  # int32 elements: each staged input starts on a 256-byte boundary, as TensorRT wants


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

    def __init__(self, config: EngineConfig, max_seq_len: int | None = None, max_batch: int | None = None) -> None:
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
        super().__init__(config, max_seq_len, max_batch)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(plan.read_bytes())
        if self.engine is None:
            raise UserError(f"TensorRT could not deserialize {plan}; rebuild it with this TensorRT version")
        self.device = torch.device("cuda")
        self.stream = torch.cuda.Stream(self.device)
        # one block of activation memory for every context (they never run at the same time)
        self._memory = torch.empty(self.engine.device_memory_size_v2, dtype=torch.uint8, device=self.device)

    def context(self, profile: int) -> Any:
        """A new execution context on `profile`, using the shared activation memory."""
        trt = import_tensorrt()
        ctx = self.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        ctx.set_device_memory(self._memory.data_ptr(), self.engine.device_memory_size_v2)
        ctx.set_optimization_profile_async(profile, self.stream.cuda_stream)
        return ctx

    def executor(self, max_batch: int | None = None) -> TensorRTExecutor:
        """A batched executor with its own KV cache for `max_batch` slots (default: the engine's)."""
        return TensorRTExecutor(self, max_batch)


class TensorRTExecutor(SlotExecutor):
    """The batched executor contract on a TensorRTEngine; see the module docstring."""

    def __init__(self, engine: TensorRTEngine, max_batch: int | None = None) -> None:
        import torch

        super().__init__(engine, max_batch)
        cfg, B, T = engine.config, self.max_batch, self.step_tokens
        self.engine = engine
        dev, dtype = engine.device, getattr(torch, cfg.dtype)
        L, Hkv, D, V = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
        self._stream = engine.stream
        self.k_cache = torch.zeros(L, B, Hkv, cfg.cache_rows, D, dtype=dtype, device=dev)  # per layer [B, Hkv, S, D]
        self.v_cache = torch.zeros_like(self.k_cache)
        # the staged inputs: one pinned host blob copied to its device twin inside each captured graph
        sizes = {"input_ids": B * T, "positions": B * T, "cache_len": B, "step_config": B * 3, "output_slots": B * T}
        self._offsets, total = {}, 0
        for name in INPUTS:
            self._offsets[name] = total
            total += -(-sizes[name] // _ALIGN) * _ALIGN
        self._h_in = torch.zeros(total, dtype=torch.int32, pin_memory=True)
        self._d_in = torch.zeros(total, dtype=torch.int32, device=dev)
        self._out = {"next_ids": torch.zeros(B * T, dtype=torch.int32, device=dev),
                     "logits": torch.zeros(B * T * V, dtype=torch.float32, device=dev),
                     **{name: torch.zeros(L * B * Hkv * T * D, dtype=dtype, device=dev) for name in OUTPUTS[2:]}}
        self._h_out = torch.zeros(B * T, dtype=torch.int32, pin_memory=True)
        prefill = cfg.max_input_len
        self._prefill_out = {"next_ids": torch.zeros(1, 1, dtype=torch.int32, device=dev),
                             "logits": torch.zeros(1, 1, V, dtype=torch.float32, device=dev),
                             **{name: torch.zeros(L * Hkv * prefill * D, dtype=dtype, device=dev)
                                for name in OUTPUTS[2:]}}
        self._buckets = {bucket: 1 + k for k, bucket in enumerate(step_buckets(cfg))}  # -> profile index
        self._graphs: dict[tuple[int, int], tuple[Any, Any]] = {}  # bucket -> (context, CUDA graph)
        self._prefill_ctx: Any = None
        self._staged: dict[str, np.ndarray] = {}
        self._presents: tuple[Any, Any] = (None, None)

    def _bucket(self, B: int, T: int) -> tuple[int, int]:
        batch = next(b for b in batch_buckets(self.config.max_batch) if b >= B)
        return batch, (1 if T == 1 else self.step_tokens)

    def _views(self, Bb: int, Tb: int, blob: Any) -> dict[str, Any]:
        """The staged inputs of bucket (Bb, Tb) as views of `blob` (host numpy or device tensor)."""
        shapes = {"input_ids": (Bb, Tb), "positions": (Bb, Tb), "cache_len": (Bb,), "step_config": (Bb, 3),
                  "output_slots": (Bb, Tb)}
        return {name: blob[self._offsets[name] : self._offsets[name] + int(np.prod(shape))].reshape(shape)
                for name, shape in shapes.items()}

    def _outputs(self, buffers: dict[str, Any], B: int, T: int) -> dict[str, Any]:
        L, Hkv, D = self.config.num_layers, self.config.num_kv_heads, self.config.head_dim
        shapes = {"next_ids": (B, T), "logits": (B, T, self.vocab_size), "present_keys": (L, B, Hkv, T, D),
                  "present_values": (L, B, Hkv, T, D)}
        return {name: buffers[name][: int(np.prod(shape))].view(shape) for name, shape in shapes.items()}

    def _bind(self, ctx: Any, inputs: dict[str, Any], caches: list[Any], outputs: dict[str, Any]) -> None:
        """Shapes and addresses of every graph input (the caches too) and addresses of every output (checked)."""
        named_inputs = [*inputs.items(), *zip(cache_names(self.config.num_layers), caches, strict=True)]
        shapes = {name: tuple(tensor.shape) for name, tensor in named_inputs}
        addresses = {name: tensor.data_ptr() for name, tensor in [*named_inputs, *outputs.items()]}
        bind(ctx, shapes, addresses)

    def _graph(self, Bb: int, Tb: int) -> Any:
        """The bucket's context and CUDA graph: bound once, warmed up (TensorRT's deferred shape work must not
        be captured), then one step captured."""
        import torch

        if (Bb, Tb) not in self._graphs:
            ctx = self.engine.context(self._buckets[(Bb, Tb)])
            caches = [layer[:Bb] for layer in (*self.k_cache, *self.v_cache)]
            self._bind(ctx, self._views(Bb, Tb, self._d_in), caches, self._outputs(self._out, Bb, Tb))

            def launch() -> None:
                self._d_in.copy_(self._h_in, non_blocking=True)
                if not ctx.execute_async_v3(self._stream.cuda_stream):
                    raise RuntimeError("TensorRT execute_async_v3 failed")
                self._h_out[: Bb * Tb].copy_(self._out["next_ids"][: Bb * Tb], non_blocking=True)

            with torch.cuda.stream(self._stream):
                launch()
            self._stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self._stream):
                launch()
            self._graphs[(Bb, Tb)] = (ctx, graph)
        return self._graphs[(Bb, Tb)][1]

    def _inputs(self, B: int, T: int, K: int) -> dict[str, np.ndarray]:
        self._staged = {"input_ids": np.zeros((B, T), np.int32), "positions": np.zeros((B, T), np.int32),
                        "cache_len": np.zeros(B, np.int32), "step_config": np.zeros((B, 3), np.int32),
                        "output_slots": np.zeros((B, K), np.int32)}
        return self._staged

    def _run(self, B: int, T: int, K: int) -> tuple[np.ndarray, Logits]:
        import torch

        Bb, Tb = self._bucket(B, T)
        staged, host = self._staged, self._views(Bb, Tb, self._h_in.numpy())
        for array in host.values():
            array[...] = 0  # inert rows and pads: causal, cache_len 0, token 0
        host["input_ids"][:B, :T] = staged["input_ids"]
        host["positions"][:B] = staged["cache_len"][:, None]  # pads sit at the row's cache_len
        host["positions"][:B, :T] = staged["positions"]
        host["cache_len"][:B] = staged["cache_len"]
        host["step_config"][:B] = staged["step_config"]
        host["output_slots"][:B] = staged["output_slots"][:, -1:]  # repeat the last output slot
        host["output_slots"][:B, :K] = staged["output_slots"]
        graph = self._graph(Bb, Tb)
        with torch.cuda.stream(self._stream):
            graph.replay()
        self._stream.synchronize()
        out = self._outputs(self._out, Bb, Tb)
        self._presents = (out["present_keys"], out["present_values"])
        next_ids = self._h_out[: Bb * Tb].numpy().reshape(Bb, Tb)[:B, :K]
        return next_ids, lambda: out["logits"][:B, :K].cpu().numpy()

    def _prefill_chunk(self, physical: int, start: int, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, Logits]:
        import torch

        if self._prefill_ctx is None:
            self._prefill_ctx = self.engine.context(PREFILL_PROFILE)
        n = inputs["input_ids"].shape[1]
        dev = self.engine.device
        with torch.cuda.stream(self._stream):
            tensors = {name: torch.from_numpy(array).to(dev) for name, array in inputs.items()}
            out = self._outputs(self._prefill_out, 1, n) | {name: self._prefill_out[name] for name in OUTPUTS[:2]}
            caches = [layer[physical : physical + 1] for layer in (*self.k_cache, *self.v_cache)]
            self._bind(self._prefill_ctx, tensors, caches, out)
            if not self._prefill_ctx.execute_async_v3(self._stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed")
            self.k_cache[:, physical, :, start : start + n] = out["present_keys"][:, 0]
            self.v_cache[:, physical, :, start : start + n] = out["present_values"][:, 0]
        self._stream.synchronize()
        return out["next_ids"].cpu().numpy(), lambda: out["logits"].cpu().numpy()

    def _keep(self, physical: int, row: int, rows: np.ndarray, start: int) -> None:
        import torch

        end = start + len(rows)
        keys, values = self._presents
        with torch.cuda.stream(self._stream):
            index = torch.from_numpy(rows).to(self.engine.device)
            self.k_cache[:, physical, :, start:end] = keys[:, row].index_select(2, index)
            self.v_cache[:, physical, :, start:end] = values[:, row].index_select(2, index)

    def _move(self, src: int, dst: int, length: int) -> None:
        import torch

        with torch.cuda.stream(self._stream):
            for cache in (self.k_cache, self.v_cache):
                cache[:, dst, :, :length] = cache[:, src, :, :length]

    def _swap(self, a: int, b: int, length: int) -> None:
        import torch

        with torch.cuda.stream(self._stream):
            for cache in (self.k_cache, self.v_cache):
                held = cache[:, a, :, :length].clone()
                cache[:, a, :, :length] = cache[:, b, :, :length]
                cache[:, b, :, :length] = held
