"""What the engine backends (onnxruntime, TensorRT) share: which graph a layout runs with which
step_config, the prefill chunks, the host-side token choice, and the executors' common state
(docs/design.md sections 5 and 6.3)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from trt_lookahead.engine.format import EngineConfig
from trt_lookahead.errors import UserError
from trt_lookahead.kernels.mask import CAUSAL
from trt_lookahead.lookahead.executor import check_commit
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams, select_tokens


@dataclass(frozen=True)
class EngineStep:
    """How a layout runs on an engine: the fixed-T step graph, or the dynamic graph at one token (greedy)."""

    step_graph: bool
    step_config: tuple[int, int, int]  # (W, N, G) of the layout; CAUSAL for the one-token graph


def engine_step(config: EngineConfig, layout: StepLayout) -> EngineStep:
    """The step graph for a layout of the engine's T (a smaller config padded to it), the dynamic graph for
    T = 1; anything else is refused naming the engine's T."""
    T = layout.step_tokens
    if config.step_tokens == T:
        layout.config.check_fits(config.lookahead)
        return EngineStep(True, (layout.config.W, layout.config.N, layout.config.G))
    if T == 1:
        return EngineStep(False, CAUSAL)
    raise UserError(
        f"a {T}-slot step ({layout.config}) does not fit engine {config.path}, built for T={config.step_tokens} "
        f"({config.lookahead}); pad the layout to the engine's T or rebuild"
    )


class OpenedEngine:
    """An engine dir opened for a backend: what the runtime reads of it (backends/open.py's Engine)."""

    def __init__(self, config: EngineConfig, max_seq_len: int | None) -> None:
        self.config = config
        self.lookahead = config.lookahead
        self.step_tokens = config.step_tokens
        self.max_seq_len = config.max_seq_len if max_seq_len is None else int(max_seq_len)
        self.dtype = config.dtype


class EngineExecutor:
    """The executor state both engine backends keep: sizes, sampling, cache_len and the step's result row."""

    def __init__(self, engine: OpenedEngine, layout: StepLayout) -> None:
        self.run = engine_step(engine.config, layout)
        self.layout = layout
        self.vocab_size = engine.config.vocab_size
        self.max_seq_len = engine.max_seq_len
        self.step_tokens = layout.step_tokens
        self.output_slots = layout.output_slots
        self.sampling = SamplingParams()
        self._cache_len = 0
        self._result = np.full(self.step_tokens, -1, np.int64)  # -1 at slots whose output is not read

    @property
    def cache_len(self) -> int:
        return self._cache_len

    def reset(self, sampling: SamplingParams | None = None) -> None:
        self.sampling = sampling or SamplingParams()
        self._cache_len = 0

    def commit(self, slots: np.ndarray) -> None:
        slots = check_commit(slots, self.step_tokens, self._cache_len, self.max_seq_len)
        if len(slots):
            self._keep(slots, self._cache_len)
            self._cache_len += len(slots)

    def _keep(self, slots: np.ndarray, row: int) -> None:
        """Copy the last step's K/V of `slots` (graph outputs) to cache rows row, row+1, ..."""
        raise NotImplementedError

    def _at_output_slots(self, chosen: np.ndarray) -> np.ndarray:
        """[T] int64: the chosen tokens at the output slots, -1 elsewhere."""
        result = self._result.copy()
        result[self.output_slots] = chosen
        return result


def prefill_chunks(ids: np.ndarray, chunk: int) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """(start, int32 graph inputs) per prefill chunk of at most `chunk` tokens: causal, the last row's output."""
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        n = len(part)
        yield start, {
            "input_ids": part.astype(np.int32),
            "positions": np.arange(start, start + n, dtype=np.int32),
            "cache_len": np.array([start], np.int32),
            "step_config": np.array(CAUSAL, np.int32),
            "output_slots": np.array([n - 1], np.int32),
        }


def choose_tokens(
    sampling: SamplingParams, argmax_ids: np.ndarray, read_logits: Callable[[], np.ndarray], positions: np.ndarray
) -> np.ndarray:
    """The graph's argmax ids (greedy), or the seeded sample from its float32 logits on the host."""
    if sampling.greedy:
        return argmax_ids.astype(np.int64)
    return select_tokens(read_logits(), positions, sampling)
