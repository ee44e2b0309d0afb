"""TensorRT registration of trt_lookahead::LookaheadAttention as a quickly deployable plugin (QDP).

`register(trt, trtp)` defines, with the `tensorrt.plugin` decorators (TensorRT >= 10.9 for AOT in
the ONNX parser; written against 11.x):

    @trtp.register   output = query.like()   [B, T, Hq, D], same dtype
    @trtp.autotune   FP32 | FP16 | BF16 for query/key/value/caches/output, INT32 for cache_len,
                     step_config and tree_ends, LINEAR formats
    @trtp.aot_impl   the Triton kernel of triton_kernel.py compiled to PTX (`compile_aot_kernel`), launched
                     by TensorRT itself with `launch_dims`: grid (ceil(T / BLOCK_M), Hq, B), int32 extras
                     (T, S) from shape expressions (query [B, T, Hq, D], key_cache [B, Hkv, S, D]);
                     per-row cache_len [B] and step_config [B, 3] are device tensors the kernel reads;
                     no Python at run time, so the plan runs under trtexec and CUDA-graph capture
    @trtp.impl       the same kernel launched from Python (JIT), for debugging only; every dtype,
                     bfloat16 too (`device_tensor`)

What the AOT route hands TensorRT, and why (docs/design.md section 6.7):
- PTX of ISA PTX_VERSION, not Triton's default, which follows the ptxas Triton bundles (Triton 3.9:
  PTX 9.4, newer than the CUDA 13.3 that TensorRT 11.1 is built with). 8.7 is what the ptxas of Triton
  3.5 (pinned by TensorRT's QDP sample) and 3.6 assembles for sm_90, loads on every CUDA 13 driver, and
  covers sm_90a, sm_100a and sm_120a.
- The entry has 13 parameters: TensorRT's 11 (8 inputs, T, S, the output) plus Triton's hidden
  global_scratch and profile_scratch pointers, which TensorRT does not know about. The kernel must never
  read them: a compile that needs either scratch is refused.
- At most AOT_SHARED_MEM_LIMIT bytes of dynamic shared memory: no source says TensorRT's launcher opts
  in to more, so BLOCK_N shrinks until the kernel fits (float32 with head_dim 128 needs 75,776 bytes at
  BLOCK_N 32, 42,048 at 16), or the build fails naming the need.
- The draft tree (docs/design.md 2.7): the 8th input, tree_ends, is an int32 table the kernel reads when the
  `tree` attribute is 1 (each node's preorder index and subtree end over the graph's most tokens, an
  initializer); with
  tree = 0 it is a 1-element dummy that is never read, and the kernel is compiled with HAS_TREE off, so a
  linear engine runs the linear kernel. One registration (fixed inputs) serves both.
scripts/gpu_check.py launches exactly this (cuModuleLoadData + cuLaunchKernel) on a GPU.

The ONNX parser maps a node to this plugin when its op_type is `LookaheadAttention` and it carries
plugin_namespace="trt_lookahead" (plus aot=1 to pick the AOT implementation); see onnx_op.py.
TensorRT is never imported here: backends/tensorrt.py and engine/tensorrt_plan.py import it lazily and pass
the modules in. Triton is imported only inside the AOT and JIT implementations, so registering the plugin
to run an AOT plan needs no Triton.
This module deliberately has no `from __future__ import annotations`: tensorrt.plugin reads the
annotations below as live objects.
"""

import types
from dataclasses import dataclass
from typing import List, Tuple, Union  # noqa: UP035 (tensorrt.plugin compares typing annotations)

from trt_lookahead.errors import UserError
from trt_lookahead.kernels.reference import OP_DOMAIN, OP_NAME

PLUGIN_ID = f"{OP_DOMAIN}::{OP_NAME}"
_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
PTX_VERSION = 87  # PTX ISA 8.7; see the module docstring
AOT_SHARED_MEM_LIMIT = 48 * 1024  # bytes of dynamic shared memory a launch gets without an opt-in
AOT_BLOCK_N = (32, 16)  # key block sizes tried in order; the first whose kernel fits the limit is used
# __cuda_array_interface__ typestr per dtype; it cannot name bfloat16, which travels as int16 and is viewed back
_CARRIERS = {"float32": "<f4", "float16": "<f2", "bfloat16": "<i2", "int32": "<i4"}
_registered: list[str] = []


