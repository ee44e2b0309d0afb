"""LookaheadRuntime: a model (or engine dir), its tokenizer and one batched executor, behind generate() and
stream() from any number of threads, and astream() / agenerate() for asyncio.

    rt = LookaheadRuntime.from_pretrained("smollm2-135m-instruct", lookahead="auto", max_batch=8)
    out = rt.generate([{"role": "user", "content": "Hi"}], max_new_tokens=64)
    for chunk in rt.stream("def fib(n):", max_new_tokens=64): print(chunk.text, end="")
    async for chunk in rt.astream("def fib(n):", max_new_tokens=64): ...

One copy of the weights and one executor whose KV cache holds max_batch request slots; one scheduler
thread (runtime/scheduler.py) runs every request that holds a slot in every step, each with its own
config, sampling, stop tokens and length; up to max_queue more wait. A request's tokens are the same
alone or batched (docs/design.md sections 4 and 9). `auto` lets the load- and acceptance-aware policy
(lookahead/policy.py) choose each step's config, from the step cost and priors `tune` measured on this
machine (tuned on first use). Detokenization and stop strings run in the caller's thread; closing a
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
import functools
import json
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from trt_lookahead.engine.format import DEFAULT_MAX_BATCH, is_engine_dir
from trt_lookahead.errors import UserError, as_int
from trt_lookahead.lookahead.config import AUTO, DEFAULT, DEFAULT_LOOKAHEAD, GREEDY, LookaheadConfig
from trt_lookahead.lookahead.decoder import DecodeStats, RequestDecoder, check_request
from trt_lookahead.lookahead.executor import Executor, check_kv_memory
from trt_lookahead.lookahead.policy import LookaheadPolicy, Priors, StepCost
from trt_lookahead.lookahead.pool import POOL_SCOPES, SharedPool
from trt_lookahead.lookahead.recycle import SHARED_PAIRS, SuccessorMap
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.lookahead.tree import DEFAULT_TREE, TreeTemplate, resolve_tree
from trt_lookahead.runtime import scheduler
from trt_lookahead.runtime.scheduler import Prefill, RequestHandle, Scheduler, default_prefill

DEFAULT_MAX_SEQ_LEN = 4096
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_MAX_QUEUE = 64
Prompt = str | Sequence[dict[str, str]] | Sequence[int] | np.ndarray
EXACT_ON_ENGINE = ("exact=True runs a checkpoint on the torch executor; onnxruntime runs exact steps only on an "
                   "engine dir built with `trt-lookahead build --exact`: drop --backend onnxruntime, or pass such an "
                   "engine")
TREE_ON_ENGINE = "an engine dir verifies the tree it was built with (`trt-lookahead build --tree`): drop --tree"
PROMPT_KINDS = "a prompt is text, a list of chat messages {'role': ..., 'content': ...}, or a list of token ids"
# a text prompt longer than max_seq_len * (the most characters one token covers) * this is refused untokenized:
# it cannot fit; the margin covers what the bound's argument (`_token_chars`) leaves out (a normalizer that
# strips or composes a few characters), at a small cost
PROMPT_CHARS_MARGIN = 2
# stop strings are matched against every chunk of a stream: their number and length bound that work.
# OpenAI takes at most 4 stop strings; 16 accepts every OpenAI client with room to spare. A stop string is
# a delimiter ("\n\nUser:", "</answer>"); 256 characters hold any such delimiter, a few lines of text
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class ChatTemplateError(UserError):
    """A chat template that cannot render the messages; `reason` is the template's own error, without the path."""

    def __init__(self, model_path: Path, reason: Exception) -> None:
        self.reason = str(reason)
        super().__init__(f"the chat template of {model_path} cannot render these messages ({self.reason})")


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (stop token or stop string) or "length"
    config: str  # "greedy", "W/N/G", or "auto" (stats.configs: the steps per config the policy chose)
    backend: str
    dtype: str
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
    config: LookaheadConfig  # the largest config a step of it may use
    explicit: bool  # run `config` every step (False: `auto`, the policy chooses up to it)
    stop: tuple[str, ...]  # non-empty stop strings
    pool_scope: str = "shared"  # "shared": reads and feeds the runtime's SharedPool; "request": its own pool only


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # new token ids since the previous chunk
    done: bool = False
    output: GenerationOutput | None = None  # set on the last chunk


