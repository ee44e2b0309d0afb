"""LookaheadDecoder: one fixed-shape step per iteration, exactly the greedy (or seeded-sample) output.

Per step (DESIGN.md section 2), with x_t the last accepted token at position p:
  1. feed the window B0..B_{N-2} and G candidates from the pool keyed by x_t (StepLayout order);
  2. verify: candidate rows and the column-0 chain are checked against the executor's next-token
     outputs; the longest accepted run wins and the output after it is the bonus token;
  3. harvest one n-gram per window column, keyed by B0[j]; shift the window up one level;
  4. commit the KV of x_t and of the accepted draft tokens.
Greedy decoding is the degenerate layout (W, N, G) = (1, 2, 0): T = 1, no candidates, one token.

The verification tables, per step, for R = G candidate rows plus the chain row:
  drafts[r, m]   draft token m of row r (-1 = nothing there: never matches)
  expect[r, m]   output of the slot before draft m: expect[r, 0] = out(x_t), expect[r, m] = out(slot of draft m-1)
  accepted[r]    length of the run where drafts == expect; emitted = drafts[r, :k] + [expect[r, k]]
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from trt_lookahead.config import LookaheadConfig
from trt_lookahead.executors.base import Executor
from trt_lookahead.layout import StepLayout
from trt_lookahead.pool import OUTPUT, PROMPT, WINDOW, NgramPool
from trt_lookahead.sampling import SamplingParams

CHAIN = "chain"
NO_DRAFT = -1


@dataclass
class DecodeStats:
    """Counters of one generation. `steps` counts every forward pass that emitted tokens, prefill included."""

    steps: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    executor_seconds: float = 0.0  # inside executor.step/commit during decoding
    accepted_histogram: Counter = field(default_factory=Counter)  # tokens emitted per decode step
    sources: Counter = field(default_factory=Counter)  # accepted draft tokens by origin: prompt/output/window/chain

    @property
    def decode_steps(self) -> int:
        return max(self.steps - 1, 0)

    @property
    def compression(self) -> float:
        """Generated tokens per forward pass (greedy is exactly 1.0)."""
        return self.generated_tokens / self.steps if self.steps else 0.0

    @property
    def host_ms_per_step(self) -> float:
        """Decode wall time outside the executor, per decode step."""
        if not self.decode_steps:
            return 0.0
        return 1000.0 * (self.decode_seconds - self.executor_seconds) / self.decode_steps

    @property
    def tokens_per_second(self) -> float:
        """Tokens emitted by decode steps per decode second (the prefill's token is timed with prefill)."""
        decoded = self.generated_tokens - 1
        return decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "compression": round(self.compression, 4),
            "prefill_seconds": round(self.prefill_seconds, 6),
            "decode_seconds": round(self.decode_seconds, 6),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "host_ms_per_step": round(self.host_ms_per_step, 4),
            "accepted_histogram": {str(k): v for k, v in sorted(self.accepted_histogram.items())},
            "sources": dict(sorted(self.sources.items())),
        }


@dataclass
class DecodeResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token was emitted, and is the last id) or "length"
    stats: DecodeStats


