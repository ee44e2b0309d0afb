"""Ablations of our additions to lookahead decoding (docs/design.md 3.8) and the single-request driver.

`Switches` names each addition; `AblatedDecoder` is a RequestDecoder with some of them off, by overriding the
decoder's draft sources (`_pool_candidates`, `_lay_drafts`, `_previous`) and replacing its pool or recycled
successors: the production decoder has no flags. `request_decoder` gives the plain RequestDecoder when every
switch is on. `LookaheadDecoder` drives one request at a time on slot 0 of an executor (tests and scripts).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.decoder import NO_DRAFT, DecodeStats, RequestDecoder, StepTables, check_request
from trt_lookahead.lookahead.executor import Executor
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.pool import Continuation, NgramPool, SharedPool
from trt_lookahead.lookahead.recycle import NO_CONTEXT, SuccessorMap
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.lookahead.stepper import BatchStepper, Row
from trt_lookahead.lookahead.tree import TreeTemplate


@dataclass(frozen=True)
class Switches:
    """Our additions to lookahead decoding and the draft sources, each switchable for ablations (design 3.8)."""

    bonus: bool = True  # emit the model's token after the last accepted draft
    prompt_pool: bool = True  # seed the pool from the prompt and the accepted output
    chain: bool = True  # verify the window's column-0 chain as an extra candidate
    pool: bool = True  # the n-gram pool's candidates fill the verification branch
    suffix: bool = True  # suffix-matched continuations of the text so far fill the draft tree (tree only)
    recycle: bool = True  # recycled top-k successors fill the tree nodes the other sources left empty (tree only)
    pairs: bool = True  # recycled successors keyed by (previous token, token) first, then by token (tree only)


ALL_ON = Switches()


class WindowOnlyPool(NgramPool):
    """An n-gram pool fed by the window alone: the prompt and the accepted output are not inserted."""

    def insert_sequence(self, tokens: Sequence[int], origin: str, start: int = 0) -> None:
        """Nothing: `prompt_pool` is off."""


class TokenSuccessors(SuccessorMap):
    """Recycled successors keyed by token only: the (previous token, token) pairs are not recorded."""

    def record(self, inputs: np.ndarray, top: np.ndarray, previous: Sequence[int] | None = None) -> None:
        super().record(inputs, top, None)


class AblatedDecoder(RequestDecoder):
    """A RequestDecoder with the additions `switches` turns off left out; same arguments, `switches` after seed."""

    def __init__(
        self,
        config: LookaheadConfig,
        prompt: np.ndarray | Sequence[int],
        max_new_tokens: int,
        stop_tokens: Iterable[int] = (),
        seed: int = 0,
        switches: Switches = ALL_ON,
        tree: TreeTemplate | None = None,
        shared: SharedPool | None = None,
        successors: SuccessorMap | None = None,
    ) -> None:
        shared = shared if switches.pool and switches.prompt_pool else None
        super().__init__(config, prompt, max_new_tokens, stop_tokens, seed, tree, shared, successors)
        self.switches = switches
        if not switches.prompt_pool:
            self.pool = WindowOnlyPool(config.N, config.G)
        if not switches.suffix:
            self.suffix = None
        if not switches.recycle:
            self.successors = None
        elif not switches.pairs and self.successors is not None:
            self.successors = TokenSuccessors(successors)

    def _pool_candidates(self, limit: int) -> list[tuple[Continuation, str]]:
        return super()._pool_candidates(limit) if self.switches.pool else []

    def _lay_drafts(self, tab: StepTables) -> np.ndarray:
        drafts = super()._lay_drafts(tab)
        levels = tab.config.levels
        if not self.switches.chain:
            drafts[tab.config.G * levels :] = NO_DRAFT
        if not self.switches.bonus:
            drafts[tab.depth >= levels] = NO_DRAFT  # a step then yields at most N - 1 tokens, as in LADE
        return drafts

    @property
    def _previous(self) -> int:
        return self.sequence[-2] if self.switches.pairs else NO_CONTEXT


def request_decoder(config: LookaheadConfig, prompt: np.ndarray | Sequence[int], max_new_tokens: int,
                    stop_tokens: Iterable[int] = (), seed: int = 0, switches: Switches = ALL_ON,
                    *sources: Any, **named_sources: Any) -> RequestDecoder:
    """The production RequestDecoder when every switch is on, else an AblatedDecoder; `sources`: tree, shared,
    successors, as both take them."""
    if switches == ALL_ON:
        return RequestDecoder(config, prompt, max_new_tokens, stop_tokens, seed, *sources, **named_sources)
    return AblatedDecoder(config, prompt, max_new_tokens, stop_tokens, seed, switches, *sources, **named_sources)


@dataclass
class DecodeResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token was emitted, and is the last id) or "length"
    stats: DecodeStats


class LookaheadDecoder:
    """Drives one request at a time on slot 0 of `executor` at one config; `switches` exist for ablations."""

    def __init__(
        self,
        executor: Executor,
        layout: StepLayout | LookaheadConfig,
        *,
        stop_tokens: Iterable[int] = (),
        seed: int = 0,
        switches: Switches = ALL_ON,
        tree: TreeTemplate | None = None,
    ) -> None:
        self.layout = layout if isinstance(layout, StepLayout) else StepLayout(layout, tree=tree)
        self.executor = executor
        if self.config.step_tokens > self.executor.step_tokens:
            raise ValueError(
                f"the {self.config} layout needs {self.config.step_tokens} tokens per step but the executor "
                f"takes at most {self.executor.step_tokens}; build it with step_tokens >= {self.config.step_tokens}"
            )
        self.stop_tokens = frozenset(int(t) for t in stop_tokens)
        self.seed = seed
        self.switches = switches
        self.stats = DecodeStats()
        self._stepper = BatchStepper(self.executor)

    @property
    def config(self) -> LookaheadConfig:
        return self.layout.config

    def check_request(self, prompt_ids: Sequence[int], max_new_tokens: int) -> np.ndarray:
        """Validate a request before any work; returns the prompt as an int64 array."""
        return check_request(prompt_ids, max_new_tokens, self.executor.vocab_size, self.executor.max_seq_len)

    def generate(
        self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None
    ) -> DecodeResult:
        tokens: list[int] = []
        for block in self.stream(prompt_ids, max_new_tokens, sampling):
            tokens.extend(block)
        finish = "stop" if tokens and tokens[-1] in self.stop_tokens else "length"
        return DecodeResult(tokens, finish, self.stats)

    def stream(
        self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None
    ) -> Iterator[list[int]]:
        """Yield each step's accepted tokens as soon as the step is verified; self.stats is live.

        Decode time excludes the consumer's time between yields; executor time is inside step and commit.
        """
        prompt = self.check_request(prompt_ids, max_new_tokens)
        request = request_decoder(
            self.config, prompt, max_new_tokens, self.stop_tokens, self.seed, self.switches, self.layout.tree
        )
        stats = self.stats = request.stats
        start = time.perf_counter()
        first_token = self.executor.prefill(0, prompt, sampling or SamplingParams())
        stats.prefill_seconds = time.perf_counter() - start
        try:
            start = time.perf_counter()
            block = request.setup(first_token)
            if not request.finished:
                stats.decode_seconds += time.perf_counter() - start  # seeding the window and the pool
            yield block
            row = [Row(0, request, self.config)]
            while not request.finished:
                start = time.perf_counter()
                (error,) = self._stepper.run(row)
                stats.decode_seconds += time.perf_counter() - start
                if error is not None:
                    raise error
                yield request.emitted
        finally:
            self.executor.release(0)