class _Detokenizer:
    """Incremental detokenization: each push decodes only the tokens since the last stable point.

    Decoding ids[prefix:] against ids[prefix:read] keeps the spacing a token gets from its left
    neighbour; text is extended only when it does not end in an unfinished UTF-8 character.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        before = self.decode(self.ids[self._prefix : self._read])
        after = self.decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self.text


class _TextStream:
    """One request's blocks turned into StreamChunks: text, stop strings, held-back text, the final output.

    A chunk's work does not grow with the text so far: stop strings are searched for only where a new one can
    start (the text is only ever extended), and the held-back tail is at most the longest stop string."""

    def __init__(self, runtime: LookaheadRuntime, request: Request, handle: RequestHandle) -> None:
        self.runtime, self.request, self.handle = runtime, request, handle
        self.detokenizer = _Detokenizer(runtime.decode)
        self.emitted = 0  # characters of text already sent
        self.searched = 0  # characters of text searched for stop strings (none found)
        self.overlap = max((len(s) for s in request.stop), default=1) - 1  # a stop may start this far back
        self.finish = "length"
        self.stopped = False  # a stop string ended the text

    def push(self, block: list[int]) -> StreamChunk:
        stops = self.request.stop
        text = self.detokenizer.push(block)
        cut = _stop_string_cut(text, stops, max(self.searched - self.overlap, 0))
        self.searched = len(text)
        if cut is not None:
            block = self._end_at_stop_string(len(block))
            text, self.stopped = text[:cut], True
        if self.stopped or block[-1] in self.runtime.stop_token_ids:
            self.finish = "stop"
        end = len(text) if self.finish == "stop" else _stable_end(text, stops)
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
        end = next((n for n in range(start + 1, len(ids)) if _stop_string_cut(decode(ids[:n]), stops) is not None),
                   len(ids))
        del ids[end:]
        return ids[start:]

    def final(self) -> StreamChunk:
        """The last chunk; the request has left the scheduler (its stats no longer change)."""
        ids = self.detokenizer.ids
        stats = self.handle.request.decoder.stats
        stats.generated_tokens = len(ids)  # a stop string may end the output inside a block
        text = self.runtime.decode(ids)  # once in full: the final text never depends on block boundaries
        cut = _stop_string_cut(text, self.request.stop)
        text = text if cut is None else text[:cut]
        output = GenerationOutput(
            text=text,
            token_ids=ids,
            prompt_tokens=len(self.request.prompt_ids),
            finish_reason=self.finish,
            config=self.request.config.label if self.request.explicit else AUTO,
            backend=self.runtime.backend,
            dtype=self.runtime.dtype,
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


class LookaheadRuntime:
    """Tokenizer + one batched executor + its scheduler; `lookahead` is the default per-request config."""

    def __init__(
        self,
        tokenizer: Any,
        executor: Executor,
        *,
        lookahead: LookaheadConfig | str | None,
        max_seq_len: int,
        stop_token_ids: Sequence[int],
        backend: str,
        dtype: str,
        model_path: Path,
        max_lookahead: LookaheadConfig | None = None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        tuning_file: str | Path | None = None,
        pool_scope: str = "shared",
        prefill: Prefill | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.executor = executor
        self.exact = bool(getattr(executor, "exact", False))  # row-invariant steps (docs/design.md section 4.2)
        self.lookahead = lookahead  # None (greedy), AUTO or a LookaheadConfig
        self.max_seq_len = max_seq_len
        self.stop_token_ids = list(dict.fromkeys(int(t) for t in stop_token_ids))
        self.backend = backend
        self.dtype = dtype
        self.model_path = model_path
        self.max_lookahead = max_lookahead  # an engine's built config: requests must fit inside it
        self.tuning_file = None if tuning_file is None else Path(tuning_file)  # None: the cache's tuning.json
        self.pool_scope = check_pool_scope(pool_scope)  # the widest scope a request may use
        self.shared_pool = SharedPool()  # touched only by the scheduler thread (decoders' setup/prepare/update)
        self.tree: TreeTemplate | None = getattr(executor, "tree", None)  # the executor's draft tree template
        # recycled top-k of the shared scope's tree requests (scheduler thread)
        self.successors = SuccessorMap(pairs=SHARED_PAIRS)
        # until `auto` is first asked for, the policy only runs explicit configs (it never sees auto requests)
        policy = LookaheadPolicy(StepCost.linear(1.0, 0.0), Priors({}))
        prefill = default_prefill(backend) if prefill is None else prefill
        self.scheduler = Scheduler(executor, policy, max_queue, prefill)
        self.auto_config: LookaheadConfig | None = None  # the largest config `auto` requests may use (tuned)
        self._tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to call from several threads
        self._tuning_lock = threading.RLock()
        self.scheduler.start()
        # a runtime dropped without close() still stops its thread and frees its KV cache
        self._finalizer = weakref.finalize(self, self.scheduler.close)

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | Path,
        backend: str | None = None,
        dtype: str = "float32",
        lookahead: LookaheadConfig | str | None = DEFAULT,
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
    ) -> LookaheadRuntime:
        """Load a HF Llama checkpoint dir, a known model name, or an engine dir from `trt-lookahead build`.

        lookahead: DEFAULT (4,3,4; an engine's built config), W,N,G, a LookaheadConfig, AUTO (the policy,
        tuned on this runtime), or None / GREEDY (greedy). max_batch: request slots (default 8; an engine
        dir's built max_batch). max_queue: requests that may wait for a slot before `QueueFull`. tuning_file:
        where `auto` reads (and stores) what `tune` measured; default the cache's tuning.json. verify: check an
        engine dir's files against their checksums. exact: run the row-invariant step (a token's logits are
        bit-identical alone, batched and in greedy decoding; docs/design.md section 4.2); default: on where it is
        cheap (bfloat16 on the torch executor, CPU and CUDA; backends/torch.py EXACT_BY_DEFAULT). pool_scope: "shared"
        (requests read and feed one bounded n-gram pool; README "Shared n-gram pool") or "request" (no sharing).
        prefill: how a joining request's prompt is prefilled, "separate", "chunked" or a chunk size
        (runtime/scheduler.py); default per backend, `default_prefill`. tree: the verification branch as a draft
        tree (docs/design.md 2.7, 3.9): DEFAULT (an engine dir's built tree; for a checkpoint "auto"), "auto" (a
        template for the G(N-1) slots of `engine_cover`), a parent list, or None/"off" (G linear candidates);
        requests with a smaller G(N-1) use its first nodes.
        """
        from trt_lookahead.model.fetch import resolve_model

        check_pool_scope(pool_scope)
        path = resolve_model(str(path_or_name))
        if threads is not None:
            import torch

            if as_int("threads", threads) < 1:
                raise UserError(f"threads must be >= 1 (torch's CPU threads), got {threads}")
            torch.set_num_threads(threads)
        if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
            raise UserError(f"max_batch must be a positive integer (request slots), got {max_batch!r}")
        engine = is_engine_dir(path)
        if engine:
            if tree not in (None, "off", DEFAULT):
                raise UserError(TREE_ON_ENGINE)
            why = None  # an engine dir runs where it was built for: nothing to explain
            rt = cls._from_engine(path, backend or "onnxruntime", dtype, max_seq_len, max_batch, max_queue, tuning_file,
                                  verify, prefill=prefill, exact=exact)
        else:
            asked = None if lookahead in (DEFAULT, None) else resolve_lookahead(lookahead)
            asked = asked if isinstance(asked, LookaheadConfig) else None
            backend, why = checkpoint_backend(backend, dtype, asked, exact)
            template = checkpoint_tree(tree, asked, backend)
            if backend == "onnxruntime":
                cached = cached_checkpoint_engine(path, dtype, max_seq_len, max_batch, asked, template)
                rt = cls._from_engine(cached, backend, dtype, max_seq_len, max_batch, max_queue, tuning_file, verify,
                                      model_path=path, prefill=prefill)
            else:
                rt = cls._from_checkpoint(path, dtype, max_seq_len, max_batch or DEFAULT_MAX_BATCH, max_queue,
                                          tuning_file, exact, prefill, template)
        try:
            if lookahead == DEFAULT:  # an engine dir's built config; a checkpoint's (on any backend) 4,3,4
                rt.lookahead = (rt.max_lookahead if engine else None) or DEFAULT_LOOKAHEAD
            elif lookahead is not None:
                rt.lookahead = resolve_lookahead(lookahead)
            rt.request_config(None)  # the default must fit this executor
            rt.pool_scope = pool_scope
        except BaseException:
            rt.close()
            raise
        if why is not None:  # a checkpoint: which backend runs it and why, once (stderr, beside the build's lines)
            print(f"trt-lookahead: {path.name} runs on {rt.backend} ({why})", file=sys.stderr, flush=True)
        return rt

    @classmethod
    def _from_checkpoint(
        cls, path: Path, dtype: str, max_seq_len: int | None, max_batch: int, max_queue: int,
        tuning_file: str | Path | None, exact: bool | None, prefill: Prefill | None, tree: TreeTemplate | None = None,
    ) -> LookaheadRuntime:
        from trt_lookahead.backends.torch import BatchedTorchExecutor
        from trt_lookahead.model.checkpoint import check_max_seq_len, load_llama, load_tokenizer

        model, config = load_llama(path, dtype=dtype, weight_layout="auto")
        seq_len = check_max_seq_len(max_seq_len, config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        try:
            executor = BatchedTorchExecutor(model, max_batch, seq_len, exact=exact, tree=tree)
        except ValueError as exc:  # exact=True where the build has no row-invariant projections
            raise UserError(str(exc)) from exc
        return cls(
            load_tokenizer(path),
            executor,
            lookahead=None,
            max_seq_len=seq_len,
            stop_token_ids=_stop_token_ids(path),
            backend="torch",
            dtype=dtype,
            model_path=path,
            max_queue=max_queue,
            tuning_file=tuning_file,
            prefill=prefill,
        )

    @classmethod
    def _from_engine(
        cls, path: Path, backend: str, dtype: str, max_seq_len: int | None, max_batch: int | None, max_queue: int,
        tuning_file: str | Path | None, verify: bool, model_path: Path | None = None, prefill: Prefill | None = None,
        exact: bool | None = None,
    ) -> LookaheadRuntime:
        from trt_lookahead.backends.open import open_engine
        from trt_lookahead.model.checkpoint import load_tokenizer

        engine = open_engine(path, backend=backend, dtype=dtype, max_seq_len=max_seq_len, max_batch=max_batch,
                             verify=verify, exact=exact)
        source = model_path or path  # a cached engine's checkpoint: its tokenizer files as they are now
        return cls(
            load_tokenizer(source),
            engine.executor(),
            lookahead=None,
            max_seq_len=engine.max_seq_len,
            stop_token_ids=_stop_token_ids(source),
            backend=backend,
            dtype=engine.dtype,
            model_path=model_path or path,  # a cached engine answers for its checkpoint (tuning key)
            max_lookahead=engine.lookahead,
            max_queue=max_queue,
            tuning_file=tuning_file,
            prefill=prefill,
        )

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

    @functools.cached_property
    def token_chars(self) -> int | None:
        """The most characters of normalized text one token covers (None: no bound known for this tokenizer);
        computed once, see `_token_chars`."""
        return _token_chars(self.tokenizer)

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids of a text prompt, of chat messages (chat template), or the ids themselves.

        A prompt that cannot fit max_seq_len is refused before tokenizing (UserError): text by its length in
        characters (`prompt_char_limit`), token ids by their count."""
        if not isinstance(chat, bool):
            raise UserError(f"chat must be True or False, got {chat!r}")
        if isinstance(prompt, str):
            if chat:
                return self._apply_chat_template([{"role": "user", "content": prompt}])
            self._check_text([prompt])
            with self._tokenizer_lock:
                return list(self.tokenizer(prompt, verbose=False)["input_ids"])
        if not isinstance(prompt, Sequence | np.ndarray) or isinstance(prompt, bytes | bytearray):
            raise UserError(f"{PROMPT_KINDS}, got {type(prompt).__name__}")
        if len(prompt) and all(isinstance(m, dict) for m in prompt):
            return self._apply_chat_template(_check_messages(list(prompt)))
        if len(prompt) > self.max_seq_len:  # by its length, before converting a single id
            raise UserError(f"a prompt of {len(prompt)} token ids exceeds max_seq_len {self.max_seq_len}; shorten the "
                            "prompt")
        items = list(prompt)
        try:
            ids = [as_int("token id", t) for t in items]
        except UserError:
            raise UserError(f"{PROMPT_KINDS}, got a list holding {sorted({type(t).__name__ for t in items})}") from None
        if chat:
            raise UserError("chat=True wraps text in the chat template; a list of token ids is used as it is")
        return ids

    def _check_text(self, texts: Sequence[str]) -> None:
        """Refuse text that is not Unicode (a lone surrogate: tokenizers raise TypeError on it) or too long to fit
        max_seq_len, before any tokenizing: a check of its length, nothing that grows faster."""
        for text in texts:
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise UserError(
                        f"the prompt holds a lone surrogate ({text[exc.start]!r} at character {exc.start}), which is "
                        "not Unicode text; send each surrogate in a pair (or the character itself)"
                    ) from None
        token_chars = self.token_chars
        if token_chars is None:
            return
        chars = sum(len(t) for t in texts)
        if chars > self.max_seq_len * token_chars * PROMPT_CHARS_MARGIN:
            raise UserError(
                f"the prompt has {chars} characters and no token of this tokenizer covers more than {token_chars}: "
                f"it needs at least {-(-chars // token_chars)} tokens, which cannot fit max_seq_len "
                f"{self.max_seq_len}; shorten the prompt"
            )

    def _apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(f"{self.model_path} has no chat template; send a plain text prompt (drop --chat)")
        self._check_text([m["content"] for m in messages])
        try:
            with self._tokenizer_lock:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template is the model's own Jinja code: any error means these messages
            raise ChatTemplateError(self.model_path, exc) from exc
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def request_config(self, lookahead: LookaheadConfig | str | None = None) -> tuple[LookaheadConfig, bool]:
        """(largest config, explicit) of one request: None for the runtime's default, GREEDY, AUTO or W,N,G.

        `auto` requests run up to the tuned config, the policy choosing each step (explicit False; where
        `auto` is greedy on this machine, explicit greedy).
        """
        if not isinstance(lookahead, LookaheadConfig | str | None):
            raise UserError(
                f"lookahead must be None (the runtime's default), {GREEDY!r}, {AUTO!r}, 'W,N,G' text or a "
                f"LookaheadConfig, got {lookahead!r}"
            )
        chosen = self.lookahead if lookahead is None else resolve_lookahead(lookahead)
        if chosen == AUTO:
            config = self._auto()
            explicit = config.is_greedy
        else:
            config, explicit = cast(LookaheadConfig | None, chosen) or LookaheadConfig.greedy(), True
        if self.max_lookahead is not None:
            config.check_fits(self.max_lookahead)
        if config.step_tokens > self.executor.step_tokens:
            raise UserError(
                f"lookahead config {config} feeds {config.step_tokens} tokens per step; this runtime's executor "
                f"takes at most {self.executor.step_tokens}: ask for a smaller W, N or G"
            )
        return config, explicit

    def _auto(self) -> LookaheadConfig:
        """The tuned config `auto` requests run up to; the first call installs the tuned policy (tuning if needed)."""
        if self.auto_config is not None:
            return self.auto_config
        with self._tuning_lock:  # re-entrant: tuning itself runs `auto` requests on this runtime
            if self.auto_config is None:
                from trt_lookahead.tuning.tune import auto_tuning

                config, policy = auto_tuning(self)
                self.scheduler.policy = policy
                self.auto_config = config
            return self.auto_config

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
        lookahead: LookaheadConfig | str | None = None,
        chat: bool = False,
        pool_scope: str | None = None,
    ) -> Request:
        """Check every argument of a request (ValueError naming it) before any work; `stream` runs the result.

        pool_scope: None (the runtime's), "shared" or "request"; it can only narrow the runtime's scope.
        """
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        config, explicit = self.request_config(lookahead)
        prompt_ids = self.encode(prompt, chat=chat)
        check_request(prompt_ids, max_new_tokens, self.executor.vocab_size, self.max_seq_len)
        scope = self.pool_scope if pool_scope is None else check_pool_scope(pool_scope)
        scope = "request" if "request" in (scope, self.pool_scope) else scope
        return Request(prompt_ids, int(max_new_tokens), sampling, config, explicit, _stop_strings(stop), scope)

    def submit(
        self, requests: Sequence[Request], loop: asyncio.AbstractEventLoop | None = None
    ) -> list[RequestHandle]:
        """Queue checked requests together on the scheduler (QueueFull if they do not fit in the queue)."""
        jobs = [
            scheduler.Request(
                RequestDecoder(r.config, r.prompt_ids, r.max_new_tokens, self.stop_token_ids, r.sampling.seed,
                               tree=self.tree, shared=self.shared_pool if r.pool_scope == "shared" else None,
                               successors=self.successors if r.pool_scope == "shared" else None),
                r.sampling,
                r.explicit,
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


def _check_messages(items: list[Any]) -> list[dict[str, str]]:
    """Chat messages: dicts whose `role` and `content` are strings (UserError naming the first bad one)."""
    for i, message in enumerate(items):
        if not all(isinstance(message.get(key), str) for key in ("role", "content")):
            raise UserError(
                f"chat message {i} must have string 'role' and 'content' entries, got {message!r}"
            )
    return cast(list[dict[str, str]], items)


def _token_chars(tokenizer: Any) -> int | None:
    """The most characters of a prompt one token covers: its vocabulary entry's length (added tokens included),
    for BPE with byte fallback (a piece's own characters, or 6 for one `<0xNN>` byte) and byte-level BPE (a
    vocabulary character per byte, at least one byte per character; an NFC normalizer's compositions keep
    that). None for other tokenizers: an unknown token fused over a run, or a pre-tokenizer that drops
    whitespace, covers any length. One exception, by choice: a normalizer that folds runs of spaces (the
    stories260K tokenizer's) lets a token cover a run of any length; such a prompt is refused by its raw length
    all the same, as that normalizer's regex takes time quadratic in a run's length (seconds for 20,000
    spaces), with the tokenizer lock held: the Llama tokenizers (sentencepiece's and byte-level) fold nothing."""
    from tokenizers.models import BPE

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.model, BPE):
        return None
    if not (backend.model.byte_fallback or "ByteLevel" in repr(backend.pre_tokenizer)):
        return None
    return max((len(token) for token in tokenizer.get_vocab()), default=None)


def _stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """None, one stop string, or a sequence of them -> the non-empty ones (empty strings never match); at most
    MAX_STOP_STRINGS of at most MAX_STOP_CHARS characters each, checked before looking at any of them."""
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stops, Sequence):
        raise UserError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    if len(stops) > MAX_STOP_STRINGS:
        raise UserError(f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed: send fewer")
    if not all(isinstance(s, str) for s in stops):
        raise UserError(f"stop must be a string or a list of strings, got {_shown(stop)}")
    longest = max(stops, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise UserError(f"a stop string has {len(longest)} characters; at most {MAX_STOP_CHARS} are allowed: send a "
                        "shorter one")
    return tuple(s for s in stops if s)


def _shown(value: object, limit: int = 80) -> str:
    """repr(value) cut to `limit` characters: an error message never grows with the input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _stop_string_cut(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the first stop string starts in `text`, if any, searching from `start`."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _stable_end(text: str, stops: Sequence[str]) -> int:
    """How much of `text` later tokens cannot change: hold back any tail that could start a stop string."""
    end = len(text)
    last = text[-1:]
    for stop in stops:
        k = min(len(stop) - 1, len(text))  # the longest held-back tail: stop[:j + 1] for j < k
        while last and (j := stop.rfind(last, 0, k)) >= 0:  # only prefixes ending in text's last character
            if text.endswith(stop[: j + 1]):
                end = min(end, len(text) - j - 1)
                break
            k = j
    return end


def _stop_token_ids(path: Path) -> list[int]:
    """eos ids from generation_config.json and config.json (an int or a list in either)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if not file.is_file():
            continue
        try:
            value = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
            values = value if isinstance(value, list) else [] if value is None else [value]
            ids.extend(as_int("eos_token_id", t) for t in values)
        except (OSError, ValueError, AttributeError) as exc:
            raise UserError(f"{file} is unreadable or malformed ({exc}); restore it from the original files") from exc
    return ids


BACKEND_CHOICES = ("torch", "onnxruntime", "tensorrt")


def check_pool_scope(scope: object) -> str:
    """"shared" or "request" (UserError otherwise)."""
    if scope not in POOL_SCOPES:
        raise UserError(f"pool_scope must be one of {', '.join(POOL_SCOPES)}, got {scope!r}")
    return cast(str, scope)


def resolve_lookahead(lookahead: LookaheadConfig | str) -> LookaheadConfig | str | None:
    """A LookaheadConfig, GREEDY (None), AUTO, or W,N,G text."""
    if isinstance(lookahead, LookaheadConfig):
        return lookahead
    if lookahead == GREEDY:
        return None
    if lookahead == AUTO:
        return AUTO
    return LookaheadConfig.parse(lookahead)


def engine_cover(asked: LookaheadConfig | None = None) -> LookaheadConfig:
    """The W, N, G a checkpoint's cached engine is built for: the default config, TOP/5/TOP (the widest `auto` takes
    on it) and the config asked for explicitly (None: the standard engine)."""
    from trt_lookahead.tuning.tune import NGRAMS, TOP

    standard = [DEFAULT_LOOKAHEAD, LookaheadConfig(TOP, max(NGRAMS), TOP)]
    return LookaheadConfig.cover([*standard, *([asked] if asked else [])])


def checkpoint_tree(spec: str | TreeTemplate | None, asked: LookaheadConfig | None, backend: str
                    ) -> TreeTemplate | None:
    """The draft tree a checkpoint runs with (DEFAULT: DEFAULT_TREE; docs/design.md 2.7), sized for the config
    asked for, else for every config `auto` may use; on onnxruntime for its cached engine (`engine_cover`)."""
    from trt_lookahead.tuning.tune import auto_cover

    if backend == "onnxruntime":
        sized = engine_cover(asked)
    else:
        sized = asked if asked and asked.G else LookaheadConfig.cover([DEFAULT_LOOKAHEAD, auto_cover()])
    try:
        return resolve_tree(DEFAULT_TREE if spec == DEFAULT else spec, sized)
    except UserError as exc:
        if backend != "onnxruntime":
            raise
        raise UserError(f"{exc} ({sized} is the checkpoint's cached engine; on --backend torch a tree only needs "
                        "the slots of the config asked for)") from None


def checkpoint_tuning_key(path: str | Path, dtype: str, backend: str | None = None,
                          asked: LookaheadConfig | None = None) -> str:
    """The tuning file's key `auto` reads for a checkpoint's default runtime on `backend` (None: its default)."""
    from trt_lookahead.tuning.file import tuning_key

    backend = checkpoint_backend(backend, dtype, asked)[0]
    return tuning_key(path, dtype, backend, tree=checkpoint_tree(DEFAULT, asked, backend))


def checkpoint_backend(
    backend: str | None, dtype: str, asked: LookaheadConfig | None = None, exact: bool | None = None
) -> tuple[str, str]:
    """(the backend that runs a checkpoint, why): onnxruntime on a cached engine for float32 (the fastest CPU
    path, docs/design.md section 6.8), torch for other dtypes, for a config wider than the standard cached
    engine (so the default never builds a second one unasked), for exact=True, or when asked; UserError for
    one that cannot."""
    if exact and backend not in (None, "torch"):
        raise UserError(EXACT_ON_ENGINE)
    if backend is None:
        if exact:
            return "torch", "exact=True: the row-invariant step runs on the torch executor (docs/design.md 4.2)"
        if dtype != "float32":
            return "torch", f"the default for {dtype}: onnxruntime engines run float32 only"
        if asked is not None and engine_cover(asked) != engine_cover():
            return "torch", (f"{asked} is wider than the standard cached engine's {engine_cover()}; "
                             "--backend onnxruntime builds an engine for it once")
        return "onnxruntime", "the default for float32: a compiled engine, built once and cached; --backend torch"
    if backend not in BACKEND_CHOICES[:2]:
        raise UserError(f"backend {backend!r} runs engine dirs: build one with `trt-lookahead build --target "
                        f"{backend}`; a checkpoint runs on {' or '.join(BACKEND_CHOICES[:2])}")
    if backend == "onnxruntime" and dtype != "float32":
        raise UserError(f"the onnxruntime backend runs float32 engines on the CPU, not {dtype}; use --backend torch")
    return backend, "asked for"


def cached_checkpoint_engine(path: Path, dtype: str, max_seq_len: int | None, max_batch: int | None,
                             asked: LookaheadConfig | None = None, tree: TreeTemplate | None = None) -> Path:
    """The cached engine dir (engine/cache.py) a checkpoint runs on with onnxruntime, built first if needed.

    One shape serves a checkpoint's usual requests, so one engine is built per checkpoint and dtype: W, N, G
    from `engine_cover` (a larger per-request config is refused, naming it); max_seq_len and max_batch cover
    the defaults and what was asked for (the graph's batch and cache length are dynamic: an executor opened
    for less keeps less).
    """
    from trt_lookahead.engine.cache import cached_engine
    from trt_lookahead.model.checkpoint import check_max_seq_len, read_config

    cover, config = engine_cover(asked), read_config(path)
    context = config.max_position_embeddings
    seq_len = max(check_max_seq_len(max_seq_len, context, DEFAULT_MAX_SEQ_LEN), min(context, DEFAULT_MAX_SEQ_LEN))
    slots = max(max_batch or DEFAULT_MAX_BATCH, DEFAULT_MAX_BATCH)
    # the executor checks this too, but only after a build that may itself not fit: refuse before building
    check_kv_memory((config.num_layers, slots, config.num_kv_heads, seq_len + cover.step_tokens, config.head_dim),
                    4, seq_len, slots)
    engine, _ = cached_engine(path, dtype=dtype, lookahead=cover, max_seq_len=seq_len, max_batch=slots, tree=tree)
    return engine
