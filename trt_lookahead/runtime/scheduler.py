"""In-flight batching: one thread owns the executor and runs every admitted request in every step.

    scheduler = Scheduler(executor, policy, max_queue=64); scheduler.start()
    handle = scheduler.submit(Job(decoder, lookahead, sampling))   # QueueFull when the queue is full
    for block in handle: ...                                          # token blocks as steps accept them
    handle.cancel()                                   # waiting: leaves the queue now; running: at the next step

A waiting request that is cancelled leaves the queue at once, in the cancelling thread, and ends there: the
queue (max_queue, `waiting`) only counts requests someone still waits for. Each iteration (`run_once`):
cancelled running requests leave and free their slot; waiting requests are admitted in arrival order into
free slots; the policy picks each decoding request's config for the step; one BatchStepper step runs every
active request; finished, failed and cancelled requests release their slot at once. How an admitted
request's prompt is prefilled (`prefill`):
  separate   executor.prefill, one request after another before the step: every other request waits for
             the whole prompt
  chunked    executor.claim, then one causal row of the next `prefill_chunk` prompt tokens in each step,
             beside the other requests' decode rows (lookahead/executor.py); the last chunk's output is the
             first token. A prefilling request holds its slot, is in every step and can be cancelled.
An exception in one request's host code (prefill, setup, prepare, verify, harvest) fails that request
only, its handle raising it; a failing executor step fails the requests of that step only. Blocks are
buffered per request, so a slow or absent consumer never stalls the loop, and handed over while the next
step's executor runs, or the next separate prefill (so of requests joining together each gets its first token
while the next prompt runs, not after the last), or at once when no step follows: a consumer woken earlier
would contend for the GIL with the step's host work. Admission is FIFO and every admitted request is in every
step: no request starves. See docs/design.md section 9.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import Lookahead
from trt_lookahead.lookahead.decoder import DecodeStats, RequestDecoder
from trt_lookahead.lookahead.executor import Executor, priced_tokens
from trt_lookahead.lookahead.policy import LookaheadPolicy, RequestState
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.lookahead.stepper import CHUNKED, SEPARATE, BatchStepper, Prefill, PrefillChunk, Row, StepRow

CANCELLED = "cancelled"
STEP_LOG = 4096  # steps kept in Scheduler.steps
_END = object()  # the last item of a request's queue: its Result is set


class QueueFull(UserError):
    """The waiting queue is full: the message names the limit and the fix."""


class SchedulerClosed(RuntimeError):
    """The scheduler was closed before the request finished."""


@dataclass
class Job:
    """A request as the scheduler runs it: its decoder (prompt, limits, stop tokens, largest config) and its
    lookahead choice as the runtime narrowed it (`auto`: the policy chooses each step up to decoder.config)."""

    decoder: RequestDecoder
    lookahead: Lookahead
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Result:
    token_ids: list[int]
    finish_reason: str  # "stop", "length" or "cancelled"
    stats: DecodeStats


class RequestHandle:
    """The caller's side of one request: its token blocks (or its error) in order, and cancel()."""

    def __init__(self, request: Job, loop: asyncio.AbstractEventLoop | None,
                 withdraw: Callable[[RequestHandle], None], outbox: list[tuple[RequestHandle, Any]]) -> None:
        self.request = request
        self.result: Result | None = None
        self.policy_state: RequestState | None = None
        self.slot: int | None = None
        self._dequeued = threading.Event()  # set when it leaves the queue: admitted, withdrawn or closed
        self.chunk = 0  # while its prompt is prefilled in steps: tokens per chunk (0: prefilled, or separately)
        self.prefilled = 0  # prompt tokens committed by those chunks
        self._loop = loop
        self._queue: Any = queue.SimpleQueue() if loop is None else asyncio.Queue()
        self._cancelled = threading.Event()
        self._withdraw = withdraw
        self._outbox = outbox

    # -- the scheduler's side -----------------------------------------------------------------------

    def _put(self, item: Any) -> None:
        """Queue `item` for the consumer; the scheduler hands it over while its next step runs (`_deliver`)."""
        self._outbox.append((self, item))

    def _hand_over(self, item: Any) -> None:
        if self._loop is None:
            self._queue.put(item)
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody listens any more
            self._cancelled.set()

    def _finish(self, reason: str, now: bool = False) -> None:
        """Set the result and send the end mark: queued for `_deliver`, or handed over `now` (off the loop)."""
        d = self.request.decoder
        self.result = Result(list(d.tokens), reason, d.stats)
        if now:
            self._hand_over(_END)
        else:
            self._put(_END)

    # -- the caller's side --------------------------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def wait_dequeued(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the request to leave the queue (admitted, cancelled or closed): no block
        comes before then, so a consumer can watch meanwhile for a reason to cancel. False if it still waits."""
        return self._dequeued.wait(timeout)

    def cancel(self) -> None:
        """Waiting: leave the queue and end now. Running: stop at the next step boundary, freeing the slot.
        Idempotent; safe from any thread."""
        self._cancelled.set()
        self._withdraw(self)

    def __iter__(self) -> Iterator[list[int]]:
        if self._loop is not None:
            raise TypeError("this request was submitted for asyncio: use `async for`")
        while (item := self._queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def drain(self) -> None:
        """Wait until the request has left the scheduler, dropping what it still sends (blocks or an error)."""
        while self.result is None and not _last(self._queue.get()):
            pass

    async def adrain(self) -> None:
        """`drain` for a request submitted for asyncio."""
        while self.result is None and not _last(await self._queue.get()):
            pass

    async def __aiter__(self) -> AsyncIterator[list[int]]:
        if self._loop is None:
            raise TypeError("this request was submitted for threads: use `for`")
        while (item := await self._queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item


def _last(item: Any) -> bool:
    """Whether `item` is the last a request's queue gets: the end mark or its error."""
    return item is _END or isinstance(item, BaseException)


