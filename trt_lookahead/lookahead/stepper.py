"""The batch stepper: one decode-loop body for every row of a batched step (docs/design.md section 9).

It owns the step's rows and buffers: `BatchStepper.run` prepares every row, runs one executor.step, then per
row verify -> executor.commit(commit_slots) -> harvest. A row is a `StepRow`: a request's decode step
(`Row`, driving a RequestDecoder, lookahead/decoder.py) or a chunk of a prompt being prefilled in steps
(`PrefillChunk`, a causal row), so chunked prefill and decoding share one step and one loop. The prefill modes
a scheduler takes (`Prefill`, `parse_prefill`) live here beside `PrefillChunk`, below the runtime, so that
bench/ (below runtime/ in the layers) and the CLI read them too. The scheduler (runtime/scheduler.py) calls
`run` for all active requests.

It may import the algorithm layer only (lookahead/: the decoder, the executor contract), never a backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.decoder import RequestDecoder, step_tables
from trt_lookahead.lookahead.executor import CAUSAL, Executor, StepBatch
from trt_lookahead.lookahead.recycle import RECYCLE_K


class StepRow(Protocol):
    """One row of a step as BatchStepper drives it."""

    slot: int

    @property
    def recycles(self) -> bool:
        """Whether the row needs the step's top-k ids at its output slots (then passed to `harvest`)."""
        ...

    def shape(self) -> tuple[int, int]:
        """(tokens, output slots) the row needs; the step's views are as wide as its widest row."""
        ...

    def prepare(
        self, input_ids: np.ndarray, positions: np.ndarray, step_config: np.ndarray, output_slots: np.ndarray
    ) -> None: ...

    def verify(self, out: np.ndarray) -> np.ndarray | None:
        """Read the step's outputs; -> the step slots to commit, or None when the request ended (no commit)."""
        ...

    def harvest(self, out: np.ndarray, top: np.ndarray | None) -> None:
        """After the commit: feed what the step computed back into the row's state."""
        ...

    def timed(self, executor_seconds: float) -> None:
        """The step's executor seconds (step and commits), counted whole for every row."""
        ...


@dataclass
class Row:
    """One request in one step: its KV slot, its decoder, and the config this step uses."""

    slot: int
    decoder: RequestDecoder
    config: LookaheadConfig

    def shape(self) -> tuple[int, int]:
        return self.config.step_tokens, len(step_tables(self.config, self.decoder.tree).output_slots)

    def prepare(
        self, input_ids: np.ndarray, positions: np.ndarray, step_config: np.ndarray, output_slots: np.ndarray
    ) -> None:
        self.decoder.prepare(self.config, input_ids, positions, step_config, output_slots)

    def verify(self, out: np.ndarray) -> np.ndarray | None:
        self.decoder.verify(out)
        return None if self.decoder.finished else self.decoder.commit_slots

    @property
    def recycles(self) -> bool:
        return self.decoder.recycles

    def harvest(self, out: np.ndarray, top: np.ndarray | None) -> None:
        self.decoder.harvest(out, top)

    def timed(self, executor_seconds: float) -> None:
        self.decoder.stats.executor_seconds += executor_seconds


SEPARATE, CHUNKED = "separate", "chunked"  # how a scheduler prefills a joining request (runtime/scheduler.py)
Prefill = str | int  # SEPARATE, CHUNKED, or chunked with this many prompt tokens per chunk


def parse_prefill(text: str) -> Prefill:
    """`separate`, `chunked` or a chunk size in tokens, from a command line; UserError otherwise."""
    word = text.strip().lower()
    if word in (SEPARATE, CHUNKED):
        return word
    if word.isdigit() and int(word) > 0:
        return int(word)
    raise UserError(f"prefill takes {SEPARATE}, {CHUNKED} or a chunk size in tokens (a positive integer); got {text!r}")


