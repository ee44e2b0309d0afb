"""The padded step's attention and row-invariant kernels as `torch.library` custom ops, opaque to torch.compile.

A compiled step (backends/torch.py, `BatchedTorchExecutor(compile=True)`) lets inductor fuse the pointwise work
of the step body (RoPE, the KV writes, SiLU * mul, residual adds, the mask's closed form) and nothing else: the
attention (on the fast step SDPA, or kernels/padded_attention.py's kernel over each slot's own keys; on the exact
one that kernel's row-invariant mode), the exact step's projections and norms, and projections on quantized
weights on either step (the weight dequantized inside the product) are each one call that inductor neither looks
into nor splits, so no reduction of theirs is reordered and the exact step keeps its bits compiled
or eager. Each op has a fake (meta) implementation giving its output's shape, dtype and (contiguous) layout,
which is all inductor sees of it.

The ops run eagerly too (the padded step always calls them), so eager and compiled steps run the same kernels.
The schemas are written out: inferring them reads the annotations, which are strings under
`from __future__ import annotations` (so this module does without it).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

NAMESPACE = "trt_lookahead"


@torch.library.custom_op(f"{NAMESPACE}::padded_sdpa", mutates_args=(),
                         schema="(Tensor q, Tensor k_cache, Tensor v_cache, Tensor mask) -> Tensor")
def padded_sdpa(q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor) -> Tensor:
    """The fast padded step's attention: q [Bb*T, Hq, D], row b's T queries over slot b's S cache rows
    (k/v_cache [>= Bb*S, Hkv, D], slot b at rows b*S ..) under mask [Bb, T, S] -> [Bb*T, Hq, D] (contiguous)."""
    B, T, S = mask.shape
    qb = q.view(B, T, *q.shape[1:]).transpose(1, 2)  # [Bb, Hq, T, D]
    kb = k_cache[: B * S].view(B, S, *k_cache.shape[1:]).transpose(1, 2)  # [Bb, Hkv, S, D]
    vb = v_cache[: B * S].view(B, S, *v_cache.shape[1:]).transpose(1, 2)
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask[:, None], enable_gqa=True)
    return o.transpose(1, 2).reshape(q.shape).contiguous()


@padded_sdpa.register_fake
def _padded_sdpa_fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor) -> Tensor:
    return q.new_empty(q.shape)


@torch.library.custom_op(f"{NAMESPACE}::invariant_linear", mutates_args=(),
                         schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
def invariant_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """kernels/invariant.py `linear`: F.linear(x, weight, bias), row-invariant."""
    from trt_lookahead.kernels import invariant

    return invariant.linear(x, weight, bias)


@invariant_linear.register_fake
def _invariant_linear_fake(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op(f"{NAMESPACE}::quantized_linear", mutates_args=(),
                         schema="(Tensor x, Tensor codes, Tensor scales, Tensor zero_points, Tensor? mins, "
                                "int bits) -> Tensor")
def quantized_linear(x: Tensor, codes: Tensor, scales: Tensor, zero_points: Tensor, mins: Tensor | None,
                     bits: int) -> Tensor:
    """kernels/invariant.py `quantized_linear`: x times a weight held in blocks, dequantized in the product."""
    from trt_lookahead.kernels import invariant

    return invariant.quantized_linear(x, codes, scales, zero_points, mins, bits)


@quantized_linear.register_fake
def _quantized_linear_fake(x: Tensor, codes: Tensor, scales: Tensor, zero_points: Tensor, mins: Tensor | None,
                           bits: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], scales.shape[0]))


@torch.library.custom_op(f"{NAMESPACE}::words_linear", mutates_args=(),
                         schema="(Tensor x, Tensor codes, Tensor pairs, Tensor? mins) -> Tensor")
def words_linear(x: Tensor, codes: Tensor, pairs: Tensor, mins: Tensor | None) -> Tensor:
    """kernels/quantized_words.py `words_linear`: x times an int4 weight in the words layout, made in registers."""
    from trt_lookahead.kernels import quantized_words

    return quantized_words.words_linear(x, codes, pairs, mins)


@words_linear.register_fake
def _words_linear_fake(x: Tensor, codes: Tensor, pairs: Tensor, mins: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


@torch.library.custom_op(f"{NAMESPACE}::invariant_rms_norm", mutates_args=(),
                         schema="(Tensor x, Tensor weight, float eps) -> Tensor")
def invariant_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """kernels/invariant.py `rms_norm`: RMSNorm, one program per row."""
    from trt_lookahead.kernels import invariant

    return invariant.rms_norm(x, weight, eps)


@invariant_rms_norm.register_fake
def _invariant_rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op(f"{NAMESPACE}::invariant_padded_attention", mutates_args=(),
                         schema="(Tensor q, Tensor k_cache, Tensor v_cache, Tensor key_rows, Tensor cache_len) "
                                "-> Tensor")
def invariant_padded_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, key_rows: Tensor,
                               cache_len: Tensor) -> Tensor:
    """kernels/padded_attention.py `padded_attention`: the exact padded step's attention, row-invariant."""
    from trt_lookahead.kernels import padded_attention as kernel

    return kernel.padded_attention(q, k_cache, v_cache, key_rows, cache_len)


@invariant_padded_attention.register_fake
def _invariant_padded_attention_fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, key_rows: Tensor,
                                     cache_len: Tensor) -> Tensor:
    return q.new_empty(q.shape)


@torch.library.custom_op(f"{NAMESPACE}::padded_attention", mutates_args=(),
                         schema="(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_len, Tensor config, "
                                "Tensor tree_ends, int S) -> Tensor")
def padded_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_len: Tensor, config: Tensor,
                     tree_ends: Tensor, S: int) -> Tensor:
    """kernels/padded_attention.py `step_attention`: the fast padded step's attention over each slot's own keys,
    the step mask in registers: q [Bb*T, Hq, D], caches [>= Bb*S, Hkv, D] (row b's step keys already written at
    b*S + cache_len[b] + i), cache_len [Bb] and config [Bb, 3] int64, tree_ends int64 [2T] or empty (linear)."""
    from trt_lookahead.kernels import padded_attention as kernel

    return kernel.step_attention(q, k_cache, v_cache, cache_len, config, tree_ends, S)


@padded_attention.register_fake
def _padded_attention_fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_len: Tensor, config: Tensor,
                           tree_ends: Tensor, S: int) -> Tensor:
    return q.new_empty(q.shape)