@dataclass(frozen=True)
class StepRecord:
    """One decode step: its rows, real tokens (M), and where its time went (seconds)."""

    rows: int
    tokens: int
    executor_seconds: float
    host_seconds: float
    prefill_rows: int = 0  # of `rows`, chunks of prompts (their tokens are in `tokens`)


@dataclass
class SchedulerStats:
    steps: int = 0
    rows: int = 0  # requests in steps, summed over steps
    admitted: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    prefill_chunks: int = 0
    prefill_seconds: float = 0.0  # in executor.prefill (separate prefill; chunks are timed in step_seconds)
    step_seconds: float = 0.0  # wall time of the decode steps: host work and executor
    executor_seconds: float = 0.0  # inside executor.step / commit

    @property
    def host_ms_per_row(self) -> float:
        """Host milliseconds per request per decode step: policy, prepare, verify, harvest, delivery."""
        return 1000.0 * (self.step_seconds - self.executor_seconds) / self.rows if self.rows else 0.0

    @property
    def mean_rows(self) -> float:
        return self.rows / self.steps if self.steps else 0.0


def prefill_chunk(executor: Executor, prefill: Prefill) -> int:
    """Prompt tokens per chunk for `prefill` (0: separate); UserError for anything else.

    CHUNKED is the executor's step_tokens: the padded executors (engines, CUDA torch) pay B x T a step, and
    a chunk then widens a step no further than the engine's own lookahead rows do; the packed CPU torch
    executor pays only real tokens. The size is fixed per scheduler, never taken from what shares the step,
    so a prompt's chunk boundaries, and the float bits of its KV, are the same alone or batched.
    """
    if prefill == SEPARATE:
        return 0
    if prefill == CHUNKED:
        return executor.step_tokens
    if isinstance(prefill, bool) or not isinstance(prefill, int) or not 1 <= prefill <= executor.step_tokens:
        raise UserError(f"prefill must be {SEPARATE!r}, {CHUNKED!r} or a chunk of 1 .. {executor.step_tokens} "
                        f"tokens (the executor's step_tokens), got {prefill!r}")
    return prefill


def default_prefill() -> Prefill:
    """The prefill a runtime uses unless asked (the one place it is decided): separate, on every backend.

    A padded step of B rows (engines, CUDA torch) pays B x T for one chunk row, so chunked prefill widens every
    step it shares (docs/design.md section 9; figures: docs/results/2026-11-24-cpu.md, "Separate or chunked
    prefill"). The packed CPU torch executor pays only real tokens but is not measured yet, so it keeps separate too.
    """
    return SEPARATE