@dataclass(frozen=True)
class AotKernel:
    """One compiled instance of the kernel, as the AOT implementation hands it to TensorRT."""

    name: str
    ptx: str
    threads: int
    shared_mem: int
    block_n: int


def kernel_signature(dtype: str) -> dict[str, str]:
    """Triton signature of the kernel's runtime arguments, in the AOT launch order of tensorrt.plugin:
    input pointers (op order), the int32 extras (T, S), then the output pointer."""
    ty = _TRITON_TYPES[dtype]
    sig = {name: f"*{ty}" for name in ("q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr")}
    sig.update({"cache_len_ptr": "*i32", "step_config_ptr": "*i32", "tree_ends_ptr": "*i32", "T": "i32", "S": "i32",
                "out_ptr": f"*{ty}"})
    return sig


def compile_kernel(dtype: str, num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                   block_n: int, tree: bool = False, target=None) -> AotKernel:
    """Triton -> PTX (ISA PTX_VERSION) for one op instance (`target` None: this GPU; a GPUTarget needs none);
    `tree`: the kernel reads tree_ends (HAS_TREE).

    Refuses a kernel that needs Triton scratch memory: TensorRT passes no pointer for it.
    """
    import triton

    from trt_lookahead.kernels import triton_kernel

    consts = {**triton_kernel.constexprs(num_q_heads, num_kv_heads, head_dim, scale, has_tree=tree),
              "BLOCK_N": block_n}
    signature = {**kernel_signature(dtype), **{name: "constexpr" for name in consts}}
    source = triton.compiler.ASTSource(fn=triton_kernel.lookahead_attention_kernel, signature=signature,
                                       constexprs=consts)
    compiled = triton.compile(source, target=target,
                              options={"num_warps": triton_kernel.NUM_WARPS, "ptx_version": PTX_VERSION})
    meta = compiled.metadata
    scratch = {kind: getattr(meta, f"{kind}_scratch_size", 0) or 0 for kind in ("global", "profile")}
    if any(scratch.values()):
        raise UserError(
            f"Triton {triton.__version__} compiles the LookaheadAttention kernel ({dtype}, head_dim {head_dim}) "
            f"with scratch memory ({scratch['global']} B global, {scratch['profile']} B profile), which a TensorRT "
            "AOT plugin never receives; build with Triton 3.5 or 3.6 (no scratch for this kernel)"
        )
    return AotKernel(meta.name, compiled.asm["ptx"], meta.num_warps * 32, meta.shared, block_n)


def compile_aot_kernel(dtype: str, num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                       tree: bool = False, target=None) -> AotKernel:
    """The kernel at the largest BLOCK_N of AOT_BLOCK_N whose shared memory fits AOT_SHARED_MEM_LIMIT."""
    needs = {}
    for block_n in AOT_BLOCK_N:
        kernel = compile_kernel(dtype, num_q_heads, num_kv_heads, head_dim, scale, block_n=block_n, tree=tree,
                                target=target)
        if kernel.shared_mem <= AOT_SHARED_MEM_LIMIT:
            return kernel
        needs[block_n] = kernel.shared_mem
    raise UserError(
        f"the LookaheadAttention kernel for {dtype} with head_dim {head_dim} needs "
        + ", ".join(f"{need} bytes at BLOCK_N {n}" for n, need in needs.items())
        + f" of shared memory, over the {AOT_SHARED_MEM_LIMIT} a TensorRT AOT plugin launch gets; "
        "build the engine in bfloat16 or float16, or with --attention native"
    )


def launch_dims(batch, tokens, rows, num_q_heads: int, cdiv) -> tuple[tuple, tuple]:
    """(grid xyz, int32 extras) of one launch, over ints or TensorRT shape expressions (`cdiv` of either)."""
    from trt_lookahead.kernels.triton_kernel import BLOCK_M

    return (cdiv(tokens, BLOCK_M), num_q_heads, batch), (tokens, rows)


