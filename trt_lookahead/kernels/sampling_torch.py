"""Torch twins of lookahead.sampling: the seeded, position-keyed token choice inside a torch step.

Bit-identical to the numpy reference (docs/design.md section 4.3): the hash is the reference's own
array-generic `noise_bits`; only the top-k / top-p filter is written again in torch ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trt_lookahead.lookahead.sampling import MASK32, VOCAB_SALT, SamplingParams, noise_bits


def vocab_salts(vocab_size: int, device: torch.device | str = "cpu") -> Tensor:
    """[vocab] int64 (v * VOCAB_SALT) & MASK32, the per-token term of the noise hash."""
    return (torch.arange(vocab_size, dtype=torch.int64, device=device) * VOCAB_SALT) & MASK32


def uniform_noise_torch(seed: Tensor | int, positions: Tensor, salts: Tensor) -> Tensor:
    """Twin of `sampling.uniform_noise`: [rows, vocab] float64 uniforms keyed by (seed, position, token)."""
    pos = positions.to(torch.int64)[:, None]
    seed_term = (seed & MASK32) if isinstance(seed, Tensor) else torch.tensor(seed & MASK32, device=pos.device)
    return (noise_bits(seed_term, pos, salts[None, :]).double() + 0.5) / float(1 << 24)


def filter_logits_torch(logits: Tensor, top_k: int, top_p: Tensor | float | None) -> Tensor:
    """Twin of `sampling.filter_logits` in float64; top_p None skips the nucleus step (top_p == 1)."""
    logits = logits.double()
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = torch.exp(sorted_logits - sorted_logits[:, :1])
        probs = probs / probs.sum(-1, keepdim=True)
        before = torch.cumsum(probs, -1) - probs
        drop = torch.zeros_like(before, dtype=torch.bool).scatter_(-1, order, before >= top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens_torch(
    logits: Tensor, positions: Tensor, top_k: int, top_p: Tensor | float | None, temperature: Tensor | float,
    seed: Tensor | int, salts: Tensor,
) -> Tensor:
    """argmax(filter(logits) / temperature + gumbel(seed, position, v)) per row: the seeded draw."""
    scores = filter_logits_torch(logits, top_k, top_p) / temperature
    noise = uniform_noise_torch(seed, positions, salts)
    return torch.argmax(scores - torch.log(-torch.log(noise)), dim=-1)


def select_tokens_torch(
    logits: Tensor, positions: Tensor, params: SamplingParams, salts: Tensor | None = None
) -> Tensor:
    """Twin of `sampling.select_tokens`: next token per row of logits [rows, vocab] at `positions` [rows]."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    if salts is None:
        salts = vocab_salts(logits.shape[-1], logits.device)
    top_p = params.top_p if params.top_p < 1.0 else None
    return sample_tokens_torch(logits, positions, params.top_k, top_p, params.temperature, params.seed, salts)
