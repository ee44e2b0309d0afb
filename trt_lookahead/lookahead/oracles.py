"""Model-free executors for tests and scripts: next-token logits are a pure function of the prefix.

`OracleExecutor` rebuilds, for every step slot, the sequence that slot can see (KV cache + the step
tokens its mask row allows, ordered by position) and checks those positions are exactly p..q, so a
wrong mask, position or commit raises or yields a wrong token instead of passing silently.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np

from trt_lookahead.lookahead.sampling import SamplingParams, select_tokens

LogitsFn = Callable[[tuple[int, ...]], np.ndarray]


def _hash(values: tuple[int, ...], salt: int) -> int:
    h = 0x811C9DC5 ^ salt
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFF)) * 0x01000193) & 0xFFFFFFFF
    return h


def markov_logits(vocab: int, order: int, seed: int) -> LogitsFn:
    """Repetitive: logits depend on the last `order` tokens only, so greedy output falls into cycles."""
    table = np.random.default_rng(seed).normal(size=(257, vocab)) * 3

    def logits(context: tuple[int, ...]) -> np.ndarray:
        return table[_hash(context[-order:], seed) % len(table)]

    return logits


def induction_logits(vocab: int, seed: int) -> LogitsFn:
    """Copies what followed the last earlier occurrence of the last two tokens; Markov(1) otherwise."""
    fallback = markov_logits(vocab, 1, seed)

    def logits(context: tuple[int, ...]) -> np.ndarray:
        a, b = context[-2:] if len(context) >= 2 else (None, context[-1])
        for i in range(len(context) - 3, 0, -1):
            if context[i] == b and context[i - 1] == a:
                out = np.zeros(vocab)
                out[context[i + 1]] = 5.0
                return out + 0.1 * fallback(context)
        return fallback(context)

    return logits


def adversarial_logits(vocab: int, seed: int) -> LogitsFn:
    """Depends on the whole prefix and its length, with frequent exact ties (small integer logits)."""

    def logits(context: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng(_hash((*context, len(context)), seed))
        return rng.integers(0, 3, size=vocab).astype(np.float64)

    return logits


class OracleExecutor:
    """Executor contract over a logits function; validates every slot's visible prefix."""

    def __init__(self, logits_fn: LogitsFn, vocab_size: int, step_mask: np.ndarray, max_seq_len: int = 4096) -> None:
        self.logits_fn = lru_cache(maxsize=100_000)(logits_fn)
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.step_tokens = len(step_mask)
        self._visible = [np.flatnonzero(row) for row in np.asarray(step_mask, bool)]
        self.sampling = SamplingParams()
        self.cache: list[int] = []
        self.steps = 0

    @property
    def cache_len(self) -> int:
        return len(self.cache)

    def reset(self, sampling: SamplingParams) -> None:
        self.sampling, self.cache, self.steps = sampling, [], 0

    def prefill(self, prompt_ids: np.ndarray) -> int:
        self.cache = [int(t) for t in prompt_ids]
        logits = self.logits_fn(tuple(self.cache))[None]
        return int(select_tokens(logits, np.array([len(self.cache) - 1]), self.sampling)[0])

    def step(self, input_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        assert len(input_ids) == len(positions) == self.step_tokens
        p = len(self.cache)
        rows = []
        for i, visible in enumerate(self._visible):
            order = visible[np.argsort(positions[visible], kind="stable")]
            seen = positions[order].tolist()
            if seen != list(range(p, int(positions[i]) + 1)):
                raise AssertionError(f"slot {i} at position {positions[i]} sees positions {seen} after prefix {p}")
            rows.append(self.logits_fn(tuple(self.cache) + tuple(int(t) for t in input_ids[order])))
        self._last = (np.array(input_ids), np.array(positions))
        self.steps += 1
        return select_tokens(np.stack(rows), positions, self.sampling).astype(np.int64)

    def commit(self, slots: np.ndarray) -> None:
        ids, positions = self._last
        p = len(self.cache)
        expected = list(range(p, p + len(slots)))
        if positions[slots].tolist() != expected:
            raise AssertionError(f"commit of slots {list(slots)} at positions {positions[slots]} != {expected}")
        self.cache.extend(int(t) for t in ids[slots])


class InstantExecutor:
    """A bigram 'model' in O(T) numpy: next token = table[token]. For host-overhead measurements."""

    def __init__(self, vocab_size: int, step_tokens: int, seed: int = 0, max_seq_len: int = 1 << 20) -> None:
        rng = np.random.default_rng(seed)
        self.table = rng.integers(0, vocab_size, size=vocab_size)
        self.vocab_size, self.step_tokens, self.max_seq_len = vocab_size, step_tokens, max_seq_len
        self.cache_len = 0

    def reset(self, sampling: SamplingParams) -> None:
        self.cache_len = 0

    def prefill(self, prompt_ids: np.ndarray) -> int:
        self.cache_len = len(prompt_ids)
        return int(self.table[prompt_ids[-1]])

    def step(self, input_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return self.table[input_ids]

    def commit(self, slots: np.ndarray) -> None:
        self.cache_len += len(slots)