def device_tensor(data_ptr: int, shape, strides, dtype: str):
    """A torch view (no copy) of CUDA memory TensorRT owns; `strides` in elements, as TensorRT gives them."""
    import torch

    typestr = _CARRIERS[dtype]
    itemsize = int(typestr[2:])
    holder = types.SimpleNamespace(__cuda_array_interface__={
        "shape": tuple(int(d) for d in shape), "typestr": typestr, "data": (int(data_ptr), False),
        "strides": tuple(int(s) * itemsize for s in strides), "version": 3,
    })
    return torch.as_tensor(holder, device="cuda").view(getattr(torch, dtype))


def register(trt, trtp) -> None:
    """Register the plugin with TensorRT's QDP registry (once per process)."""
    if _registered:
        return
    dtype_names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16", trt.int32: "int32"}

    @trtp.register(PLUGIN_ID)
    def _desc(
        query: trtp.TensorDesc,
        key: trtp.TensorDesc,
        value: trtp.TensorDesc,
        key_cache: trtp.TensorDesc,
        value_cache: trtp.TensorDesc,
        cache_len: trtp.TensorDesc,
        step_config: trtp.TensorDesc,
        tree_ends: trtp.TensorDesc,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        tree: int,
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
        tree_ends: trtp.TensorDesc,
        outputs: Tuple[trtp.TensorDesc],  # noqa: UP006
    ) -> List[trtp.AutoTuneCombination]:  # noqa: UP006
        f = "FP32|FP16|BF16"
        return [trtp.AutoTuneCombination(f"{f}, {f}, {f}, {f}, {f}, INT32, INT32, INT32, {f}", "LINEAR")]

    @trtp.aot_impl(PLUGIN_ID)
    def _aot_impl(
        query: trtp.TensorDesc,
        key: trtp.TensorDesc,
        value: trtp.TensorDesc,
        key_cache: trtp.TensorDesc,
        value_cache: trtp.TensorDesc,
        cache_len: trtp.TensorDesc,
        step_config: trtp.TensorDesc,
        tree_ends: trtp.TensorDesc,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        tree: int,
        outputs: Tuple[trtp.TensorDesc],  # noqa: UP006
        tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:  # noqa: UP006, UP007
        kernel = compile_aot_kernel(dtype_names[query.dtype], num_q_heads, num_kv_heads, head_dim, scale,
                                    tree=bool(tree))
        batch, tokens = query.shape_expr[0], query.shape_expr[1]  # query [B, T, Hq, D]
        rows = key_cache.shape_expr[2]  # key_cache [B, Hkv, S, D]
        grid, extras = launch_dims(batch, tokens, rows, num_q_heads, trtp.cdiv)
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y, launch.grid_z = grid
        launch.block_x = kernel.threads
        launch.shared_mem = kernel.shared_mem
        extra_args = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in extras])
        return kernel.name.encode(), kernel.ptx.encode(), launch, extra_args

    @trtp.impl(PLUGIN_ID)
    def _impl(
        query: trtp.Tensor,
        key: trtp.Tensor,
        value: trtp.Tensor,
        key_cache: trtp.Tensor,
        value_cache: trtp.Tensor,
        cache_len: trtp.Tensor,
        step_config: trtp.Tensor,
        tree_ends: trtp.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        tree: int,
        outputs: Tuple[trtp.Tensor],  # noqa: UP006
        stream: int,
    ) -> None:
        import torch

        from trt_lookahead.kernels import triton_kernel

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            query_t, key_t, value_t, key_cache_t, value_cache_t, cache_len_t, step_config_t, tree_ends_t, out = (
                device_tensor(t.data_ptr, t.shape, t.strides, dtype_names[t.dtype])
                for t in (query, key, value, key_cache, value_cache, cache_len, step_config, tree_ends, outputs[0])
            )
            triton_kernel.lookahead_attention(query_t, key_t, value_t, key_cache_t, value_cache_t, cache_len_t,
                                              step_config_t, scale=scale, out=out,
                                              tree_ends=tree_ends_t if tree else None)

    _registered.append(PLUGIN_ID)