class LookaheadDecoder:
    """Drives an executor built for `layout`; the switches exist for ablations and default to on."""

    def __init__(
        self,
        executor: Executor,
        layout: StepLayout | LookaheadConfig,
        *,
        stop_tokens: Iterable[int] = (),
        seed: int = 0,
        use_bonus: bool = True,
        use_prompt_pool: bool = True,
        use_chain: bool = True,
    ) -> None:
        self.layout = layout if isinstance(layout, StepLayout) else StepLayout(layout)
        if executor.step_tokens != self.layout.tokens:
            raise ValueError(
                f"executor steps {executor.step_tokens} tokens but the {self.layout.config} layout needs "
                f"{self.layout.tokens}; build the executor for this layout"
            )
        self.executor = executor
        self.stop_tokens = frozenset(int(t) for t in stop_tokens)
        self.seed = seed
        self.use_bonus = use_bonus
        self.use_prompt_pool = use_prompt_pool
        self.use_chain = use_chain
        self.stats = DecodeStats()
        self._build_tables()

    @property
    def config(self) -> LookaheadConfig:
        return self.layout.config

    def _build_tables(self) -> None:
        """Static index tables of the verification step (see the module docstring)."""
        cfg, lay = self.config, self.layout
        rows, depth = cfg.G + 1, cfg.levels
        self._expect_index = np.zeros((rows, depth + 1), np.int64)  # slot whose output is expected
        self._expect_index[: cfg.G, 1:] = lay.candidate_slots
        self._expect_index[cfg.G, 1:depth] = lay.chain_slots  # chain row: N-2 drafts
        self._draft_slots = self._expect_index[:, 1:]
        self._max_accept = depth if self.use_bonus else depth - 1
        self._window_size = cfg.levels * cfg.W
        self._candidate_span = slice(self._window_size, self._window_size + cfg.G * depth)

    def generate(
        self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None
    ) -> DecodeResult:
        tokens: list[int] = []
        for block in self.stream(prompt_ids, max_new_tokens, sampling):
            tokens.extend(block)
        finish = "stop" if tokens and tokens[-1] in self.stop_tokens else "length"
        return DecodeResult(tokens, finish, self.stats)

    def check_request(self, prompt_ids: Sequence[int], max_new_tokens: int) -> np.ndarray:
        """Validate a request before any work; returns the prompt as an int64 array."""
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        vocab = self.executor.vocab_size
        bad = prompt[(prompt < 0) | (prompt >= vocab)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab}); check the tokenizer")
        limit = self.executor.max_seq_len
        if prompt.size + max_new_tokens > limit:
            raise ValueError(
                f"prompt of {prompt.size} tokens + max_new_tokens {max_new_tokens} exceeds max_seq_len {limit}; "
                "shorten the prompt, lower max_new_tokens or raise max_seq_len"
            )
        return prompt

    def stream(
        self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None
    ) -> Iterator[list[int]]:
        """Yield each step's accepted tokens as soon as the step is verified; self.stats is live."""
        prompt = self.check_request(prompt_ids, max_new_tokens)
        cfg, lay, ex = self.config, self.layout, self.executor
        W, N, G = cfg.W, cfg.N, cfg.G
        stats = self.stats = DecodeStats()
        rng = np.random.default_rng(self.seed)
        fillers = np.array([t for t in prompt.tolist() if t not in self.stop_tokens] or prompt.tolist())

        ex.reset(sampling or SamplingParams())
        start = time.perf_counter()
        x = int(ex.prefill(prompt))
        stats.prefill_seconds = time.perf_counter() - start
        stats.steps, stats.generated_tokens = 1, 1
        yield [x]
        if x in self.stop_tokens or max_new_tokens == 1:
            return

        step_start = time.perf_counter()  # decode time excludes the consumer's time between yields
        sequence = [*prompt.tolist(), x]
        produced = 1
        pool = NgramPool(N, G)
        if self.use_prompt_pool:
            pool.insert_sequence(sequence, PROMPT)
        window = rng.choice(fillers, size=(cfg.levels, W))  # row l = level l, row 0 = B0 = [x_t, L0]
        window[0, 0] = x
        drafts = np.full((G + 1, cfg.levels), NO_DRAFT, np.int64)
        input_ids = np.zeros(lay.tokens, np.int64)
        p = len(prompt)

        while True:
            candidates = pool.candidates(x, G) if G else []
            drafts[:G] = NO_DRAFT
            if candidates:
                drafts[: len(candidates)] = [c for c, _ in candidates]
            if self.use_chain:
                drafts[G, : N - 2] = window[1:, 0]
            input_ids[: self._window_size] = window.ravel()
            input_ids[self._candidate_span] = np.maximum(drafts[:G], 0).ravel()  # pad rows: any valid id

            t0 = time.perf_counter()
            out = ex.step(input_ids, p + lay.rel_positions)
            stats.executor_seconds += time.perf_counter() - t0

            expect = out[self._expect_index]
            run = np.cumprod(drafts == expect[:, :-1], axis=1).sum(axis=1)
            np.minimum(run, self._max_accept, out=run)
            best = int(np.argmax(run))
            k = int(run[best])
            block = [*drafts[best, :k].tolist(), int(expect[best, k])]

            emitted = []
            for token in block:
                emitted.append(token)
                produced += 1
                if token in self.stop_tokens or produced == max_new_tokens:
                    break
            stats.steps += 1
            stats.generated_tokens = produced
            stats.accepted_histogram[len(emitted)] += 1
            if k:
                stats.sources[CHAIN if best == G else candidates[best][1]] += min(k, len(emitted))
            finished = len(emitted) < len(block) or emitted[-1] in self.stop_tokens or produced == max_new_tokens
            if finished:
                stats.decode_seconds += time.perf_counter() - step_start
                yield emitted
                return

            t0 = time.perf_counter()
            ex.commit(np.concatenate(([0], self._draft_slots[best, :k])))
            stats.executor_seconds += time.perf_counter() - t0
            p += k + 1
            x = block[-1]

            newest = out[lay.window_slots[-1]]
            if G:
                columns = np.concatenate((window, newest[None]), axis=0)  # [N, W]: one n-gram per column
                pool.insert_columns(columns[0].tolist(), map(tuple, columns[1:].T.tolist()), WINDOW)
            window = np.concatenate((window[1:], newest[None]), axis=0)
            self._replace_stop_tokens(window[-1, 1:] if N == 2 else window[-1], fillers, rng)
            window[0, 0] = x

            before = len(sequence)
            sequence.extend(block)
            if self.use_prompt_pool and G:
                pool.insert_sequence(sequence, OUTPUT, start=before)
            stats.decode_seconds += time.perf_counter() - step_start
            yield block
            step_start = time.perf_counter()

    def _replace_stop_tokens(self, level: np.ndarray, fillers: np.ndarray, rng: np.random.Generator) -> None:
        """Stop tokens in the newest level poison the window: swap them for random prompt tokens (in place)."""
        if not self.stop_tokens:
            return
        for i, token in enumerate(level.tolist()):
            if token in self.stop_tokens:
                level[i] = fillers[rng.integers(len(fillers))]
