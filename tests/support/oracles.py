"""Model-free executors for tests and scripts: next-token logits are a pure function of the prefix (test support:
no production code imports it).

`OracleExecutor` implements the batched contract (lookahead/executor.py). For every slot of every row
it rebuilds the sequence that slot can see (its own KV slot's cache + the step tokens its mask row
allows, ordered by position) and checks those positions are exactly cache_len .. q, so a wrong mask,
position or commit, or a row reading another slot's cache, raises or yields a wrong token instead of
passing silently. `reference_generate` is plain one-token-at-a-time decoding over the same logits, with
no decoder code: what every request must emit. `InstantExecutor` is a bigram table in O(B T) numpy, for
host-overhead measurements. `decode_together` drives requests through one batch to the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np

from support.ablation import Switches, request_decoder
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.decoder import RequestDecoder
from trt_lookahead.lookahead.executor import StepBatch, check_batch, check_commit, check_prompt, check_slot
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.pool import SharedPool
from trt_lookahead.lookahead.recycle import SuccessorMap
from trt_lookahead.lookahead.sampling import SamplingParams, select_tokens
from trt_lookahead.lookahead.stepper import BatchStepper, Row
from trt_lookahead.lookahead.tree import TreeTemplate

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


# the oracles by name, each (vocab, seed) -> logits: the property tests draw from them
ORACLES: dict[str, Callable[[int, int], LogitsFn]] = {
    "markov": lambda vocab, seed: markov_logits(vocab, 2, seed),
    "induction": induction_logits,
    "adversarial": adversarial_logits,
}


@lru_cache(maxsize=256)
def row_mask(step_config: tuple[int, int, int], tokens: int, tree: TreeTemplate | None = None) -> np.ndarray:
    """[T, T] bool mask of one row: its layout (verification branch laid as `tree`) padded to T, or causal."""
    if step_config[0] == 0:
        return np.tri(tokens, dtype=bool)
    return StepLayout(LookaheadConfig(*step_config), padded_tokens=tokens, tree=tree).mask


def reference_generate(
    logits_fn: LogitsFn,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    stop_tokens: Sequence[int] = (),
) -> list[int]:
    """Plain one-token-at-a-time decoding over `logits_fn` (argmax or the seeded draw), up to a stop token."""
    sampling = sampling or SamplingParams()
    sequence = [int(t) for t in prompt]
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits = logits_fn(tuple(sequence))[None]
        token = int(select_tokens(logits, np.array([len(sequence) - 1]), sampling)[0])
        out.append(token)
        sequence.append(token)
        if token in stop_tokens:
            break
    return out


class OracleExecutor:
    """The batched executor contract over a logits function; validates every slot's visible prefix.

    With `tree`, every lookahead row's verification slots are that template's nodes (fixed per executor).
    """

    def __init__(
        self,
        logits_fn: LogitsFn,
        vocab_size: int,
        max_batch: int = 8,
        step_tokens: int = 256,
        max_seq_len: int = 4096,
        tree: TreeTemplate | None = None,
        pads_rows: bool = False,
    ) -> None:
        self.tree = tree
        self.pads_rows = pads_rows  # only what the policy is told: the oracle computes real tokens either way
        self.logits_fn = lru_cache(maxsize=100_000)(logits_fn)
        self.vocab_size, self.max_batch, self.step_tokens, self.max_seq_len = (
            vocab_size, max_batch, step_tokens, max_seq_len
        )
        self.caches: list[list[int]] = [[] for _ in range(max_batch)]
        self.sampling = [SamplingParams()] * max_batch
        self._last: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}  # slot -> last step's ids, positions, real
        self.steps = 0
        self.rows_per_step: list[int] = []

    def cache_len(self, slot: int) -> int:
        return len(self.caches[check_slot(slot, self.max_batch)])

    def claim(self, slot: int, sampling: SamplingParams) -> None:
        slot = check_slot(slot, self.max_batch)
        self.caches[slot] = []
        self.sampling[slot] = sampling
        self._last.pop(slot, None)

    def prefill(self, slot: int, prompt_ids: np.ndarray, sampling: SamplingParams) -> int:
        ids = check_prompt(prompt_ids, self.max_seq_len, self.vocab_size)
        self.claim(slot, sampling)
        self.caches[slot] = [int(t) for t in ids]
        logits = self.logits_fn(tuple(self.caches[slot]))[None]
        return int(select_tokens(logits, np.array([len(ids) - 1]), sampling)[0])

    def step(self, batch: StepBatch) -> np.ndarray:
        real = check_batch(batch, self.max_batch, self.step_tokens, self.vocab_size)
        T = batch.tokens
        out = np.full((batch.rows, T), -1, np.int64)
        for b, slot in enumerate(batch.slots.tolist()):
            cache, ids, positions = self.caches[slot], batch.input_ids[b], batch.positions[b]
            W, N, G = (int(v) for v in batch.step_config[b])
            mask = row_mask((W, N, G), T, self.tree)
            p = len(cache)
            contexts = []
            for i in range(T):
                visible = np.flatnonzero(mask[i])
                order = visible[np.argsort(positions[visible], kind="stable")]
                seen = positions[order].tolist()
                if seen != list(range(p, int(positions[i]) + 1)):
                    raise AssertionError(
                        f"row {b} (slot {slot}) step slot {i} at position {positions[i]} sees positions {seen} "
                        f"after a cached prefix of {p}"
                    )
                contexts.append(tuple(cache) + tuple(int(t) for t in ids[order]))
            reads = np.unique(batch.output_slots[b])
            logits = np.stack([self.logits_fn(contexts[i]) for i in reads])
            out[b, reads] = select_tokens(logits, positions[reads], self.sampling[slot])
            if batch.top_ids is not None:  # stable: ties keep the lower id first
                batch.top_ids[b, reads] = np.argsort(-logits, axis=1, kind="stable")[:, : batch.top_ids.shape[2]]
            self._last[slot] = (np.array(ids), np.array(positions), int(real[b]))
        self.steps += 1
        self.rows_per_step.append(batch.rows)
        return out

    def commit(self, slot: int, rows: np.ndarray) -> None:
        slot = check_slot(slot, self.max_batch)
        if slot not in self._last:
            raise ValueError(f"slot {slot} has no step to commit")
        ids, positions, real = self._last.pop(slot)
        cache = self.caches[slot]
        rows = check_commit(rows, real, len(cache), self.max_seq_len)
        expected = list(range(len(cache), len(cache) + len(rows)))
        if positions[rows].tolist() != expected:
            raise AssertionError(
                f"commit of rows {rows.tolist()} at positions {positions[rows].tolist()} != {expected}"
            )
        cache.extend(int(t) for t in ids[rows])

    def release(self, slot: int) -> None:
        slot = check_slot(slot, self.max_batch)
        self.caches[slot] = []
        self._last.pop(slot, None)


class InstantExecutor:
    """A bigram 'model': next token = table[token], in O(B T) numpy. For host-overhead measurements."""

    def __init__(
        self, vocab_size: int, max_batch: int = 8, step_tokens: int = 256, seed: int = 0, max_seq_len: int = 1 << 20
    ) -> None:
        self.table = np.random.default_rng(seed).integers(0, vocab_size, size=vocab_size)
        self.vocab_size, self.max_batch, self.step_tokens, self.max_seq_len = (
            vocab_size, max_batch, step_tokens, max_seq_len
        )
        self._cache_len = np.zeros(max_batch, np.int64)
        self.pads_rows = False

    def cache_len(self, slot: int) -> int:
        return int(self._cache_len[slot])

    def claim(self, slot: int, sampling: SamplingParams) -> None:
        self._cache_len[slot] = 0

    def prefill(self, slot: int, prompt_ids: np.ndarray, sampling: SamplingParams) -> int:
        self._cache_len[slot] = len(prompt_ids)
        return int(self.table[prompt_ids[-1]])

    def step(self, batch: StepBatch) -> np.ndarray:
        if batch.top_ids is not None:  # the table's token first, then a fixed pseudo-random runner-up list
            batch.top_ids[:] = self.table[(batch.input_ids[:, :, None] + np.arange(batch.top_ids.shape[2])) %
                                          self.vocab_size]
        return self.table[batch.input_ids]

    def commit(self, slot: int, rows: np.ndarray) -> None:
        self._cache_len[slot] += len(rows)

    def release(self, slot: int) -> None:
        self._cache_len[slot] = 0


def warmed_shared_pool(texts: Sequence[Sequence[int]], vocab: int, seed: int, junk: int = 200,
                       budget: int = 4096) -> SharedPool:
    """A shared pool holding `junk` random n-grams and every n-gram of `texts`, for N = 2 .. 6 (the texts last)."""
    rng = np.random.default_rng(seed)
    pool = SharedPool(budget)
    for n in range(2, 7):
        pool.insert_sequence(rng.integers(0, vocab, junk + n).tolist(), n)
        for text in texts:
            pool.insert_sequence(list(text), n)
    return pool


def decode_together(
    executor: OracleExecutor, specs: Sequence[dict], config_for: Callable[[RequestDecoder], LookaheadConfig],
    tree: TreeTemplate | None = None, shared: SharedPool | None = None, successors: SuccessorMap | None = None,
) -> list[tuple[RequestDecoder, list[int]]]:
    """Decode `specs` (dicts of config, prompt, max_new, stop, seed, sampling, optionally switches) as one batch
    on `executor` to the end, each step's config per request from `config_for`: (decoder, tokens emitted) each.
    `shared`, `successors`: the n-gram pool and recycled successors all of them read and feed (None: their own)."""
    stepper = BatchStepper(executor)
    decoders, emitted = [], []
    for slot, s in enumerate(specs):
        d = request_decoder(s["config"], s["prompt"], s["max_new"], s["stop"], s["seed"],
                            s.get("switches", Switches()), tree, shared, successors)
        emitted.append(list(d.setup(executor.prefill(slot, d.prompt, s["sampling"]))))
        decoders.append(d)
    while rows := [Row(slot, d, config_for(d)) for slot, d in enumerate(decoders) if not d.finished]:
        for failure in stepper.run(rows):
            if failure is not None:  # an oracle run has no faults to isolate: any is a defect
                raise failure
        for row in rows:
            emitted[row.slot].extend(row.decoder.emitted)
    return list(zip(decoders, emitted, strict=True))
