"""Torch twins of lookahead.sampling: the seeded, position-keyed token choice inside a torch step.

The hash is the reference's own array-generic `noise_bits` (docs/design.md section 4.3); the top-k /
top-p filter is written again in torch ops, per row (each row may have its own parameters).
"""

from __future__ import annotations

import torch
from torch import Tensor

from trt_lookahead.lookahead.sampling import MASK32, TOP_CHUNK, VOCAB_SALT, SamplingParams, noise_bits


def vocab_salts(vocab_size: int, device: torch.device | str = "cpu") -> Tensor:
    """[vocab] int64 (v * VOCAB_SALT) & MASK32, the per-token term of the noise hash."""
    return (torch.arange(vocab_size, dtype=torch.int64, device=device) * VOCAB_SALT) & MASK32


def uniform_noise_torch(seed: Tensor | int, positions: Tensor, salts: Tensor) -> Tensor:
    """Twin of `sampling.uniform_noise`: [rows, vocab] float64 uniforms keyed by (seed, position, token)."""
    pos = positions.to(torch.int64)[:, None]
    seed_term = (seed & MASK32) if isinstance(seed, Tensor) else torch.tensor(seed & MASK32, device=pos.device)
    return (noise_bits(seed_term, pos, salts[None, :]).double() + 0.5) / float(1 << 24)


def select_rows_torch(
    logits: Tensor, positions: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, salts: Tensor
) -> Tensor:
    """Next token per row of logits [R, V] with that row's own parameters (each a [R] tensor).

    argmax where temperature is 0, else argmax(filter(logits) / temperature + gumbel(seed, position, v))
    with the filter of `sampling.filter_logits` (top-k keeps logits >= the k-th largest, then the top-p
    nucleus of what is left; top_k 0 and top_p 1 are off). Every reduction a row's result depends on
    runs along that row in a fixed order (sort, cumsum: a multi-threaded `sum` of one row would split it
    differently than of many), so a row's token never depends on the other rows in the call. No host
    synchronisation: it can be captured in a CUDA graph.
    """
    greedy = torch.argmax(logits, dim=-1)
    values = logits.double()
    vocab = values.shape[-1]
    ordered, order = torch.sort(values, dim=-1, descending=True, stable=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).to(torch.int64)
    kept = ordered >= ordered.gather(1, (k - 1)[:, None])  # top-k, ties at the k-th kept
    ordered = ordered.masked_fill(~kept, float("-inf"))
    probs = torch.exp(ordered - ordered[:, :1])
    probs = probs / probs.cumsum(-1)[:, -1:]
    ahead = probs.cumsum(-1) - probs  # probability mass strictly ahead of each token
    drop_sorted = ~kept | ((ahead >= top_p[:, None]) & (top_p[:, None] < 1.0))
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    scores = values.masked_fill(drop, float("-inf")) / torch.where(temperature > 0, temperature, 1.0)[:, None]
    noise = uniform_noise_torch(seed[:, None], positions, salts)
    sampled = torch.argmax(scores - torch.log(-torch.log(noise)), dim=-1)
    return torch.where(temperature > 0, sampled, greedy)


def select_tokens_torch(
    logits: Tensor, positions: Tensor, params: SamplingParams, salts: Tensor | None = None
) -> Tensor:
    """Twin of `sampling.select_tokens`: next token per row of logits [rows, vocab] at `positions` [rows]."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    if salts is None:
        salts = vocab_salts(logits.shape[-1], logits.device)

    def each(value: float, dtype: torch.dtype) -> Tensor:
        return torch.full((logits.shape[0],), value, dtype=dtype, device=logits.device)

    return select_rows_torch(
        logits, positions, each(params.temperature, torch.float64), each(params.top_k, torch.int64),
        each(params.top_p, torch.float64), each(params.seed & MASK32, torch.int64), salts,
    )


def _chunks(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(the whole chunks of logits [R, V]: [R, V // TOP_CHUNK, TOP_CHUNK], their maxima [R, V // TOP_CHUNK])."""
    R, V = logits.shape
    body = logits[:, : V - V % TOP_CHUNK].reshape(R, -1, TOP_CHUNK)
    return body, body.amax(-1)


def first_max_ids(logits: Tensor) -> Tensor:
    """[R] torch.argmax(logits [R, V], -1), the first id of each row's maximum: 4-6x faster on the CPU at V = 49152
    (the chunks' maxima, the first chunk holding the row's maximum, the first id of it there)."""
    R, V = logits.shape
    n = V // TOP_CHUNK
    if n == 0:
        return logits.argmax(-1)
    body, maxima = _chunks(logits)
    chunk = maxima.argmax(-1)  # [R] the first chunk holding the row's maximum
    ids = chunk * TOP_CHUNK + body[torch.arange(R, device=logits.device), chunk].argmax(-1)
    if n * TOP_CHUNK < V:  # the ids past the last whole chunk win only with a larger logit
        tail = logits[:, n * TOP_CHUNK :]
        later = tail.amax(-1) > logits.gather(1, ids[:, None])[:, 0]
        ids = torch.where(later, n * TOP_CHUNK + tail.argmax(-1), ids)
    return ids


def top_k_ids(logits: Tensor, k: int) -> Tensor:
    """[R, k] the ids of the k largest of each row of logits [R, V], largest first (ties in any order).

    torch.topk's set, 6-7x faster on the CPU at V = 49152: each of the k largest lies in one of the k chunks
    of TOP_CHUNK ids whose maxima are largest (a chunk left out has k distinct maxima at least as large).
    """
    R, V = logits.shape
    n = V // TOP_CHUNK
    if n <= k:
        return torch.topk(logits, k, dim=-1).indices
    chunks = _chunks(logits)[1].topk(k, dim=-1).indices  # [R, k]
    ids = (chunks[:, :, None] * TOP_CHUNK + torch.arange(TOP_CHUNK, device=logits.device)).view(R, k * TOP_CHUNK)
    if n * TOP_CHUNK < V:  # the ids past the last whole chunk are always candidates
        ids = torch.cat([ids, torch.arange(n * TOP_CHUNK, V, device=logits.device).expand(R, -1)], 1)
    return ids.gather(1, logits.gather(1, ids).topk(k, dim=-1).indices)
