"""What the engine backends (onnxruntime, TensorRT) share: the opened engine, and the batched executor's
host-side state and logic (docs/design.md sections 5, 6.3 and 9).

`SlotExecutor` implements the batched contract (lookahead/executor.py: prefill / claim / step / commit /
release / cache_len) over a backend that runs the engine's graph on the first B physical slots of its
[max_batch, Hkv, S, D] caches. It keeps the active slots physically compact, slots 0 .. A-1: a prefilled
slot takes the next physical slot, a released one is filled by moving the last active slot's valid rows
into it, and a step whose slots are not the first B physical slots first swaps them there (rare: a
scheduler steps every active request). Graph row j is physical slot j, so a step binds the caches by
address and copies no cache; the rows of a StepBatch are scattered into physical order and the results
gathered back. Token choice happens on the host: the graph's argmax for greedy slots, the seeded draw of
lookahead/sampling.py from the graph's float32 logits for sampling slots, per slot.

A backend provides `_inputs(B, T, K)` (the step's input arrays, to be filled), `_run(B, T, K)` (run the
graph on them; -> next_ids [B, K] and a reader of logits [B, K, V]), `_prefill_chunk`, `_keep` (commit
rows of a step row into a slot's cache), `_move` and `_swap` (physical slots' valid rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from trt_lookahead.engine.format import EngineConfig
from trt_lookahead.errors import UserError
from trt_lookahead.kernels.mask import CAUSAL
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.executor import (
    StepBatch,
    check_batch,
    check_commit,
    check_prompt,
    check_room,
    check_slot,
)
from trt_lookahead.lookahead.sampling import SamplingParams, select_tokens, top_k_ids

Logits = Callable[[], np.ndarray]  # reads the float32 logits of the last run (only sampled slots need them)


class OpenedEngine:
    """An engine dir opened for a backend: what the runtime reads of it (backends/open.py's Engine)."""

    def __init__(self, config: EngineConfig, max_seq_len: int | None, max_batch: int | None) -> None:
        self.config = config
        self.lookahead = config.lookahead
        self.step_tokens = config.step_tokens
        self.max_seq_len = config.max_seq_len if max_seq_len is None else int(max_seq_len)
        self.max_batch = config.max_batch if max_batch is None else int(max_batch)
        self.dtype = config.dtype
        self.exact = False  # row-invariant steps (docs/design.md section 4.2); a backend that runs them says so
        self.prefill_tokens = config.max_input_len  # the most tokens of one prefill chunk
        # the fewest token rows a step's products get: 2 where a 1-row product rounds otherwise and the step must be
        # row-invariant (an exact engine's MatMulNBits, docs/design.md 6.9); a backend that needs it says so
        self.min_rows = 1


class SlotExecutor:
    """The batched executor contract over an engine backend; see the module docstring."""

    def __init__(self, engine: OpenedEngine, max_batch: int | None = None) -> None:
        max_batch = engine.max_batch if max_batch is None else int(max_batch)
        if not 1 <= max_batch <= engine.config.max_batch:
            raise UserError(f"max_batch {max_batch} is outside 1 .. {engine.config.max_batch}, the engine "
                            f"{engine.config.path} was built for (rebuild with --max-batch {max_batch})")
        self.config = engine.config
        self.vocab_size = engine.config.vocab_size
        self.max_seq_len = engine.max_seq_len
        self.max_batch = max_batch
        self.step_tokens = engine.step_tokens
        self.pads_rows = True  # the graph runs [B, T]: every row as wide as the widest
        self.exact = engine.exact
        self.tree = engine.config.tree  # the verification slots' draft tree (docs/design.md 2.7); None: linear
        self._prefill_tokens = engine.prefill_tokens
        self._min_rows = engine.min_rows
        self._limits = np.array([engine.lookahead.W, engine.lookahead.N, engine.lookahead.G])
        self._cache_len = np.zeros(max_batch, np.int64)  # per slot
        self._physical = np.full(max_batch, -1, np.int64)  # slot -> physical slot, -1: free
        self._slot_at = np.full(max_batch, -1, np.int64)  # physical slot -> slot
        self._active = 0  # active slots hold physical slots 0 .. _active - 1
        self._sampling = [SamplingParams()] * max_batch
        self._last_row = np.full(max_batch, -1, np.int64)  # slot -> its row in the last step's outputs, -1: none
        self._last_real = np.zeros(max_batch, np.int64)  # real tokens of that row
        self._last_logits: tuple[Logits, np.ndarray] | None = None  # the last step's reader and graph rows

    # -- contract ---------------------------------------------------------------------------------

    def cache_len(self, slot: int) -> int:
        return int(self._cache_len[check_slot(slot, self.max_batch)])

    def claim(self, slot: int, sampling: SamplingParams) -> None:
        slot = check_slot(slot, self.max_batch)
        if self._physical[slot] < 0:
            self._physical[slot], self._slot_at[self._active] = self._active, slot
            self._active += 1
        self._cache_len[slot], self._last_row[slot], self._sampling[slot] = 0, -1, sampling

    def prefill(self, slot: int, prompt_ids: np.ndarray, sampling: SamplingParams) -> int:
        ids = check_prompt(prompt_ids, self.max_seq_len, self.vocab_size)
        self.claim(slot, sampling)
        chunks = [self._prefill_chunk(int(self._physical[slot]), start, inputs)
                  for start, inputs in prefill_chunks(ids, self._prefill_tokens, self._min_rows)]
        next_ids, logits = chunks[-1]  # the last chunk's row reads the prompt's last token (its first output)
        self._cache_len[slot] = len(ids)
        return int(self._choose(sampling, next_ids[0, :1], _first_outputs(logits, 1), 0, np.array([len(ids) - 1]))[0])

    def step(self, batch: StepBatch) -> np.ndarray:
        real = check_batch(batch, self.max_batch, self.step_tokens, self.vocab_size)
        slots = np.asarray(batch.slots, np.int64)
        self._check_rows(slots, np.asarray(batch.step_config, np.int64))
        B, T = np.shape(batch.input_ids)
        K = np.shape(batch.output_slots)[1]
        rows = self._gather(slots)  # [B]: the physical slot, = graph row, of each batch row
        # too few rows for min_rows (one greedy row alone): pad slots (design 2.3, at the row's cache_len) and the
        # last slot's output read again, so that every product has min_rows rows; their outputs are dropped
        wide = -(-self._min_rows // B)
        Tg, Kg = max(T, wide), max(K, wide)
        inputs = self._inputs(B, Tg, Kg)
        inputs["input_ids"][rows, :T] = batch.input_ids
        inputs["positions"][rows, :T] = batch.positions
        inputs["cache_len"][rows] = self._cache_len[slots]
        inputs["step_config"][rows] = batch.step_config
        inputs["output_slots"][rows, :K] = batch.output_slots
        if Tg > T or Kg > K:  # only where min_rows asks for it: no extra host work on the common step
            inputs["input_ids"][rows, T:] = np.asarray(batch.input_ids)[:, -1:]
            inputs["positions"][rows, T:] = self._cache_len[slots][:, None]
            inputs["output_slots"][rows, K:] = np.asarray(batch.output_slots)[:, -1:]
        next_ids, logits = self._run(B, Tg, Kg)
        if Kg > K:
            next_ids, logits = next_ids[:, :K], _first_outputs(logits, K)
        result = np.full((B, T), -1, np.int64)
        for b, slot in enumerate(slots.tolist()):
            chosen = self._choose(self._sampling[slot], next_ids[rows[b]], logits, int(rows[b]),
                                  np.asarray(batch.positions[b])[batch.output_slots[b]])
            result[b, batch.output_slots[b]] = chosen
        if batch.top_ids is not None:  # recycled drafts: the top-k of every output slot, from the logits
            top = top_k_ids(logits()[rows].reshape(B * K, -1), batch.top_ids.shape[2]).reshape(B, K, -1)
            batch.top_ids[np.arange(B)[:, None], batch.output_slots] = top
        self._last_row[:] = -1
        self._last_row[slots], self._last_real[slots] = rows, real
        self._last_logits = (logits, rows)
        return result

    def step_logits(self) -> np.ndarray:
        """A copy of the last step's float32 logits [B, K, V] at its output slots, in the StepBatch's row order."""
        if self._last_logits is None:
            raise ValueError("no step has run: step_logits reads the last step's logits")
        logits, rows = self._last_logits
        return logits()[rows].copy()

    def commit(self, slot: int, rows: np.ndarray) -> None:
        slot = check_slot(slot, self.max_batch)
        row = int(self._last_row[slot])
        if row < 0:
            raise ValueError(f"slot {slot} has no step to commit: commit follows the step that holds the slot")
        start = int(self._cache_len[slot])
        rows = check_commit(rows, int(self._last_real[slot]), start, self.max_seq_len)
        if len(rows):
            self._keep(int(self._physical[slot]), row, rows, start)
            self._cache_len[slot] += len(rows)
        self._last_row[slot] = -1

    def release(self, slot: int) -> None:
        slot = check_slot(slot, self.max_batch)
        hole = int(self._physical[slot])
        if hole < 0:
            return
        last = self._active - 1
        moved = int(self._slot_at[last])
        if hole != last:  # the last active slot fills the hole: active slots stay 0 .. A-1
            self._move(last, hole, int(self._cache_len[moved]))
            self._physical[moved], self._slot_at[hole] = hole, moved
        self._physical[slot], self._slot_at[last] = -1, -1
        self._active = last
        self._cache_len[slot], self._last_row[slot] = 0, -1

    # -- shared logic -----------------------------------------------------------------------------

    def _check_rows(self, slots: np.ndarray, step_config: np.ndarray) -> None:
        """ValueError for a row whose slot holds no prefilled request, whose cache is full, or whose config
        is larger than the engine's in W, N or G (greedy and causal rows always fit)."""
        free = slots[self._physical[slots] < 0]
        if len(free):
            raise ValueError(f"slots {free.tolist()} hold no request: prefill a slot before stepping it")
        for slot in slots.tolist():
            check_room(int(self._cache_len[slot]), self.max_seq_len)
        too_big = (step_config > self._limits).any(axis=1)
        if too_big.any():
            b = int(np.flatnonzero(too_big)[0])
            W, N, G = (int(v) for v in step_config[b])
            LookaheadConfig(W, N, G).check_fits(self.config.lookahead)  # raises, naming what differs

    def _gather(self, slots: np.ndarray) -> np.ndarray:
        """Make `slots` hold physical slots 0 .. B-1 (swapping others out of the way); -> their physical slots."""
        B = len(slots)
        outside = [s for s in slots.tolist() if self._physical[s] >= B]
        if outside:
            chosen = set(slots.tolist())
            inside = [int(self._slot_at[p]) for p in range(B) if int(self._slot_at[p]) not in chosen]
            for a, b in zip(outside, inside, strict=True):
                pa, pb = int(self._physical[a]), int(self._physical[b])
                self._swap(pa, pb, int(max(self._cache_len[a], self._cache_len[b])))
                self._physical[a], self._physical[b] = pb, pa
                self._slot_at[pa], self._slot_at[pb] = b, a
        return self._physical[slots].copy()

    @staticmethod
    def _choose(sampling: SamplingParams, argmax: np.ndarray, logits: Logits, row: int,
                positions: np.ndarray) -> np.ndarray:
        """The graph's argmax ids of one row (greedy), or the seeded sample from its float32 logits."""
        if sampling.greedy:
            return argmax.astype(np.int64)
        return select_tokens(logits()[row], positions, sampling)

    # -- backend hooks ----------------------------------------------------------------------------

    def _inputs(self, B: int, T: int, K: int) -> dict[str, np.ndarray]:
        """The step's graph inputs (input_ids, positions, cache_len, step_config, output_slots), to fill."""
        raise NotImplementedError

    def _run(self, B: int, T: int, K: int) -> tuple[np.ndarray, Logits]:
        """Run the graph on the first B physical slots -> (next_ids [B, K], logits reader)."""
        raise NotImplementedError

    def _prefill_chunk(self, physical: int, start: int, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, Logits]:
        """Run one prefill chunk (one row) on a physical slot, its K/V into cache rows start..; -> like `_run`."""
        raise NotImplementedError

    def _keep(self, physical: int, row: int, rows: np.ndarray, start: int) -> None:
        """Copy the K/V of step slots `rows` of output row `row` into the slot's cache rows start, start+1, ..."""
        raise NotImplementedError

    def _move(self, src: int, dst: int, length: int) -> None:
        """Copy physical slot src's cache rows 0 .. length-1 into physical slot dst."""
        raise NotImplementedError

    def _swap(self, a: int, b: int, length: int) -> None:
        """Exchange the cache rows 0 .. length-1 of physical slots a and b."""
        raise NotImplementedError


def _first_outputs(logits: Logits, K: int) -> Logits:
    """A reader of the first K output slots' logits of `logits`' rows."""
    return lambda: logits()[:, :K]


def prefill_chunks(ids: np.ndarray, chunk: int, min_rows: int = 1) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """(start, int32 graph inputs of one row) per causal prefill chunk of at most `chunk` tokens, which reads the
    chunk's last token min_rows times; a chunk of fewer than min_rows tokens is padded (at position `start`, the
    row's cache_len) to min_rows, so that every product has min_rows rows (SlotExecutor.step). A pad's KV lands in
    the cache past the prompt, where nothing reads it before a commit overwrites it."""
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        n = len(part)
        pads = max(0, min_rows - n)
        yield start, {
            "input_ids": np.pad(part, (0, pads), mode="edge").astype(np.int32)[None],
            "positions": np.concatenate([np.arange(start, start + n), np.full(pads, start)]).astype(np.int32)[None],
            "cache_len": np.array([start], np.int32),
            "step_config": np.array([CAUSAL], np.int32),
            "output_slots": np.full((1, max(1, min_rows)), n - 1, np.int32),
        }