@dataclass
class PrefillChunk:
    """Prompt tokens start .. start+tokens-1 of a claimed slot as one causal row (chunked prefill).

    Pads past the chunk continue its positions and are never committed (lookahead/executor.py). After the
    last chunk, `first` is the step's output at the chunk's last token: the request's first token.
    """

    slot: int
    prompt: np.ndarray
    start: int
    tokens: int
    first: int | None = None

    @property
    def last(self) -> bool:
        return self.start + self.tokens == len(self.prompt)

    def shape(self) -> tuple[int, int]:
        return self.tokens, 1

    def prepare(
        self, input_ids: np.ndarray, positions: np.ndarray, step_config: np.ndarray, output_slots: np.ndarray
    ) -> None:
        n = self.tokens
        input_ids[:n] = self.prompt[self.start : self.start + n]
        input_ids[n:] = 0
        positions[:] = np.arange(self.start, self.start + len(positions))
        step_config[:] = CAUSAL
        output_slots[:] = n - 1

    def verify(self, out: np.ndarray) -> np.ndarray:
        if self.last:
            self.first = int(out[self.tokens - 1])
        return np.arange(self.tokens)

    recycles = False  # a prompt chunk's outputs are not drafts' context yet

    def harvest(self, out: np.ndarray, top: np.ndarray | None) -> None:
        """Nothing to do: the scheduler sets the request up from `first`."""

    def timed(self, executor_seconds: float) -> None:
        """Not counted: the scheduler times a prefilling request's steps as its prefill."""


class BatchStepper:
    """The decode-loop body for any number of requests; buffers are allocated once (max_batch x step_tokens)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        B, T = executor.max_batch, executor.step_tokens
        self._ids = np.zeros((B, T), np.int64)
        self._positions = np.zeros((B, T), np.int64)
        self._config = np.zeros((B, 3), np.int32)
        self._outputs = np.zeros((B, T), np.int64)
        self._slots = np.zeros(B, np.int64)
        # top-k ids, filled only in steps with recycling rows (k: at most the vocabulary)
        self._top = np.zeros((B, T, min(RECYCLE_K, executor.vocab_size)), np.int64)
        self.executor_seconds = 0.0  # inside executor.step / commit, over the stepper's life

    def run(
        self, rows: Sequence[StepRow], while_stepping: Callable[[], None] = lambda: None
    ) -> list[BaseException | None]:
        """One step for `rows` (distinct slots). Returns per row None, or the error that ended that request.

        An error in one request's host code (prepare, verify, commit, harvest) ends that row only; a failing
        executor step ends the rows of the step. Each row is timed with the whole step's executor seconds.
        `while_stepping` runs after the rows are prepared, just before the executor step (the scheduler hands
        blocks to consumers there).
        """
        errors: list[BaseException | None] = [None] * len(rows)
        shapes = [row.shape() for row in rows]
        T, K = max(t for t, _ in shapes), max(k for _, k in shapes)
        live: list[int] = []
        for i, row in enumerate(rows):
            b = len(live)
            try:
                row.prepare(self._ids[b, :T], self._positions[b, :T], self._config[b], self._outputs[b, :K])
            except Exception as exc:
                errors[i] = exc
                continue
            self._slots[b] = row.slot
            live.append(i)
        while_stepping()
        if not live:
            return errors
        B = len(live)
        top = self._top[:B, :T] if any(rows[i].recycles for i in live) else None
        batch = StepBatch(
            self._slots[:B], self._ids[:B, :T], self._positions[:B, :T], self._config[:B], self._outputs[:B, :K], top
        )
        start = time.perf_counter()
        try:
            out = self.executor.step(batch)
        except Exception as exc:
            for i in live:
                errors[i] = exc
            return errors
        seconds = time.perf_counter() - start
        for b, i in enumerate(live):
            row = rows[i]
            try:
                commit = row.verify(out[b])
                if commit is not None:
                    start = time.perf_counter()
                    self.executor.commit(row.slot, commit)
                    seconds += time.perf_counter() - start
                    row.harvest(out[b], None if top is None else top[b])
            except Exception as exc:
                errors[i] = exc
        for i in live:
            rows[i].timed(seconds)
        self.executor_seconds += seconds
        return errors
