"""Seeded, position-keyed sampling: the draw for a slot is a pure function of (seed, position, logits).

token = argmax(filter(logits) / temperature + gumbel(seed, position, v)), where `filter` keeps the
top-k logits and then the smallest top-p nucleus. Because the noise depends only on the seed and the
absolute position of the slot, lookahead sampling is token-identical to plain sampling with the same
seed, and each draw is exactly a sample from the filtered distribution (the Gumbel-max trick).

The hash is 32-bit integer arithmetic done in int64 (every product stays below 2**63), so numpy,
torch and ONNX graphs compute the same noise. This module is the numpy reference; `mix32` and
`noise_bits` are array-generic, and the torch twin (kernels/sampling_torch.py) calls them on tensors; numpy
runs them on uint32 arrays, whose products wrap at 2**32: the same bits at half the memory traffic. A draw
computes the noise only for the tokens that can still win: no noise exceeds GUMBEL_MAX, so a token whose score
trails the best-scoring token's score plus that token's noise by more than GUMBEL_MAX cannot win
(`select_tokens`; at temperature 0.7 on SmolLM2 that leaves a few percent of the vocabulary).
See docs/design.md section 4.

Valid parameters (SamplingParams checks them once for the API, the CLI and the server): a finite
temperature >= 0, an integer top_k >= 0, top_p in (0, 1], an integer seed in [0, 2**64). A temperature
below MIN_TEMPERATURE samples greedily: the 24-bit uniforms bound the Gumbel noise to a span of about 20,
so below 1e-5 only logits closer than 2e-4 could still change the draw, and logits / t overflows float64
as t -> 0 (vLLM draws the same line).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from trt_lookahead.errors import UserError, as_float, as_int

MASK32 = 0xFFFFFFFF
HASH_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39)
POSITION_SALT = 0x5BD1E995
VOCAB_SALT = 0x1B873593
MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy (see the module docstring)
SEED_LIMIT = 1 << 64  # seeds are unsigned 64-bit (Triton's random_seed is UINT64)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below MIN_TEMPERATURE) means greedy; top_k 0 and top_p 1.0 mean no filtering.

    Checked and normalised to Python int/float on construction (UserError naming the parameter).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        temperature, top_p = as_float("temperature", self.temperature), as_float("top_p", self.top_p)
        top_k, seed = as_int("top_k", self.top_k), as_int("seed", self.seed)
        if temperature < 0:
            raise UserError(f"temperature must be >= 0 (0 is greedy), got {temperature}", field="temperature")
        if top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 disables it), got {top_k}", field="top_k")
        if not 0.0 < top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1] (1 disables it), got {top_p}", field="top_p")
        if not 0 <= seed < SEED_LIMIT:
            raise UserError(f"seed must be in [0, 2**64), got {seed}", field="seed")
        for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed)):
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def mix32(x: Any) -> Any:
    """An integer hash of values in [0, 2**32), in int64 arithmetic without overflow (numpy or torch)."""
    for multiplier in HASH_MULTIPLIERS:
        x = ((x ^ (x >> 16)) * multiplier) & MASK32
    return x ^ (x >> 16)


def position_terms(seed_term: Any, positions: Any) -> Any:
    """The hash of (seed, position), per position: the first half of `noise_bits`."""
    return mix32(seed_term ^ ((positions * POSITION_SALT) & MASK32))


def token_bits(position_term: Any, vocab_terms: Any) -> Any:
    """24 hash bits per token from its position's term: the second half of `noise_bits`."""
    return mix32(position_term ^ vocab_terms) >> 8


def noise_bits(seed_term: Any, positions: Any, vocab_terms: Any) -> Any:
    """24 hash bits per (position, token); positions [rows, 1], vocab_terms [1, vocab] = v * VOCAB_SALT & MASK32."""
    return token_bits(position_terms(seed_term, positions), vocab_terms)


def _uniforms(bits: np.ndarray) -> np.ndarray:
    """The uniforms in (0, 1) of 24 hash bits."""
    return (bits.astype(np.float64) + 0.5) / float(1 << 24)


def _gumbel(uniforms: np.ndarray) -> np.ndarray:
    return -np.log(-np.log(uniforms))


# the largest noise, that of the largest of the 2**24 uniforms, and 1.0 more for the float64 rounding of score + noise
GUMBEL_MAX = float(_gumbel(_uniforms(np.array([(1 << 24) - 1])))[0]) + 1.0


