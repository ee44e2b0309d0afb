"""LookaheadRuntime: a model (or engine dir), its tokenizer and one batched executor, behind generate() and
stream() from any number of threads, and astream() / agenerate() for asyncio.

    rt = LookaheadRuntime.from_pretrained("smollm2-135m-instruct", lookahead="auto", max_batch=8)
    out = rt.generate([{"role": "user", "content": "Hi"}], max_new_tokens=64)
    for chunk in rt.stream("def fib(n):", max_new_tokens=64): print(chunk.text, end="")
    async for chunk in rt.astream("def fib(n):", max_new_tokens=64): ...

One copy of the weights and one executor whose KV cache holds max_batch request slots; one scheduler
thread (runtime/scheduler.py) runs every request that holds a slot in every step, each with its own
config, sampling, stop tokens and length; up to max_queue more wait. A request's tokens are the same
alone or batched (docs/design.md sections 4 and 9). A request's lookahead is one `Lookahead` choice
(lookahead/config.py), narrowed here against what this runtime serves and carried unchanged to the step;
`auto` lets the load- and acceptance-aware policy (lookahead/policy.py) choose each step's config, from the
step cost and priors `trt-lookahead tune` measured on this machine (built-in priors until then; nothing is
tuned inside a request). Detokenization and stop strings run in the caller's thread; closing a
stream (or dropping it) cancels its request and frees its slot at the next step; a thread may open a
second request while its own stream is still open (both run; nothing waits for itself). See docs/design.md
sections 1.3, 5 and 9.

Every request is checked by `check_request` before any work (ValueError naming the argument). A stop
string ends the text where it starts and the token ids with the token that completes it, whatever the
block boundaries (lookahead's ids equal greedy's). The streamed chunks add up to the final text, except
where the model emitted byte tokens that are not valid UTF-8 (random sampling at a huge temperature,
say): a byte-fallback decode renders a run of bytes as one replacement character per byte once the run
turns out invalid, even bytes that were text a moment before, so no stream can know their final form.
The final text (one decode of all ids) is the reference.
"""

from __future__ import annotations

import asyncio
import sys
import weakref
from collections.abc import AsyncIterator, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from trt_lookahead.backends.cpu_load import usable_cpus
from trt_lookahead.errors import UserError, as_int
from trt_lookahead.lookahead.config import DEFAULT, Lookahead, LookaheadConfig
from trt_lookahead.lookahead.decoder import DecodeStats, RequestDecoder, check_request
from trt_lookahead.lookahead.policy import AutoPolicy
from trt_lookahead.lookahead.pool import POOL_SCOPES, SharedPool
from trt_lookahead.lookahead.recycle import SHARED_PAIRS, SuccessorMap
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.lookahead.tree import TreeTemplate
from trt_lookahead.runtime.load import LoadedModel, auto_policy, load_model
from trt_lookahead.runtime.scheduler import Job, Prefill, RequestHandle, Scheduler, default_prefill
from trt_lookahead.runtime.text import (
    Detokenizer,
    Prompt,
    PromptTokenizer,
    check_stop_strings,
    stable_end,
    stop_string_cut,
)

DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_MAX_QUEUE = 64


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (stop token or stop string) or "length"
    config: str  # "greedy", "W/N/G", or "auto" (stats.configs: the steps per config the policy chose)
    backend: str
    dtype: str
    weights: str  # "float", or the quantized weights ("int4", "int4+int8": runtime/load.py weights_label)
    stats: DecodeStats

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def steps(self) -> int:
        return self.stats.steps

    @property
    def compression(self) -> float:
        return self.stats.compression

    @property
    def prefill_seconds(self) -> float:
        return self.stats.prefill_seconds

    @property
    def decode_seconds(self) -> float:
        return self.stats.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.stats.tokens_per_second

    def to_dict(self) -> dict[str, Any]:
        """The `generate --json` object: text, ids and the measures of docs/design.md section 8."""
        stats = self.stats.to_dict()
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "steps": self.steps,
            "compression": stats["compression"],
            "prefill_seconds": stats["prefill_seconds"],
            "decode_seconds": stats["decode_seconds"],
            "tokens_per_second": stats["tokens_per_second"],
            "config": self.config,
            "backend": self.backend,
            "dtype": self.dtype,
            "weights": self.weights,
            "finish_reason": self.finish_reason,
            "host_ms_per_step": stats["host_ms_per_step"],
            "accepted_histogram": stats["accepted_histogram"],
            "sources": stats["sources"],
            "configs": stats["configs"],
        }