class Scheduler:
    """See the module docstring. `start()` runs the loop in a daemon thread; `run_once()` is one iteration."""

    def __init__(
        self, executor: Executor, policy: LookaheadPolicy, max_queue: int = 64, prefill: Prefill = SEPARATE
    ) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise UserError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.executor = executor
        self.policy = policy
        self.max_queue = max_queue
        self._chunk = prefill_chunk(executor, prefill)
        self._prefill = prefill
        self.stats = SchedulerStats()
        self._stepper = BatchStepper(executor)
        self.steps: deque[StepRecord] = deque(maxlen=STEP_LOG)  # the latest steps (tuning measures from them)
        self._waiting: deque[RequestHandle] = deque()
        self._active: dict[int, RequestHandle] = {}  # slot -> request, in admission order
        self._free = list(range(executor.max_batch))
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        # items for consumers, handed over while the executor runs: consumers woken earlier would take the
        # GIL from the host phase of the step (measured: +30-40 us per request-step at batch 8)
        self._outbox: list[tuple[RequestHandle, Any]] = []

    # -- callers ------------------------------------------------------------------------------------

    def submit(self, request: Job, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Queue a request (blocks go to `loop`'s asyncio queue if given); QueueFull if the queue is full."""
        return self.submit_many([request], loop)[0]

    def submit_many(
        self, requests: Sequence[Job], loop: asyncio.AbstractEventLoop | None = None
    ) -> list[RequestHandle]:
        """Queue requests together (admitted in the same iteration when slots allow); all or none."""
        handles = [RequestHandle(request, loop, self._withdraw, self._outbox) for request in requests]
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the runtime is closed; create a new one")
            if len(self._waiting) + len(handles) > self.max_queue + len(self._free):
                raise QueueFull(
                    f"the waiting queue is full: {len(self._waiting)} requests wait for the "
                    f"{self.executor.max_batch} slots (max_queue={self.max_queue}); retry later, or raise "
                    "max_queue or max_batch"
                )
            self._waiting.extend(handles)
            self._cond.notify()
        return handles

    def start(self) -> None:
        with self._cond:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._loop, name="trt-lookahead-scheduler", daemon=True)
                self._thread.start()

    def close(self) -> None:
        """Stop the loop; requests still waiting or running end with SchedulerClosed, their slots released."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        error = SchedulerClosed("the runtime was closed before this request finished")
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for handle in waiting:
            handle._dequeued.set()
            handle._put(error)
        for slot in list(self._active):
            self._end(slot, error=error)
        self._deliver()

    @property
    def prefill(self) -> Prefill:
        return self._prefill

    @prefill.setter
    def prefill(self, prefill: Prefill) -> None:
        """How requests admitted from now on are prefilled (those prefilling in chunks finish as they began)."""
        self._chunk, self._prefill = prefill_chunk(self.executor, prefill), prefill

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._waiting and not self._active

    @property
    def free_slots(self) -> int:
        with self._cond:
            return len(self._free)

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    # -- the loop -----------------------------------------------------------------------------------

    def _withdraw(self, handle: RequestHandle) -> None:
        """`handle.cancel()`: a waiting request leaves the queue now and its consumer is told at once (the
        outbox belongs to the loop, so the end is handed over here); else wake the loop, which ends a running
        request at its next step. Under the lock, exactly one of this and admission takes a waiting request."""
        with self._cond:
            try:
                self._waiting.remove(handle)
            except ValueError:  # admitted (or ended, or taken by close): the loop or close ends it
                self._cond.notify()
                return
            handle._dequeued.set()
            self.stats.cancelled += 1
        handle._finish(CANCELLED, now=True)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not self._active:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                self.run_once()
            except Exception as exc:  # a bug in the loop itself: end what runs, keep serving
                for slot in list(self._active):
                    self._end(slot, error=exc)
                self._deliver()

    def run_once(self) -> bool:
        """One iteration: leave, admit, step. False if there was nothing to do."""
        for slot, handle in list(self._active.items()):
            if handle.cancelled:
                self._end(slot, reason=CANCELLED)
        admitted: list[RequestHandle] = []
        with self._cond:
            while self._waiting and self._free:
                handle = self._waiting.popleft()
                handle._dequeued.set()
                if handle.cancelled:
                    self.stats.cancelled += 1
                    handle._finish(CANCELLED)
                    continue
                handle.slot = self._free.pop(0)
                self._active[handle.slot] = handle
                admitted.append(handle)
        for handle in admitted:
            self._admit(handle)
        if self._active:
            self._step()
        if not self._active:  # no step runs next: hand over now
            self._deliver()
        return bool(admitted or self._active)

    def _deliver(self) -> None:
        """Hand the queued blocks, ends and errors to their consumers."""
        outbox, self._outbox[:] = self._outbox[:], []
        for handle, item in outbox:
            handle._hand_over(item)

    def _admit(self, handle: RequestHandle) -> None:
        """Prefill the request now (separate), or claim its slot for chunks in the coming steps (chunked)."""
        request, slot = handle.request, handle.slot
        assert slot is not None
        decoder = request.decoder
        self.stats.admitted += 1
        try:
            if self._chunk:
                self.executor.claim(slot, request.sampling)
                handle.chunk, handle.prefilled = self._chunk, 0
                return
            # what is queued (the first token of a request prefilled just before this one) is handed over while
            # this prompt runs, off the GIL: joining requests do not all wait for the last one's prefill
            self._deliver()
            start = time.perf_counter()
            first = self.executor.prefill(slot, decoder.prompt, request.sampling)
            decoder.stats.prefill_seconds = seconds = time.perf_counter() - start
            self.stats.prefill_seconds += seconds
        except Exception as exc:  # this request's prefill failed: it alone ends
            self._end(slot, error=exc)
            return
        self._start(handle, first)

    def _start(self, handle: RequestHandle, first: int) -> None:
        """The prompt is in the cache: emit its first token and start decoding."""
        request, slot = handle.request, handle.slot
        assert slot is not None
        decoder = request.decoder
        try:
            block = decoder.setup(first)
            handle.policy_state = self.policy.start(request.lookahead)
        except Exception as exc:  # this request's setup failed: it alone ends
            self._end(slot, error=exc)
            return
        handle._put(block)
        if decoder.finished:
            self._end(slot, reason=decoder.finish_reason)

    def _step(self) -> None:
        start = time.perf_counter()
        chunks: list[PrefillChunk] = []
        slots, handles, states, supplies = [], [], [], []
        for slot, handle in list(self._active.items()):
            if handle.chunk:
                prompt = handle.request.decoder.prompt
                tokens = min(handle.chunk, len(prompt) - handle.prefilled)
                chunks.append(PrefillChunk(slot, prompt, handle.prefilled, tokens))
                continue
            try:
                supply = handle.request.decoder.draft_supply() if handle.request.lookahead.auto else 0
            except Exception as exc:  # this request's host state is broken: it alone ends
                self._end(slot, error=exc)
                continue
            assert handle.policy_state is not None
            slots.append(slot)
            handles.append(handle)
            states.append(handle.policy_state)
            supplies.append(supply)
        try:
            configs = self.policy.choose(states, supplies, self.executor.pads_rows) if states else []
        except Exception as exc:  # no decode step can run without configs: those requests end
            for slot in slots:
                self._end(slot, error=exc)
            slots, handles, configs = [], [], []
        decoding = [Row(s, h.request.decoder, c) for s, h, c in zip(slots, handles, configs, strict=True)]
        rows: list[StepRow] = [*chunks, *decoding]
        if not rows:
            return
        before = self._stepper.executor_seconds
        errors = self._stepper.run(rows, self._deliver)
        seconds = time.perf_counter() - start
        executor_seconds = self._stepper.executor_seconds - before
        self.stats.steps += 1
        self.stats.rows += len(rows)
        self.stats.prefill_chunks += len(chunks)
        self.stats.step_seconds += seconds
        self.stats.executor_seconds += executor_seconds
        tokens = sum(chunk.tokens for chunk in chunks) + sum(c.step_tokens for c in configs)
        self.steps.append(StepRecord(len(rows), tokens, executor_seconds, seconds - executor_seconds, len(chunks)))
        if not chunks and all(e is None for e in errors):  # wall time, as tune measures c(M, B); not prompts' chunks
            priced = priced_tokens([c.step_tokens for c in configs], self.executor.pads_rows)
            self.policy.observe_step(priced, len(rows), seconds)
        for chunk, error in zip(chunks, errors[: len(chunks)], strict=True):
            self._chunk_done(chunk, seconds, error)
        for row, handle, error in zip(decoding, handles, errors[len(chunks) :], strict=True):
            decoder = row.decoder
            decoder.stats.decode_seconds += seconds
            if error is not None:
                self._end(row.slot, error=error)
                continue
            handle._put(decoder.emitted)
            if decoder.finished:
                self._end(row.slot, reason=decoder.finish_reason)
            else:
                self.policy.observe(handle.policy_state, row.config, len(decoder.emitted))  # type: ignore[arg-type]

    def _chunk_done(self, chunk: PrefillChunk, seconds: float, error: BaseException | None) -> None:
        """After the step: the chunk is committed; the last one starts the request (its step counts as prefill)."""
        handle = self._active[chunk.slot]
        handle.request.decoder.stats.prefill_seconds += seconds
        if error is not None:
            self._end(chunk.slot, error=error)
            return
        handle.prefilled = chunk.start + chunk.tokens
        if chunk.first is not None:
            handle.chunk = 0
            self._start(handle, chunk.first)

    def _end(self, slot: int, reason: str = "", error: BaseException | None = None) -> None:
        """The request in `slot` leaves: release the slot, tell its consumer."""
        handle = self._active.pop(slot)
        try:
            self.executor.release(slot)
        except Exception as exc:  # a broken executor (a lost tensor-parallel rank): the request still ends, told why
            error = error if error is not None else exc
        finally:
            with self._cond:  # the counts too: `_withdraw` counts cancellations from other threads
                self._free.append(slot)
                self._free.sort()
                self.stats.failed += error is not None
                self.stats.cancelled += error is None and reason == CANCELLED
                self.stats.finished += error is None and reason != CANCELLED
        if error is not None:
            handle._put(error)
        else:
            handle._finish(reason)
