"""LookaheadAttention: the op's contract and its torch reference.

One op per layer attends the T step tokens over the KV cache and over each other:

    out[i] = softmax(scale * q[i] . [K_cache[0:cache_len] ; K_step[visible(i)]]) @ [V_cache ; V_step]

inputs   query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, D]      (RoPE already applied)
         key_cache [Hkv, S, D], value_cache [Hkv, S, D]           (rows 0..cache_len-1 are valid)
         cache_len [1] int32                                       device tensor: the cached prefix p
         step_config [3] int32 = (W, N, G)                         device tensor; W = 0 means causal
output   [T, Hq, D]
attrs    num_q_heads, num_kv_heads, head_dim, scale

The step mask is never a tensor: it is the closed form `mask.step_visible` of (W, N, G), equal to
`StepLayout(LookaheadConfig(W, N, G), padded_tokens=T).mask` (slots past (W+G)(N-1) are pads that
see only themselves); W = 0 gives the causal prefill mask (j <= i) for any T. Because (W, N, G) and
p are read from device tensors, one compiled graph serves every step and every smaller config padded
to the engine's T. Query head h reads KV head h // (Hq // Hkv) (grouped-query attention).
See docs/design.md section 6.4.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from trt_lookahead.kernels.mask import CAUSAL, step_mask

OP_NAME = "LookaheadAttention"
OP_DOMAIN = "trt_lookahead"  # also the TensorRT plugin namespace
OP_VERSION = 1


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def as_config_tensor(step_config) -> torch.Tensor:
    return torch.tensor([int(v) for v in step_config], dtype=torch.int32)


def lookahead_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cache_len: torch.Tensor | int,
    step_config=CAUSAL,
    *,
    scale: float | None = None,
    mask: np.ndarray | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference semantics, computed in float32 (float64 for float64 inputs); returns query's dtype.

    `mask` overrides the closed-form step mask (tests pass StepLayout's to check the closed form).
    """
    T, Hq, D = query.shape
    Hkv = key.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {Hkv}")
    P = int(torch.as_tensor(cache_len).reshape(-1)[0])
    if mask is None:
        mask = step_mask(T, torch.as_tensor(step_config).reshape(-1).tolist())
    mask = torch.as_tensor(np.array(mask, bool))
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    scale = default_scale(D) if scale is None else scale

    keys = torch.cat([key_cache[:, :P].transpose(0, 1), key], 0).to(work)  # [P+T, Hkv, D]
    values = torch.cat([value_cache[:, :P].transpose(0, 1), value], 0).to(work)
    group = Hq // Hkv
    keys = keys.repeat_interleave(group, dim=1)  # [P+T, Hq, D]
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", query.to(work), keys) * scale  # [Hq, T, P+T]
    allowed = torch.cat([torch.ones(T, P, dtype=torch.bool), mask], 1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hts,shd->thd", probs, values).to(query.dtype)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (normwise, so near-zero entries do not dominate)."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