@dataclass(frozen=True)
class Request:
    """One checked request: what `stream` submits (made by `LookaheadRuntime.check_request`)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    lookahead: Lookahead  # narrowed: greedy, a config every step, or `auto` up to its ceiling
    stop: tuple[str, ...]  # non-empty stop strings
    pool_scope: str = "shared"  # "shared": reads and feeds the runtime's SharedPool; "request": its own pool only


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # new token ids since the previous chunk
    done: bool = False
    output: GenerationOutput | None = None  # set on the last chunk


class _TextStream:
    """One request's blocks turned into StreamChunks: text, stop strings, held-back text, the final output.

    A chunk's work does not grow with the text so far: stop strings are searched for only where a new one can
    start (the text is only ever extended), and the held-back tail is at most the longest stop string."""

    def __init__(self, runtime: LookaheadRuntime, request: Request, handle: RequestHandle) -> None:
        self.runtime, self.request, self.handle = runtime, request, handle
        self.detokenizer = Detokenizer(runtime.decode)
        self.emitted = 0  # characters of text already sent
        self.searched = 0  # characters of text searched for stop strings (none found)
        self.overlap = max((len(s) for s in request.stop), default=1) - 1  # a stop may start this far back
        self.finish = "length"
        self.stopped = False  # a stop string ended the text

    def push(self, block: list[int]) -> StreamChunk:
        stops = self.request.stop
        text = self.detokenizer.push(block)
        cut = stop_string_cut(text, stops, max(self.searched - self.overlap, 0))
        self.searched = len(text)
        if cut is not None:
            block = self._end_at_stop_string(len(block))
            text, self.stopped = text[:cut], True
        if self.stopped or block[-1] in self.runtime.stop_token_ids:
            self.finish = "stop"
        end = len(text) if self.finish == "stop" else stable_end(text, stops)
        chunk = StreamChunk(text[self.emitted : end], block)
        self.emitted = max(self.emitted, end)
        return chunk

    def _end_at_stop_string(self, block_len: int) -> list[int]:
        """Drop the ids after the one that completes a stop string; returns the block's kept ids.

        The stop string appeared within the last `block_len` ids, so the shortest prefix whose text holds
        it ends inside this block: that is where one-token-per-step decoding would have stopped.
        """
        ids, stops = self.detokenizer.ids, self.request.stop
        start = len(ids) - block_len
        decode = self.runtime.decode
        end = next((n for n in range(start + 1, len(ids)) if stop_string_cut(decode(ids[:n]), stops) is not None),
                   len(ids))
        del ids[end:]
        return ids[start:]

    def final(self) -> StreamChunk:
        """The last chunk; the request has left the scheduler (its stats no longer change)."""
        ids = self.detokenizer.ids
        stats = self.handle.request.decoder.stats
        stats.generated_tokens = len(ids)  # a stop string may end the output inside a block
        text = self.runtime.decode(ids)  # once in full: the final text never depends on block boundaries
        cut = stop_string_cut(text, self.request.stop)
        text = text if cut is None else text[:cut]
        output = GenerationOutput(
            text=text,
            token_ids=ids,
            prompt_tokens=len(self.request.prompt_ids),
            finish_reason=self.finish,
            config=self.request.lookahead.label,
            backend=self.runtime.backend,
            dtype=self.runtime.dtype,
            weights=self.runtime.weights,
            stats=stats,
        )
        return StreamChunk(text[self.emitted :], [], done=True, output=output)


class ChunkStream(Iterator[StreamChunk]):
    """What `stream` returns: its chunks, and close(). Closing it, or dropping it, cancels the request at once
    if it still waits for a slot (else at the next step), even before the first next(): a bare generator
    runs no cleanup until it has started, so its request would run to the end holding a slot."""

    def __init__(self, chunks: Generator[StreamChunk, None, None], request: Request, handle: RequestHandle) -> None:
        self._chunks = chunks
        self.request = request  # as checked: its prompt_ids, limits and stop strings
        self.handle = handle  # the scheduler's side: its result once the request has left
        self._cancel = weakref.finalize(self, handle.cancel)  # holds the handle, not this stream
        self._cancel.atexit = False

    def __next__(self) -> StreamChunk:
        return next(self._chunks)

    def close(self) -> None:
        """Stop reading: the request is cancelled (a no-op once it has finished)."""
        self._chunks.close()
        self._cancel()


def _close(scheduler: Scheduler, executor: Any) -> None:
    """Stop the scheduler, then an executor that holds processes (backends/tensor_parallel.py LeaderExecutor)."""
    scheduler.close()
    close = getattr(executor, "close", None)
    if close is not None:
        close()


class LookaheadRuntime:
    """Tokenizer + one batched executor + its scheduler; `lookahead` is the choice of a request that names none."""

    def __init__(
        self,
        model: LoadedModel,
        *,
        lookahead: Lookahead,
        auto: AutoPolicy,
        max_queue: int = DEFAULT_MAX_QUEUE,
        pool_scope: str = "shared",
        prefill: Prefill | None = None,
    ) -> None:
        """A runtime over what `load_model` loaded, fully configured: `lookahead` (narrowed here: it must fit the
        executor), `auto` (what `auto` requests run on), the widest pool scope a request may use, the prefill."""
        self.model = model
        self.tokenizer = model.tokenizer
        self.executor = model.executor
        self.text = PromptTokenizer(model.tokenizer, model.max_seq_len, model.model_path)
        self.exact = bool(getattr(model.executor, "exact", False))  # row-invariant steps (docs/design.md 4.2)
        self.max_seq_len = model.max_seq_len
        self.stop_token_ids = list(dict.fromkeys(int(t) for t in model.stop_token_ids))
        self.backend = model.backend
        self.dtype = model.dtype
        self.weights = model.weights or "float"  # as GenerationOutput.weights
        self.model_path = model.model_path
        self.max_lookahead = model.max_lookahead  # an engine's built config: requests must fit inside it
        self.auto = auto
        self.pool_scope = check_pool_scope(pool_scope)  # the widest scope a request may use
        self.lookahead = self._fit(lookahead)  # the default must fit this executor (said by from_pretrained)
        self.shared_pool = SharedPool()  # touched only by the scheduler thread (decoders' setup/prepare/harvest)
        self.tree: TreeTemplate | None = getattr(model.executor, "tree", None)  # the executor's draft tree template
        # recycled top-k of the shared scope's tree requests (scheduler thread)
        self.successors = SuccessorMap(pairs=SHARED_PAIRS)
        prefill = default_prefill() if prefill is None else prefill
        self.scheduler = Scheduler(model.executor, auto.policy, max_queue, prefill)
        self.scheduler.start()
        # a runtime dropped without close() still stops its thread and frees its KV cache (and, tensor-parallel,
        # its other ranks: after the scheduler, whose last releases they still follow)
        self._finalizer = weakref.finalize(self, _close, self.scheduler, model.executor)

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | Path,
        backend: str | None = None,
        dtype: str = "float32",
        lookahead: Lookahead | LookaheadConfig | str | None = None,
        max_seq_len: int | None = None,
        threads: int | None = None,
        max_batch: int | None = None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        tuning_file: str | Path | None = None,
        verify: bool = True,
        exact: bool | None = None,
        pool_scope: str = "shared",
        prefill: Prefill | None = None,
        tree: str | TreeTemplate | None = DEFAULT,
        compile: bool = False,
        attention: str = "sdpa",
        device: str | None = None,
        weights: str = "float",
        activations: str | None = None,
        tensor_parallel: int = 1,
    ) -> LookaheadRuntime:
        """Load a HF Llama checkpoint dir, a known model name, or an engine dir from `trt-lookahead build`.

        lookahead: what a request that names none runs: None, "default" or "auto" (the default: the policy
        chooses each step, up to an engine dir's built config, from the tuning entry for this model, dtype, backend
        and machine in `tuning_file`, default the cache's tuning.json; without one, on built-in priors, said once on
        stderr: `trt-lookahead tune` measures them), "greedy", W,N,G text or a LookaheadConfig (that config every
        step). max_batch: request slots (default 8; an engine dir's built max_batch). max_queue: requests that may
        wait for a slot before `QueueFull`. threads: torch's CPU threads, a setting of the whole process
        (torch.set_num_threads). verify: check an engine dir's files against their checksums. exact: run the
        row-invariant step (a
        token's logits are bit-identical alone, batched and in greedy decoding; docs/design.md section 4.2);
        default: on where it is cheap (bfloat16 on the torch executor, CPU and CUDA; backends/torch.py
        EXACT_BY_DEFAULT). pool_scope: "shared" (requests read and feed one bounded n-gram pool; README "Shared
        n-gram pool") or "request" (no sharing). prefill: how a joining request's prompt is prefilled,
        "separate", "chunked" or a chunk size (runtime/scheduler.py); default `default_prefill`. tree: the
        verification branch as a draft tree (docs/design.md 2.7, 3.9): "default" (an engine dir's built tree; for
        a checkpoint "auto"), "auto" (a template for the G(N-1) slots of `engine_cover`), a parent list, or
        None/"off" (G linear candidates); requests with a smaller G(N-1) use its first nodes. compile: the torch
        executor's padded step under torch.compile (experimental, not yet the default: unmeasured on a GPU; each
        batch bucket and step width compiles once, on its first step; backends/torch.py). attention: the torch
        executor's fast padded step's attention, "sdpa" or "triton" (experimental, unmeasured on a GPU; the fast
        step, so not exact; backends/torch.py ATTENTIONS). device: where a checkpoint runs, "cpu" or "cuda"
        (default: CUDA where this process sees a GPU, else the CPU; an engine dir runs where its backend does).
        weights, activations: a checkpoint's projections quantized as `trt-lookahead build --weights int8|int4
        --activations float|int8` quantizes them (activations None: int8 for quantized weights), on its cached
        onnxruntime engine on the CPU; on CUDA the torch executor holds them in the same blocks and multiplies
        float activations, each weight dequantized inside its product (docs/design.md 6.9; an engine dir's are
        its build's). tensor_parallel: ranks a checkpoint's model is sharded over (docs/design.md 5.3; the CPU torch
        executor on float weights for now): this process is rank 0 and starts the others as processes, stopped by
        `close`; torch's threads are shared out between the ranks.
        """
        choice = _default_choice(lookahead)
        check_pool_scope(pool_scope)
        if threads is not None:
            _set_threads(threads)
        asked = None if choice is None or choice.auto else choice.ceiling
        model = load_model(path_or_name, backend=backend, dtype=dtype, asked=asked, max_seq_len=max_seq_len,
                           max_batch=max_batch, verify=verify, exact=exact, tree=tree, compile=compile,
                           attention=attention, device=device, weights=weights, activations=activations,
                           tensor_parallel=tensor_parallel)
        # the priors are said on stderr where `auto` was asked for by name, not for the default
        auto = auto_policy(model, tuning_file, announce=choice is not None and choice.auto)
        # nothing to undo if this raises: the scheduler thread starts last, once every argument is checked
        runtime = cls(model, lookahead=choice or Lookahead(None, auto=True), auto=auto, max_queue=max_queue,
                      pool_scope=pool_scope, prefill=prefill)
        if model.why is not None:  # a checkpoint: which backend runs it and why, once (stderr, beside a build's)
            print(f"trt-lookahead: {model.model_path.name} runs on {model.backend} ({model.why})", file=sys.stderr,
                  flush=True)
        return runtime

    @property
    def max_batch(self) -> int:
        return self.executor.max_batch

    @property
    def vocab_size(self) -> int:
        return self.executor.vocab_size

    def close(self) -> None:
        """Stop the scheduler; requests still running end with an error. The runtime cannot generate afterwards."""
        self._finalizer()

    def __enter__(self) -> LookaheadRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------------

    @property
    def token_chars(self) -> int | None:
        """The most characters of normalized text one token covers (None: no bound known; text.token_chars)."""
        return self.text.token_chars

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids of a text prompt, of chat messages (chat template), or the ids themselves; a prompt that
        cannot fit max_seq_len is refused before tokenizing (UserError). See text.PromptTokenizer."""
        return self.text.encode(prompt, chat)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.text.decode(token_ids)

    def narrow(self, lookahead: Lookahead) -> Lookahead:
        """`lookahead` as this runtime runs it (UserError if it cannot): `auto` up to the tuned ceiling, a config
        within the engine's built config and the executor's step."""
        if lookahead.auto:
            self.auto.announce()  # built-in priors: said once per runtime (lookahead/policy.py AutoPolicy)
        return self._fit(lookahead)

    def _fit(self, lookahead: Lookahead) -> Lookahead:
        """`narrow` without a word on stderr."""
        try:
            return lookahead.narrow(self.auto.ceiling, self.max_lookahead, self.executor.step_tokens)
        except ValueError as exc:
            raise UserError(str(exc)) from None

    def check_request(
        self,
        prompt: Prompt,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: str | Sequence[str] | None = None,
        lookahead: Lookahead | LookaheadConfig | str | None = None,
        chat: bool = False,
        pool_scope: str | None = None,
    ) -> Request:
        """Check every argument of a request (ValueError naming it) before any work; `stream` runs the result.

        lookahead: None (the runtime's `lookahead`), "greedy", "auto", W,N,G text, a LookaheadConfig or a
        Lookahead. pool_scope: None (the runtime's), "shared" or "request"; it can only narrow the runtime's scope.
        """
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        choice = self.lookahead if lookahead is None else self.narrow(_parse_lookahead(lookahead))
        prompt_ids = self.encode(prompt, chat=chat)
        check_request(prompt_ids, max_new_tokens, self.executor.vocab_size, self.max_seq_len)
        scope = self.pool_scope if pool_scope is None else check_pool_scope(pool_scope)
        scope = "request" if "request" in (scope, self.pool_scope) else scope
        return Request(prompt_ids, int(max_new_tokens), sampling, choice, check_stop_strings(stop), scope)

    def submit(
        self, requests: Sequence[Request], loop: asyncio.AbstractEventLoop | None = None
    ) -> list[RequestHandle]:
        """Queue checked requests together on the scheduler (QueueFull if they do not fit in the queue)."""
        jobs = [
            Job(
                RequestDecoder(r.lookahead.ceiling, r.prompt_ids, r.max_new_tokens, self.stop_token_ids,
                               r.sampling.seed, tree=self.tree,
                               shared=self.shared_pool if r.pool_scope == "shared" else None,
                               successors=self.successors if r.pool_scope == "shared" else None),
                r.lookahead,
                r.sampling,
            )
            for r in requests
        ]
        return self.scheduler.submit_many(jobs, loop)

    def generate(self, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **kwargs: Any) -> GenerationOutput:
        """Generate to completion; same arguments as `check_request`. Safe from any number of threads."""
        for chunk in self.stream(prompt, max_new_tokens, **kwargs):
            if chunk.done:
                assert chunk.output is not None
                return chunk.output
        raise AssertionError("stream ended without a final chunk")

    def stream(self, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **kwargs: Any) -> ChunkStream:
        """Yield text as each step's tokens are accepted; the last chunk carries the GenerationOutput.

        The request is checked and queued in this call (ValueError / QueueFull now, not at the first chunk);
        closing the stream early, or dropping it, cancels it, even before its first chunk.
        """
        request = self.check_request(prompt, max_new_tokens, **kwargs)
        text = _TextStream(self, request, self.submit([request])[0])
        return ChunkStream(self._chunks(text), request, text.handle)

    def _chunks(self, text: _TextStream) -> Generator[StreamChunk, None, None]:
        try:
            for block in text.handle:
                chunk = text.push(block)
                yield chunk
                if text.stopped:
                    break
        finally:
            text.handle.cancel()  # a no-op once finished; else the slot is freed at the next step
        text.handle.drain()  # after a stop string: until the request has left (at most one step)
        yield text.final()

    async def astream(
        self, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **kwargs: Any
    ) -> AsyncIterator[StreamChunk]:
        """`stream` for asyncio: `async for chunk in rt.astream(...)`; the loop is never blocked by decoding.

        The request is checked and queued at the first chunk, so an astream never iterated runs nothing; once
        started, aclose(), a cancelled task or dropping it (the loop's async generator hook) cancels it."""
        request = self.check_request(prompt, max_new_tokens, **kwargs)
        text = _TextStream(self, request, self.submit([request], asyncio.get_running_loop())[0])
        try:
            async for block in text.handle:
                chunk = text.push(block)
                yield chunk
                if text.stopped:
                    break
        finally:
            text.handle.cancel()
        await text.handle.adrain()
        yield text.final()

    async def agenerate(
        self, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **kwargs: Any
    ) -> GenerationOutput:
        """`generate` for asyncio."""
        async for chunk in self.astream(prompt, max_new_tokens, **kwargs):
            if chunk.done:
                assert chunk.output is not None
                return chunk.output
        raise AssertionError("stream ended without a final chunk")


def check_pool_scope(scope: object) -> str:
    """"shared" or "request" (UserError otherwise)."""
    if scope not in POOL_SCOPES:
        raise UserError(f"pool_scope must be one of {', '.join(POOL_SCOPES)}, got {scope!r}")
    return cast(str, scope)


def _parse_lookahead(value: object) -> Lookahead:
    """The Python API's edge: a Lookahead, a LookaheadConfig or text (UserError naming the forms)."""
    try:
        return Lookahead.parse(value)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _default_choice(value: object) -> Lookahead | None:
    """from_pretrained's `lookahead`: None for the default (None or DEFAULT: `auto`, the fastest measured, up to
    what was loaded, without a word on stderr; docs/design.md section 9), else the choice."""
    if value is None or (isinstance(value, str) and value.strip().lower() == DEFAULT):
        return None
    return _parse_lookahead(value)


def check_threads(threads: object, name: str = "threads") -> int:
    """`threads` if in [1, the CPUs this process may run on]; else UserError naming `name`. More threads than
    CPUs only take turns, never a faster step, and onnxruntime starts thousands of them for minutes."""
    usable = usable_cpus()
    if not 1 <= as_int(name, threads) <= usable:
        raise UserError(f"{name} must be in [1, {usable}] (the CPUs this process may run on), got {threads}")
    return cast(int, threads)


def _set_threads(threads: object) -> None:
    """torch's CPU threads for this whole process (torch.set_num_threads: every runtime and model in it)."""
    import torch

    torch.set_num_threads(check_threads(threads))
