"""Lookahead decoding of one request in named phases, driven by a batched step (docs/design.md sections 3, 9).

    setup(x)                     after prefill: emit x, seed the window and the n-gram pool          (once)
    prepare(config, row views)   write this step's row: ids, positions, step_config, output slots
    accept(out_row)              verify the drafts against the row's outputs, emit under the stop and
                                 length rules, set `commit_slots` and `finished`
    update(out_row)              harvest the window columns used, shift them, replace stop tokens, add
                                 the new tokens' n-grams

`RequestDecoder` holds one request's state. Each step may use a smaller config than the request's own
(W, N, G): fewer window columns W' <= W and candidates G' <= G at the same N, or GREEDY_STEP (1, 2, 0).
Columns a step does not use keep their state; a step of another N (greedy under N > 2) uses no column.
Which config a step uses never changes the tokens (docs/design.md section 4), only how many are accepted.

`BatchStepper.run` is the one decode-loop body: prepare every row, one executor.step, then per row
accept -> executor.commit(commit_slots) -> update. The scheduler (runtime/scheduler.py) calls it for all
active requests; `LookaheadDecoder`, the single-request driver, calls it with one row.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from trt_lookahead.errors import UserError, as_int
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.executor import Executor, StepBatch
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.pool import OUTPUT, PROMPT, WINDOW, Continuation, NgramPool
from trt_lookahead.lookahead.sampling import SamplingParams

CHAIN = "chain"
NO_DRAFT = -1
GREEDY_STEP = LookaheadConfig.greedy()


@dataclass
class DecodeStats:
    """Counters of one generation. `steps` counts every forward pass that emitted tokens, prefill included."""

    steps: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time of the decode steps the request was in
    executor_seconds: float = 0.0  # inside executor.step/commit during those steps (a batched step counts whole)
    accepted_histogram: Counter = field(default_factory=Counter)  # tokens emitted per decode step
    sources: Counter = field(default_factory=Counter)  # accepted draft tokens by origin: prompt/output/window/chain
    configs: Counter = field(default_factory=Counter)  # decode steps per step config label (greedy or W/N/G)

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
            "configs": dict(sorted(self.configs.items())),
        }


@dataclass
class DecodeResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token was emitted, and is the last id) or "length"
    stats: DecodeStats


@dataclass(frozen=True)
class Switches:
    """Our additions to lookahead decoding, each switchable for ablations (docs/design.md section 3.8)."""

    bonus: bool = True  # emit the model's token after the last accepted draft
    prompt_pool: bool = True  # seed the pool from the prompt and the accepted output
    chain: bool = True  # verify the window's column-0 chain as an extra candidate


def expect_index(layout: StepLayout) -> np.ndarray:
    """[G + 1, N] int64: the slot whose output each draft is checked against (see `verify`).

    Column 0 is slot 0 (x_t); column m + 1 is the slot of draft m. Rows 0 .. G-1 are the candidates,
    row G the column-0 chain, whose N - 2 drafts leave its last column at slot 0 (never read: run <= N - 2).
    """
    cfg = layout.config
    index = np.zeros((cfg.G + 1, cfg.levels + 1), np.int64)
    index[: cfg.G, 1:] = layout.candidate_slots
    index[cfg.G, 1 : cfg.levels] = layout.chain_slots
    return index


def verify(drafts: np.ndarray, out: np.ndarray, index: np.ndarray) -> tuple[int, int]:
    """(best row, accepted drafts k): the row whose drafts match the model's outputs longest, first on ties.

    drafts [R, N] (-1 = no draft, never matches; the last column is always -1, so a run stops there),
    out [T] the step's next tokens, index = `expect_index`. expect = out[index]; row r accepts the leading
    run where drafts[r, m] == expect[r, m]; the step emits drafts[best, :k] + [expect[best, k]] (k drafts
    + the bonus token). Without the bonus token the caller sets column N - 2 to -1 as well.

    Worked example, W=2 N=3 G=1 (T = 6: B0 = slots 0 1, B1 = 2 3, candidate V0 = 4 5):
        index  = [[0, 4, 5],  [0, 2, 0]]            V0's slots; the chain row checks B1[0] (slot 2)
        drafts = [[cat, sat, -1], [cat, -1, -1]]    V0 from the pool; the chain row holds B1[0] = cat
        out    = [cat, ., sat, the, sat, on]        out[i]: the model's token after slot i
        expect = [[cat, sat, on], [cat, sat, cat]]
        run    = [2, 1]  ->  best 0, k 2, emitted [cat, sat] + [on]
    """
    run = np.argmin(drafts == out[index], axis=1)
    best = int(np.argmax(run))
    return best, int(run[best])


@dataclass(frozen=True)
class StepTables:
    """The static tables of one step config, built once per config (`step_tables`)."""

    config: LookaheadConfig
    step_config: np.ndarray  # [3] int32 (W, N, G)
    rel_positions: np.ndarray  # [T] offsets from x_t's position
    output_slots: np.ndarray  # [K] increasing: the slots whose outputs accept/update read
    expect_index: np.ndarray  # [G + 1, N] see `expect_index`
    newest_slots: np.ndarray  # [W] the last window level: its outputs become the newest level
    window_size: int  # (N - 1) W: the window's slots come first, level-major


@lru_cache(maxsize=1024)
def step_tables(config: LookaheadConfig) -> StepTables:
    layout = StepLayout(config)
    step_config = np.array((config.W, config.N, config.G), np.int32)
    step_config.flags.writeable = False
    index = expect_index(layout)
    index.flags.writeable = False
    return StepTables(
        config, step_config, layout.rel_positions, layout.output_slots, index, layout.window_slots[-1],
        config.levels * config.W,
    )


def check_request(prompt_ids: Sequence[int] | np.ndarray, max_new_tokens: int, vocab_size: int,
                  max_seq_len: int) -> np.ndarray:
    """Validate a request before any work; returns the prompt as an int64 array."""
    ids = np.asarray(prompt_ids).reshape(-1)
    if ids.size == 0:
        raise UserError("the prompt is empty: give at least one token")
    # integer arrays compare as they are; anything else (bools, floats, ints beyond 64 bits) id by id
    values = ids.tolist() if ids.dtype.kind in "iu" else [as_int("token id", t) for t in ids.tolist()]
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer) or max_new_tokens <= 0:
        raise UserError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    bad = [t for t in values if not 0 <= t < vocab_size]
    if bad:
        raise UserError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size}); check the tokenizer")
    prompt = np.array(values, np.int64)
    if prompt.size + max_new_tokens > max_seq_len:
        raise UserError(
            f"prompt of {prompt.size} tokens + max_new_tokens {max_new_tokens} exceeds max_seq_len {max_seq_len}; "
            "shorten the prompt, lower max_new_tokens or raise max_seq_len"
        )
    return prompt


class RequestDecoder:
    """One request's decoding state (window, pool, position), advanced by setup / prepare / accept / update."""

    def __init__(
        self,
        config: LookaheadConfig,
        prompt: np.ndarray | Sequence[int],
        max_new_tokens: int,
        stop_tokens: Iterable[int] = (),
        seed: int = 0,
        switches: Switches = Switches(),
    ) -> None:
        self.config = config  # the largest config any step of this request may use
        self.prompt = np.asarray(prompt, np.int64).reshape(-1)
        self.max_new_tokens = max_new_tokens
        self.stop_tokens = frozenset(int(t) for t in stop_tokens)
        self.switches = switches
        self.stats = DecodeStats()
        self.rng = np.random.default_rng(seed)
        prompt_list = self.prompt.tolist()
        self.fillers = np.array([t for t in prompt_list if t not in self.stop_tokens] or prompt_list)
        self.window = np.zeros((config.levels, config.W), np.int64)  # row l = level l, row 0 = B0 = [x_t, L0]
        self.pool = NgramPool(config.N, config.G)
        self.candidates: list[tuple[Continuation, str]] = []
        self.sequence: list[int] = []
        self.tokens: list[int] = []  # emitted so far
        self.x = NO_DRAFT  # x_t: the last emitted token, whose KV is not cached yet
        self.cache_len = len(self.prompt)  # x_t's position
        self.block: list[int] = []  # this step's verified tokens (drafts + bonus), set by accept
        self.emitted: list[int] = []  # what this step emitted: the block, cut at a stop token or the length
        self.commit_slots = np.zeros(0, np.int64)
        self.finished = False
        self._tables: StepTables | None = None  # of the step in flight (prepare .. update)
        self._drafts_buffer = np.empty((config.G + 1, config.N), np.int64)
        self._drafts = self._drafts_buffer[:0]

    @property
    def finish_reason(self) -> str:
        return "stop" if self.tokens and self.tokens[-1] in self.stop_tokens else "length"

    def setup(self, first_token: int) -> list[int]:
        """After prefill: emit the prefill's token; unless that ends the request, seed the window and the pool."""
        x = int(first_token)
        self.tokens, self.emitted = [x], [x]
        self.stats.steps = self.stats.generated_tokens = 1
        self.finished = x in self.stop_tokens or self.max_new_tokens == 1
        if self.finished:
            return [x]
        self.x = x
        self.sequence = [*self.prompt.tolist(), x]
        if self.switches.prompt_pool:
            self.pool.insert_sequence(self.sequence, PROMPT)
        self.window = self.rng.choice(self.fillers, size=self.window.shape)
        self.window[0, 0] = x
        return [x]

    def fits(self, config: LookaheadConfig) -> bool:
        """Whether a step of this request may use `config`: GREEDY_STEP, or at most W and G at the same N."""
        cfg = self.config
        return config == GREEDY_STEP or (config.N == cfg.N and config.W <= cfg.W and config.G <= cfg.G)

    def draft_supply(self) -> int:
        """Pool candidates x_t has now: candidate rows beyond them would be fed empty."""
        return len(self.pool.candidates(self.x, self.config.G)) if self.config.G else 0

    def prepare(
        self,
        config: LookaheadConfig,
        input_ids: np.ndarray,
        positions: np.ndarray,
        step_config: np.ndarray,
        output_slots: np.ndarray,
    ) -> None:
        """Write this step's row into the given views: the window level-major, then the candidates of x_t.

        The views may be wider than the row: pads get token 0 at x_t's position, output slots repeat the last.
        """
        if not self.fits(config):
            raise ValueError(f"a step of config {config} does not fit this request's {self.config}")
        tab = self._tables = step_tables(config)
        W, levels, G = config.W, config.levels, config.G
        self.candidates = self.pool.candidates(self.x, G) if G else []
        # candidate rows, then the chain row; one column more than drafts, never matching (see `verify`)
        drafts = self._drafts = self._drafts_buffer[: G + 1, : levels + 1]
        drafts.fill(NO_DRAFT)
        if self.candidates:
            drafts[: len(self.candidates), :levels] = [c for c, _ in self.candidates]
        if self.switches.chain and levels > 1:
            drafts[G, : levels - 1] = self.window[1:levels, 0]
        if not self.switches.bonus:
            drafts[:, levels - 1] = NO_DRAFT
        T, n = len(tab.rel_positions), tab.window_size
        input_ids[:n].reshape(levels, W)[:] = self.window[:levels, :W]
        if G:
            np.maximum(drafts[:G, :levels], 0, out=input_ids[n:T].reshape(G, levels))  # empty rows: any valid id
        input_ids[T:] = 0
        np.add(tab.rel_positions, self.cache_len, out=positions[:T])
        positions[T:] = self.cache_len
        step_config[:] = tab.step_config
        k = len(tab.output_slots)
        output_slots[:k] = tab.output_slots
        output_slots[k:] = tab.output_slots[-1]

    def accept(self, out: np.ndarray) -> list[int]:
        """Verify against the step's outputs and return the tokens emitted (cut at a stop token or the length)."""
        tab = self._tables
        assert tab is not None, "accept() needs a prepared step"
        best, k = verify(self._drafts, out, tab.expect_index)
        self.block = [*self._drafts[best, :k].tolist(), int(out[tab.expect_index[best, k]])]
        emitted: list[int] = []
        for token in self.block:
            emitted.append(token)
            if token in self.stop_tokens or len(self.tokens) + len(emitted) == self.max_new_tokens:
                break
        self.tokens.extend(emitted)
        self.emitted = emitted
        stats = self.stats
        stats.steps += 1
        stats.generated_tokens = len(self.tokens)
        stats.accepted_histogram[len(emitted)] += 1
        stats.configs[tab.config.label] += 1
        if k:
            stats.sources[CHAIN if best == tab.config.G else self.candidates[best][1]] += min(k, len(emitted))
        self.finished = (
            len(emitted) < len(self.block)
            or emitted[-1] in self.stop_tokens
            or len(self.tokens) == self.max_new_tokens
        )
        self.commit_slots = tab.expect_index[best, : k + 1]  # x_t, then the accepted drafts' slots
        return emitted

    def update(self, out: np.ndarray) -> None:
        """After the commit: harvest and shift the window columns this step used, extend the sequence and the pool."""
        tab, cfg = self._tables, self.config
        assert tab is not None, "update() needs an accepted step"
        self.cache_len += len(self.commit_slots)
        self.x = self.block[-1]
        if tab.config.N == cfg.N:  # a greedy step under a larger N uses no window column
            W, window = tab.config.W, self.window
            newest = out[tab.newest_slots]
            if cfg.G:  # one n-gram per column: (B0[j], .., B_{N-2}[j], newest[j]), keyed by B0[j]
                insert = self.pool.insert
                for column, last in zip(window[:, :W].T.tolist(), newest.tolist(), strict=True):
                    insert(column[0], (*column[1:], last), WINDOW)
            window[:-1, :W] = window[1:, :W]
            window[-1, :W] = newest
            if self.stop_tokens:
                self._replace_stop_tokens(window[-1, 1:W] if cfg.N == 2 else window[-1, :W])
        self.window[0, 0] = self.x
        before = len(self.sequence)
        self.sequence.extend(self.block)
        if self.switches.prompt_pool and cfg.G:
            self.pool.insert_sequence(self.sequence, OUTPUT, start=before)
        self._tables = None

    def _replace_stop_tokens(self, level: np.ndarray) -> None:
        """Stop tokens in the newest level poison the window: swap them for random prompt tokens (in place)."""
        for i, token in enumerate(level.tolist()):
            if token in self.stop_tokens:
                level[i] = self.fillers[self.rng.integers(len(self.fillers))]