@functools.lru_cache(maxsize=4)
def vocab_terms(vocab_size: int) -> np.ndarray:
    """noise_bits' per-token terms [vocab_size] (v * VOCAB_SALT & MASK32) as uint32, computed once per size."""
    terms = ((np.arange(vocab_size, dtype=np.int64) * VOCAB_SALT) & MASK32).astype(np.uint32)
    terms.flags.writeable = False
    return terms


def uniform_noise(seed: int, positions: np.ndarray, vocab_size: int) -> np.ndarray:
    """[len(positions), vocab] uniforms in (0, 1), keyed by (seed, position, token id)."""
    pos = np.asarray(positions, np.int64).astype(np.uint32)[:, None]  # uint32: products wrap as & MASK32 does
    return _uniforms(noise_bits(np.uint32(seed & MASK32), pos, vocab_terms(vocab_size)[None, :]))


def gumbel_noise(seed: int, positions: np.ndarray, vocab_size: int) -> np.ndarray:
    return _gumbel(uniform_noise(seed, positions, vocab_size))


def filter_logits(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (rows independent)."""
    logits = np.array(logits, np.float64)
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = np.partition(logits, vocab - top_k, axis=-1)[:, vocab - top_k][:, None]
        logits[logits < kth] = -np.inf
    if top_p < 1.0:
        order = np.argsort(-logits, axis=-1, kind="stable")
        sorted_logits = np.take_along_axis(logits, order, -1)
        probs = np.exp(sorted_logits - sorted_logits[:, :1])
        probs /= probs.sum(-1, keepdims=True)
        before = np.cumsum(probs, -1) - probs  # mass strictly ahead of each token
        drop_sorted = before >= top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, -1)
        logits[drop] = -np.inf
    return logits


def select_tokens(logits: np.ndarray, positions: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The next token for each row of `logits` [rows, vocab], row i at absolute position positions[i]."""
    if params.greedy:
        return np.argmax(logits, axis=-1)
    scores = filter_logits(logits, params.top_k, params.top_p) / params.temperature  # [rows, vocab] float64
    seed, terms = np.uint32(params.seed & MASK32), vocab_terms(scores.shape[-1])
    chosen = np.empty(len(scores), np.int64)
    for i, (row, position) in enumerate(zip(scores, np.asarray(positions, np.int64).tolist(), strict=True)):
        term = position_terms(seed, np.uint32(position & MASK32))
        best = int(np.argmax(row))
        bound = row[best] + _gumbel(_uniforms(token_bits(term, terms[best])))
        # only these can win (module docstring); kept in id order, so the first of equal maxima still wins
        candidates = np.flatnonzero(row >= bound - GUMBEL_MAX)
        if not len(candidates):  # a NaN logit: every token competes, as argmax over the row treats NaN
            candidates = np.arange(len(row))
        noise = _gumbel(_uniforms(token_bits(term, terms[candidates])))
        chosen[i] = candidates[np.argmax(row[candidates] + noise)]
    return chosen


TOP_CHUNK = 64  # top_k_ids (here and its torch twin) and first_max_ids read the logits by chunks of this many ids


def top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """[R, k] int64 the ids of the k largest of each row of float logits [R, V], largest first (ties in any order).

    The numpy twin of kernels/sampling_torch.top_k_ids, for the engine executors: numpy runs on the calling
    thread, where torch's would wake its intra-op pool, whose workers then spin and take the cores from
    onnxruntime's next step. Each of the k largest lies in one of the k chunks of TOP_CHUNK ids whose maxima
    are largest (a chunk left out has k distinct chunks' maxima at least as large), so only those are sorted.
    """
    R, V = logits.shape
    n = V // TOP_CHUNK
    if n <= k:
        order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        return order.astype(np.int64)
    maxima = logits[:, : n * TOP_CHUNK].reshape(R, n, TOP_CHUNK).max(-1)  # [R, n]
    chunks = np.argpartition(-maxima, k - 1, axis=-1)[:, :k]  # [R, k] the chunks of the k largest maxima
    ids = (chunks[:, :, None] * TOP_CHUNK + np.arange(TOP_CHUNK)).reshape(R, k * TOP_CHUNK)
    if n * TOP_CHUNK < V:  # the ids past the last whole chunk are always candidates
        ids = np.concatenate([ids, np.broadcast_to(np.arange(n * TOP_CHUNK, V), (R, V - n * TOP_CHUNK))], 1)
    values = np.take_along_axis(logits, ids, -1)
    best = np.argpartition(-values, k - 1, axis=-1)[:, :k]  # the k largest candidates, unordered
    best = np.take_along_axis(best, np.argsort(-np.take_along_axis(values, best, -1), axis=-1, kind="stable"), -1)
    return np.take_along_axis(ids, best, -1).astype(np.int64)
