"""LookaheadAttention as one fused Triton kernel (the plugin's implementation).

One program per (block of BLOCK_M step rows, query head, batch row b): an online-softmax pass over row
b's cached prefix [0, cache_len[b]), then over its T step tokens with the two-branch mask evaluated in
registers by the same `mask.step_visible` function as the reference, from row b's (W, N, G) =
step_config[b] (W = 0: causal). cache_len and step_config are loaded from device tensors, so one captured
graph replays for every step, every mix of rows and every config padded to T; a row's work depends only
on its own length and config, never on the other rows. Grouped-query heads read KV head h // (HQ // HKV).
With HAS_TREE the verification slots are a draft tree (docs/design.md 2.7): the mask is
`mask.tree_step_visible`, reading each node's preorder index and subtree end from the int32 table
tree_ends [>= 2T] (`mask.tree_ends(template.table, T)`, shared by every row); without it that pointer is never read (any
int32 pointer will do) and the kernel compiles to the linear one.

Launch contract (also the AOT plugin's): grid (ceil(T / BLOCK_M), Hq, B); pointer arguments in op-input
order (q, k, v, k_cache, v_cache, cache_len, step_config, tree_ends), then the int32 scalars T and S,
then the output pointer; everything else is constexpr. The kernel uses no scratch memory (the AOT route
cannot provide any). Runs on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import types
from typing import Any

import triton
import triton.language as tl

from trt_lookahead.kernels import mask, reference

BLOCK_M = 16
BLOCK_N = 32
NUM_WARPS = 4
LOG2E = 1.4426950408889634



def _helper(fn: Any) -> triton.JITFunction:  # Any: mypy's Callable has no __code__
    """mask.py's `fn` compiled as a Triton helper: the same code object, given this module's globals so that
    it finds the jitted helpers it calls (`step_visible` finds `visible`, `tree_node` finds `read`) beside it."""
    return triton.jit(types.FunctionType(fn.__code__, globals(), fn.__name__))


@triton.jit
def read(table, index):
    """mask.read from device memory: `table` points at the tree_ends table (the caller keeps index < T)."""
    return tl.load(table + index)


chain_end = _helper(mask.chain_end)
branch_visible = _helper(mask.branch_visible)
visible = _helper(mask.visible)
step_visible = _helper(mask.step_visible)
tree_node = _helper(mask.tree_node)
tree_step_visible = _helper(mask.tree_step_visible)


@triton.jit
def _attend_block(q, k, v, seen, m_i, l_i, acc, QK_SCALE: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """One online-softmax update of (m_i, l_i, acc) with a block of keys k and values v [BLOCK_N, BLOCK_D],
    `seen` (broadcast to [BLOCK_M, BLOCK_N]) saying which query row sees which key."""
    if UPCAST_DOT:
        k, v = k.to(tl.float32), v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * QK_SCALE
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def lookahead_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    cache_len_ptr,
    step_config_ptr,
    tree_ends_ptr,  # [>= 2T] int32 (preorder index, subtree end) per draft tree node; read only with HAS_TREE
    T,
    S,
    out_ptr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QK_SCALE: tl.constexpr,  # scale * log2(e): the softmax runs in base 2
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter only, see `interpreter_upcast`
    HAS_TREE: tl.constexpr,  # the verification slots are a draft tree (tree_ends); else G linear candidates
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)  # batch row; int64 so that row * HKV * S * D cannot overflow
    kv_head = head // (HQ // HKV)
    q_ptr += row * T * HQ * D  # [B, T, Hq, D]
    out_ptr += row * T * HQ * D
    k_ptr += row * T * HKV * D  # [B, T, Hkv, D]
    v_ptr += row * T * HKV * D
    kc_ptr += row * HKV * S * D  # [B, Hkv, S, D]
    vc_ptr += row * HKV * S * D
    cache_len_ptr += row  # [B]
    step_config_ptr += row * 3  # [B, 3]

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    d_ok = offs_d < D
    q = tl.load(
        q_ptr + offs_m[:, None] * (HQ * D) + head * D + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)
    cache_len = tl.load(cache_len_ptr).to(tl.int32)
    window = tl.load(step_config_ptr).to(tl.int32)
    ngram = tl.load(step_config_ptr + 1).to(tl.int32)
    verify = tl.load(step_config_ptr + 2).to(tl.int32)
    causal = window == 0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # The cached prefix: every row sees all of it.
    kc_base = kc_ptr + kv_head * S * D
    vc_base = vc_ptr + kv_head * S * D
    for start in range(0, cache_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < cache_len
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(kc_base + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(vc_base + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_block(q, k, v, col_ok[None, :], m_i, l_i, acc, QK_SCALE, UPCAST_DOT)

    # The step tokens, under the in-kernel mask.
    step_end = T
    if causal:  # a causal row block sees no later block: skip them
        step_end = tl.minimum(T, (pid_m + 1) * BLOCK_M)
    for start in range(0, step_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < T
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offs_n[:, None] * (HKV * D) + kv_head * D + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + offs_n[:, None] * (HKV * D) + kv_head * D + offs_d[None, :], mask=kv_mask, other=0.0)
        if HAS_TREE:
            # rows and keys past T (masked by row_ok, col_ok) are clamped so that the table, 2T long, is read in bounds
            keys, rows = tl.minimum(offs_n, T - 1), tl.minimum(offs_m, T - 1)
            seen = tree_step_visible(rows[:, None], keys[None, :], window, ngram, verify, tree_ends_ptr)
        else:
            seen = step_visible(offs_m[:, None], offs_n[None, :], window, ngram, verify)
        seen = seen & col_ok[None, :]
        m_i, l_i, acc = _attend_block(q, k, v, seen, m_i, l_i, acc, QK_SCALE, UPCAST_DOT)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + offs_m[:, None] * (HQ * D) + head * D + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def block_d(head_dim: int) -> int:
    """Head size padded to a power of two >= 16 (tl.dot's smallest K); pad lanes load zeros."""
    return max(16, triton.next_power_of_2(head_dim))


def constexprs(num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float, upcast_dot: bool = False,
               has_tree: bool = False) -> dict:
    """The kernel's constexpr arguments for one op instance (shared by launch() and the AOT plugin)."""
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads {num_q_heads} are not a multiple of KV heads {num_kv_heads}")
    return {
        "HQ": num_q_heads,
        "HKV": num_kv_heads,
        "D": head_dim,
        "BLOCK_D": block_d(head_dim),
        "QK_SCALE": float(scale) * LOG2E,
        "BLOCK_M": BLOCK_M,
        "BLOCK_N": BLOCK_N,
        "UPCAST_DOT": bool(upcast_dot),
        "HAS_TREE": bool(has_tree),
    }


def interpreted() -> bool:
    """Whether Triton kernels run in its interpreter (TRITON_INTERPRET=1: on the CPU, no PTX)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_upcast(dtype) -> bool:
    """Triton 3.9's interpreter multiplies bfloat16 tl.dot operands as their raw uint16 bits
    (runtime/interpreter.py create_dot), so under TRITON_INTERPRET=1 bfloat16 operands are upcast to
    float32 before each tl.dot. Compiled kernels (GPU, AOT) never take this branch."""
    import torch

    return interpreted() and dtype == torch.bfloat16


def grid(batch: int, tokens: int, num_q_heads: int) -> tuple[int, int, int]:
    return (triton.cdiv(tokens, BLOCK_M), num_q_heads, batch)


def lookahead_attention(query, key, value, key_cache, value_cache, cache_len, step_config, *, scale=None, out=None,
                        tree_ends=None):
    """Launch the kernel on torch tensors (CUDA tensors, or CPU ones under TRITON_INTERPRET=1).

    Same signature and semantics as reference.lookahead_attention; every tensor must be contiguous.
    `tree_ends`: int32 [>= 2T], the draft tree's table padded to the step (`mask.tree_ends(table, T)` of the
    reference's TreeTemplate.table); None: G linear candidates.
    """
    import torch

    B, T, Hq, D = query.shape
    Hkv = key.shape[2]
    S = key_cache.shape[2]
    tensors = {"query": query, "key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache,
               "cache_len": cache_len, "step_config": step_config, "tree_ends": tree_ends}
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if tree_ends is not None and (tree_ends.dtype != torch.int32 or tree_ends.dim() != 1 or len(tree_ends) < 2 * T):
        raise ValueError(f"tree_ends must be int32 [>= {2 * T}] (mask.tree_ends), got {tree_ends.dtype} "
                         f"{list(tree_ends.shape)}")
    if out is None:
        out = torch.empty_like(query)
    scale = reference.default_scale(D) if scale is None else scale
    lookahead_attention_kernel[grid(B, T, Hq)](
        query, key, value, key_cache, value_cache, cache_len, step_config,
        cache_len if tree_ends is None else tree_ends,  # a linear kernel never reads it: any int32 pointer
        T, S, out,
        **constexprs(Hq, Hkv, D, scale, upcast_dot=interpreter_upcast(query.dtype), has_tree=tree_ends is not None),
        num_warps=NUM_WARPS,
    )
    return out