@dataclass
class Row:
    """One request in one step: its KV slot, its decoder, and the config this step uses."""

    slot: int
    decoder: RequestDecoder
    config: LookaheadConfig


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
        self.executor_seconds = 0.0  # inside executor.step / commit, over the stepper's life

    def run(self, rows: Sequence[Row]) -> list[BaseException | None]:
        """One step for `rows` (distinct slots). Returns per row None, or the error that ended that request.

        An error in one request's host code (prepare, accept, commit, update) ends that row only; a failing
        executor step ends the rows of the step. Each decoder's executor_seconds counts the whole step.
        """
        errors: list[BaseException | None] = [None] * len(rows)
        T = max(row.config.step_tokens for row in rows)
        K = max(len(step_tables(row.config).output_slots) for row in rows)
        live: list[int] = []
        for i, row in enumerate(rows):
            b = len(live)
            try:
                row.decoder.prepare(
                    row.config, self._ids[b, :T], self._positions[b, :T], self._config[b], self._outputs[b, :K]
                )
            except Exception as exc:
                errors[i] = exc
                continue
            self._slots[b] = row.slot
            live.append(i)
        if not live:
            return errors
        B = len(live)
        batch = StepBatch(
            self._slots[:B], self._ids[:B, :T], self._positions[:B, :T], self._config[:B], self._outputs[:B, :K]
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
                row.decoder.accept(out[b])
                if not row.decoder.finished:
                    start = time.perf_counter()
                    self.executor.commit(row.slot, row.decoder.commit_slots)
                    seconds += time.perf_counter() - start
                    row.decoder.update(out[b])
            except Exception as exc:
                errors[i] = exc
        for i in live:
            rows[i].decoder.stats.executor_seconds += seconds
        self.executor_seconds += seconds
        return errors


class LookaheadDecoder:
    """Drives one request at a time on slot 0 of `executor` at one config; `switches` exist for ablations."""

    def __init__(
        self,
        executor: Executor,
        layout: StepLayout | LookaheadConfig,
        *,
        stop_tokens: Iterable[int] = (),
        seed: int = 0,
        switches: Switches = Switches(),
    ) -> None:
        self.layout = layout if isinstance(layout, StepLayout) else StepLayout(layout)
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
        request = RequestDecoder(self.config, prompt, max_new_tokens, self.stop_tokens, self.seed, self.switches)
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
