"""TensorRT registration of trt_lookahead::LookaheadAttention as a quickly deployable plugin (QDP).

`register(trt, trtp)` defines, with the `tensorrt.plugin` decorators (TensorRT >= 10.9 for AOT in
the ONNX parser; written against 11.x):

    @trtp.register   output = query.like()   [T, Hq, D], same dtype
    @trtp.autotune   FP32 | FP16 | BF16 for query/key/value/caches/output, INT32 for cache_len and
                     step_config, LINEAR formats
    @trtp.aot_impl   the Triton kernel of triton_kernel.py compiled to PTX (`compile_kernel`), launched
                     by TensorRT itself: grid (ceil(T / BLOCK_M), Hq), int32 extras (T, S) from
                     shape expressions, no Python at run time, so the plan runs under trtexec and
                     CUDA-graph capture
    @trtp.impl       the same kernel launched from Python (JIT), for debugging only

The ONNX parser maps a node to this plugin when its op_type is `LookaheadAttention` and it carries
plugin_namespace="trt_lookahead" (plus aot=1 to pick the AOT implementation); see onnx_op.py.
TensorRT is never imported here: backends/tensorrt.py and engine/tensorrt_plan.py import it lazily and pass
the modules in.
This module deliberately has no `from __future__ import annotations`: tensorrt.plugin reads the
annotations below as live objects.
"""

from typing import List, Tuple, Union  # noqa: UP035 (tensorrt.plugin compares typing annotations)

from trt_lookahead.kernels import triton_kernel
from trt_lookahead.kernels.reference import OP_DOMAIN, OP_NAME

PLUGIN_ID = f"{OP_DOMAIN}::{OP_NAME}"
_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
_registered: list[str] = []


def kernel_signature(dtype: str) -> dict:
    """Triton signature of the kernel's runtime arguments, in the AOT launch order of tensorrt.plugin:
    input pointers (op order), the int32 extras (T, S), then the output pointer."""
    ty = _TRITON_TYPES[dtype]
    sig = {name: f"*{ty}" for name in ("q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr")}
    sig.update({"cache_len_ptr": "*i32", "step_config_ptr": "*i32", "T": "i32", "S": "i32", "out_ptr": f"*{ty}"})
    return sig


def compile_kernel(dtype: str, num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float, target=None):
    """Triton -> PTX for one op instance (`target` None: the current GPU; a GPUTarget compiles without one)."""
    import triton

    consts = triton_kernel.constexprs(num_q_heads, num_kv_heads, head_dim, scale)
    signature = {**kernel_signature(dtype), **{name: "constexpr" for name in consts}}
    source = triton.compiler.ASTSource(fn=triton_kernel.lookahead_attention_kernel, signature=signature,
                                       constexprs=consts)
    kernel = triton.compile(source, target=target, options={"num_warps": triton_kernel.NUM_WARPS})
    scratch = getattr(kernel.metadata, "global_scratch_size", 0) or 0
    if scratch:
        raise RuntimeError(f"the kernel needs {scratch} bytes of Triton scratch memory, which AOT plugins cannot give")
    return kernel


def register(trt, trtp) -> None:
    """Register the plugin with TensorRT's QDP registry (once per process)."""
    if _registered:
        return
    dtype_names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}

    @trtp.register(PLUGIN_ID)
    def _desc(
        query: trtp.TensorDesc,
        key: trtp.TensorDesc,
        value: trtp.TensorDesc,
        key_cache: trtp.TensorDesc,
        value_cache: trtp.TensorDesc,
        cache_len: trtp.TensorDesc,
        step_config: trtp.TensorDesc,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
    ) -> trtp.TensorDesc:
        return query.like()

    @trtp.autotune(PLUGIN_ID)
    def _autotune(
        query: trtp.TensorDesc,
        key: trtp.TensorDesc,
        value: trtp.TensorDesc,
        key_cache: trtp.TensorDesc,
        value_cache: trtp.TensorDesc,
        cache_len: trtp.TensorDesc,
        step_config: trtp.TensorDesc,
        outputs: Tuple[trtp.TensorDesc],  # noqa: UP006
    ) -> List[trtp.AutoTuneCombination]:  # noqa: UP006
        f = "FP32|FP16|BF16"
        return [trtp.AutoTuneCombination(f"{f}, {f}, {f}, {f}, {f}, INT32, INT32, {f}", "LINEAR")]

    @trtp.aot_impl(PLUGIN_ID)
    def _aot_impl(
        query: trtp.TensorDesc,
        key: trtp.TensorDesc,
        value: trtp.TensorDesc,
        key_cache: trtp.TensorDesc,
        value_cache: trtp.TensorDesc,
        cache_len: trtp.TensorDesc,
        step_config: trtp.TensorDesc,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        outputs: Tuple[trtp.TensorDesc],  # noqa: UP006
        tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:  # noqa: UP006, UP007
        kernel = compile_kernel(dtype_names[query.dtype], num_q_heads, num_kv_heads, head_dim, scale)
        tokens = query.shape_expr[0]
        rows = key_cache.shape_expr[1]
        launch = trtp.KernelLaunchParams()
        launch.grid_x = trtp.cdiv(tokens, triton_kernel.BLOCK_M)
        launch.grid_y = num_q_heads
        launch.block_x = kernel.metadata.num_warps * 32
        launch.shared_mem = kernel.metadata.shared
        extra_args = trtp.SymIntExprs.from_tuple([trtp.SymInt32(tokens), trtp.SymInt32(rows)])
        return kernel.metadata.name.encode(), kernel.asm["ptx"].encode(), launch, extra_args

    @trtp.impl(PLUGIN_ID)
    def _impl(
        query: trtp.Tensor,
        key: trtp.Tensor,
        value: trtp.Tensor,
        key_cache: trtp.Tensor,
        value_cache: trtp.Tensor,
        cache_len: trtp.Tensor,
        step_config: trtp.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        outputs: Tuple[trtp.Tensor],  # noqa: UP006
        stream: int,
    ) -> None:
        import torch

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            args = [torch.as_tensor(t, device="cuda") for t in (query, key, value, key_cache, value_cache,
                                                                cache_len, step_config)]
            out = torch.as_tensor(outputs[0], device="cuda")
            triton_kernel.lookahead_attention(*args, scale=scale, out=out)

    _registered.append(PLUGIN_ID)
