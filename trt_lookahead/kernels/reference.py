"""LookaheadAttention: the op's contract and its torch reference.

One op per layer attends each batch row's T step tokens over that row's KV cache and over each other:

    out[b, i] = softmax(scale * q[b, i] . [K_cache[b, 0:cache_len[b]] ; K_step[b, visible_b(i)]])
                @ [V_cache[b] ; V_step[b]]

inputs   query [B, T, Hq, D], key [B, T, Hkv, D], value [B, T, Hkv, D]   (RoPE already applied)
         key_cache [B, Hkv, S, D], value_cache [B, Hkv, S, D]           (row b: rows 0..cache_len[b]-1 valid)
         cache_len [B] int32                                             device tensor: each row's cached prefix
         step_config [B, 3] int32 = (W, N, G) per row                    device tensor; W = 0 means causal
output   [B, T, Hq, D]
attrs    num_q_heads, num_kv_heads, head_dim, scale

Rows never see each other: row b is exactly the single-sequence op on its own cache, so a row's result
does not depend on what shares its batch. The step mask is never a tensor: it is the closed form
`mask.step_visible` of the row's (W, N, G), equal to `StepLayout(LookaheadConfig(W, N, G),
padded_tokens=T).mask` (slots past (W+G)(N-1) are pads that see only themselves); W = 0 gives the causal
prefill mask (j <= i) for any T. Because (W, N, G) and cache_len are read from device tensors, one
compiled graph serves every step, every mix of rows and every smaller config padded to the engine's T.
Query head h reads KV head h // (Hq // Hkv) (grouped-query attention). See docs/design.md section 6.4.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from trt_lookahead.kernels.mask import step_mask

OP_NAME = "LookaheadAttention"
OP_DOMAIN = "trt_lookahead"  # also the TensorRT plugin namespace
OP_VERSION = 1


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def as_config_tensor(step_configs) -> torch.Tensor:
    """[B, 3] int32 device-tensor form of per-row (W, N, G) configs."""
    return torch.tensor(np.asarray(step_configs, np.int64).reshape(-1, 3), dtype=torch.int32)


def lookahead_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cache_len: torch.Tensor,
    step_config: torch.Tensor | np.ndarray,
    *,
    scale: float | None = None,
    masks: np.ndarray | None = None,
    tree_ends: np.ndarray | None = None,
) -> torch.Tensor:
    """Reference semantics, row by row, computed in float32 (float64 for float64 inputs); query's dtype.

    `masks` [B, T, T] overrides the closed-form step masks (tests pass StepLayout's to check the closed form).
    `tree_ends`: the verification slots form this tree template (TreeTemplate.ends) instead of G chains.
    """
    B, T, Hq, D = query.shape
    if Hq % key.shape[2]:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {key.shape[2]}")
    lengths = torch.as_tensor(cache_len).reshape(B).tolist()
    configs = np.asarray(step_config, np.int64).reshape(B, 3)
    rows = []
    for b in range(B):
        row_mask = step_mask(T, configs[b], tree_ends) if masks is None else np.asarray(masks[b], bool)
        rows.append(_row_attention(query[b], key[b], value[b], key_cache[b], value_cache[b], int(lengths[b]),
                                   torch.from_numpy(row_mask), default_scale(D) if scale is None else scale))
    return torch.stack(rows)


def _row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, cache_len: int, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One row: query [T, Hq, D] over cache rows 0..cache_len-1 ([Hkv, S, D]) and the step rows `mask` allows."""
    T, Hq, _ = query.shape
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    keys = torch.cat([key_cache[:, :cache_len].transpose(0, 1), key], 0).to(work)  # [P+T, Hkv, D]
    values = torch.cat([value_cache[:, :cache_len].transpose(0, 1), value], 0).to(work)
    group = Hq // key.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # [P+T, Hq, D]
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", query.to(work), keys) * scale  # [Hq, T, P+T]
    allowed = torch.cat([torch.ones(T, cache_len, dtype=torch.bool), mask], 1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hts,shd->thd", probs, values).to(query.dtype)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (normwise, so near-zero entries do not dominate)."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
