"""LookaheadRuntime: a model (or engine dir), its tokenizer and executors, behind generate() and stream().

    rt = LookaheadRuntime.from_pretrained("smollm2-135m-instruct", lookahead="4,3,4")
    out = rt.generate([{"role": "user", "content": "Hi"}], max_new_tokens=64)
    for chunk in rt.stream("def fib(n):", max_new_tokens=64): print(chunk.text, end="")

One executor is built per step layout on first use; the MAX_EXECUTORS most recently used are kept (each
holds its own KV buffers; greedy is the T = 1 layout). A runtime serialises its calls with a lock: use one
runtime per model instance (per thread that serves); a thread that opens a second request while its own
stream is still open gets a UserError, never a deadlock. `auto` is resolved by trt_lookahead.tuning on this
runtime (tuned on first use). See docs/design.md sections 1.3 and 5.

Every request is checked by `check_request` before any work (ValueError naming the argument). A stop
string ends the text where it starts and the token ids with the token that completes it, whatever the
block boundaries (lookahead's ids equal greedy's). The streamed chunks add up to the final text, except
where the model emitted byte tokens that are not valid UTF-8 (random sampling at a huge temperature,
say): a byte-fallback decode renders a run of bytes as one replacement character per byte once the run
turns out invalid, even bytes that were text a moment before, so no stream can know their final form.
The final text (one decode of all ids) is the reference.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from trt_lookahead.engine.format import is_engine_dir
from trt_lookahead.errors import UserError, as_int
from trt_lookahead.lookahead.config import AUTO, DEFAULT, DEFAULT_LOOKAHEAD, GREEDY, LookaheadConfig
from trt_lookahead.lookahead.decoder import DecodeStats, LookaheadDecoder
from trt_lookahead.lookahead.decoder import check_request as check_decode_request
from trt_lookahead.lookahead.executor import Executor
from trt_lookahead.lookahead.layout import StepLayout
from trt_lookahead.lookahead.sampling import SamplingParams

DEFAULT_MAX_SEQ_LEN = 4096
DEFAULT_MAX_NEW_TOKENS = 128
MAX_EXECUTORS = 4
Prompt = str | Sequence[dict[str, str]] | Sequence[int] | np.ndarray
PROMPT_KINDS = "a prompt is text, a list of chat messages {'role': ..., 'content': ...}, or a list of token ids"


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (stop token or stop string) or "length"
    config: str  # "greedy" or "W/N/G"
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
        }


@dataclass(frozen=True)
class Request:
    """One checked request: what `stream` runs (made by `LookaheadRuntime.check_request`)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    config: LookaheadConfig
    stop: tuple[str, ...]  # non-empty stop strings


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


class LookaheadRuntime:
    """Tokenizer + executors for one model; `lookahead` is the default per-request config (None = greedy)."""

    def __init__(
        self,
        tokenizer: Any,
        make_executor: Callable[[StepLayout], Executor],
        *,
        lookahead: LookaheadConfig | None,
        max_seq_len: int,
        stop_token_ids: Sequence[int],
        backend: str,
        dtype: str,
        model_path: Path,
        vocab_size: int,
        max_lookahead: LookaheadConfig | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.lookahead = lookahead
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.stop_token_ids = list(dict.fromkeys(int(t) for t in stop_token_ids))
        self.backend = backend
        self.dtype = dtype
        self.model_path = model_path
        self.max_lookahead = max_lookahead  # an engine's built config: requests must fit inside it
        self._make_executor: Callable[[StepLayout], Executor] | None = make_executor
        self._executors: OrderedDict[LookaheadConfig, Executor] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread whose request holds the lock

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | Path,
        backend: str | None = None,
        dtype: str = "float32",
        lookahead: LookaheadConfig | str | None = DEFAULT,
        max_seq_len: int | None = None,
        threads: int | None = None,
        verify: bool = True,
    ) -> LookaheadRuntime:
        """Load a HF Llama checkpoint dir, a known model name, or an engine dir from `trt-lookahead build`.

        lookahead: DEFAULT (4,3,4; an engine's built config), W,N,G, a LookaheadConfig, AUTO (tuned on this
        runtime), or None / GREEDY (greedy). verify: check an engine dir's files against their checksums.
        """
        from trt_lookahead.model.fetch import resolve_model

        path = resolve_model(str(path_or_name))
        if threads is not None:
            import torch

            if as_int("threads", threads) < 1:
                raise UserError(f"threads must be >= 1 (torch's CPU threads), got {threads}")
            torch.set_num_threads(threads)
        if is_engine_dir(path):
            rt = cls._from_engine(path, backend or "onnxruntime", dtype, max_seq_len, verify)
        elif backend not in (None, "torch"):
            raise UserError(f"backend {backend!r} runs engine dirs; build one with `trt-lookahead build` or use torch")
        else:
            rt = cls._from_checkpoint(path, dtype, max_seq_len)
        if lookahead == DEFAULT:
            rt.lookahead = rt.max_lookahead or DEFAULT_LOOKAHEAD
        elif lookahead is not None:
            rt.lookahead = rt._resolve(lookahead)
        if rt.lookahead is not None and rt.max_lookahead is not None:
            rt.lookahead.check_fits(rt.max_lookahead)
        return rt

    @classmethod
    def _from_checkpoint(cls, path: Path, dtype: str, max_seq_len: int | None) -> LookaheadRuntime:
        from trt_lookahead.backends.torch import TorchExecutor
        from trt_lookahead.model.checkpoint import check_max_seq_len, load_llama, load_tokenizer

        model, config = load_llama(path, dtype=dtype, weight_layout="auto")
        seq_len = check_max_seq_len(max_seq_len, config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)

        def make_executor(layout: StepLayout) -> Executor:
            return TorchExecutor(model, layout.mask, seq_len, output_slots=layout.output_slots)

        return cls(
            load_tokenizer(path),
            make_executor,
            lookahead=None,
            max_seq_len=seq_len,
            stop_token_ids=_stop_token_ids(path),
            backend="torch",
            dtype=dtype,
            model_path=path,
            vocab_size=config.vocab_size,
        )

    @classmethod
    def _from_engine(
        cls, path: Path, backend: str, dtype: str, max_seq_len: int | None, verify: bool
    ) -> LookaheadRuntime:
        from trt_lookahead.backends.open import open_engine
        from trt_lookahead.model.checkpoint import load_tokenizer

        engine = open_engine(path, backend=backend, dtype=dtype, max_seq_len=max_seq_len, verify=verify)
        return cls(
            load_tokenizer(path),
            engine.make_executor,
            lookahead=None,
            max_seq_len=engine.max_seq_len,
            stop_token_ids=_stop_token_ids(path),
            backend=backend,
            dtype=engine.dtype,
            model_path=path,
            vocab_size=engine.config.vocab_size,
            max_lookahead=engine.lookahead,
        )

    def close(self) -> None:
        """Free the executors and the weights (the runtime cannot generate afterwards)."""
        with self._lock:
            self._executors.clear()
            self._make_executor = None

    # -- requests -------------------------------------------------------------------------------

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids of a text prompt, of chat messages (chat template), or the ids themselves."""
        if not isinstance(chat, bool):
            raise UserError(f"chat must be True or False, got {chat!r}")
        if isinstance(prompt, str):
            if chat:
                return self._apply_chat_template([{"role": "user", "content": prompt}])
            return list(self.tokenizer(prompt, verbose=False)["input_ids"])
        if not isinstance(prompt, Sequence | np.ndarray) or isinstance(prompt, bytes | bytearray):
            raise UserError(f"{PROMPT_KINDS}, got {type(prompt).__name__}")
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            return self._apply_chat_template(_check_messages(items))
        try:
            ids = [as_int("token id", t) for t in items]
        except UserError:
            raise UserError(f"{PROMPT_KINDS}, got a list holding {sorted({type(t).__name__ for t in items})}") from None
        if chat:
            raise UserError("chat=True wraps text in the chat template; a list of token ids is used as it is")
        return ids

    def _apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(f"{self.model_path} has no chat template; send a plain text prompt (drop --chat)")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template is the model's own Jinja code: any error means these messages
            raise UserError(f"the chat template of {self.model_path} cannot render these messages ({exc})") from exc
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def request_config(self, lookahead: LookaheadConfig | str | None = None) -> LookaheadConfig:
        """The layout config of one request: None for the runtime's default, GREEDY, AUTO or W,N,G."""
        if not isinstance(lookahead, LookaheadConfig | str | None):
            raise UserError(
                f"lookahead must be None (the runtime's default), {GREEDY!r}, {AUTO!r}, 'W,N,G' text or a "
                f"LookaheadConfig, got {lookahead!r}"
            )
        config = (self.lookahead if lookahead is None else self._resolve(lookahead)) or LookaheadConfig.greedy()
        if self.max_lookahead is not None:
            config.check_fits(self.max_lookahead)
        return config

    def _resolve(self, lookahead: LookaheadConfig | str) -> LookaheadConfig | None:
        """A LookaheadConfig, GREEDY (None), AUTO (tuned for this runtime on this machine) or W,N,G text."""
        if isinstance(lookahead, LookaheadConfig):
            return lookahead
        if lookahead == GREEDY:
            return None
        if lookahead == AUTO:
            from trt_lookahead.tuning.tune import auto_config

            return auto_config(self)
        return LookaheadConfig.parse(lookahead)

    def generate(self, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **kwargs: Any) -> GenerationOutput:
        """Generate to completion; same arguments as `stream`."""
        for chunk in self.stream(prompt, max_new_tokens, **kwargs):
            if chunk.done:
                assert chunk.output is not None
                return chunk.output
        raise AssertionError("stream ended without a final chunk")

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
    ) -> Request:
        """Check every argument of a request (ValueError naming the argument); `stream` runs the result."""
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        config = self.request_config(lookahead)
        prompt_ids = self.encode(prompt, chat=chat)
        check_decode_request(prompt_ids, max_new_tokens, self.vocab_size, self.max_seq_len)
        return Request(prompt_ids, int(max_new_tokens), sampling, config, _stop_strings(stop))

    def stream(
        self, prompt: Prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **kwargs: Any
    ) -> Iterator[StreamChunk]:
        """Yield text as each step's tokens are accepted; the last chunk carries the GenerationOutput.

        Arguments as `check_request`, checked in this call (before any work), not at the first chunk.
        """
        return self._run(self.check_request(prompt, max_new_tokens, **kwargs))

    def _run(self, request: Request) -> Iterator[StreamChunk]:
        if self._owner == threading.get_ident():
            raise UserError(
                "this thread already has an open request on this runtime (a stream not yet exhausted or closed); "
                "finish or close() that stream first: a runtime serves one request at a time"
            )
        stops = request.stop
        with self._lock:
            self._owner = threading.get_ident()
            try:
                decoder = self._decoder(request.config, request.sampling.seed)
                detokenizer = _Detokenizer(self.decode)
                text, emitted, finish = "", 0, "length"
                blocks = decoder.stream(request.prompt_ids, request.max_new_tokens, request.sampling)
                try:
                    for block in blocks:
                        text = detokenizer.push(block)
                        cut = _stop_string_cut(text, stops)
                        if cut is not None:
                            block = self._end_at_stop_string(detokenizer.ids, len(block), stops)
                            text = text[:cut]
                        if cut is not None or block[-1] in decoder.stop_tokens:
                            finish = "stop"
                        end = len(text) if finish == "stop" else _stable_end(text, stops)
                        yield StreamChunk(text[emitted:end], block)
                        emitted = max(emitted, end)
                        if cut is not None:
                            break
                finally:
                    blocks.close()
                ids = detokenizer.ids
                decoder.stats.generated_tokens = len(ids)  # a stop string may end the output inside a block
                text = self.decode(ids)  # once in full: the final text never depends on block boundaries
                cut = _stop_string_cut(text, stops)
                text = text if cut is None else text[:cut]
                output = GenerationOutput(
                    text=text,
                    token_ids=ids,
                    prompt_tokens=len(request.prompt_ids),
                    finish_reason=finish,
                    config=request.config.label,
                    backend=self.backend,
                    dtype=self.dtype,
                    stats=decoder.stats,
                )
            finally:
                self._owner = None
        yield StreamChunk(text[emitted:], [], done=True, output=output)

    def _end_at_stop_string(self, ids: list[int], block_len: int, stops: Sequence[str]) -> list[int]:
        """Drop (in place) the ids after the one that completes a stop string; returns the block's kept ids.

        The stop string appeared within the last `block_len` ids, so the shortest prefix whose text holds
        it ends inside this block: that is where one-token-per-step decoding would have stopped.
        """
        start = len(ids) - block_len
        end = next(
            (n for n in range(start + 1, len(ids)) if _stop_string_cut(self.decode(ids[:n]), stops) is not None),
            len(ids),
        )
        del ids[end:]
        return ids[start:]

    def executor_for(self, config: LookaheadConfig) -> tuple[Executor, StepLayout]:
        """The executor for `config` and its step layout (built on first use; engines pad to their built T)."""
        if self._make_executor is None:
            raise RuntimeError("this runtime was closed")
        padded = None
        if self.max_lookahead is not None and not config.is_greedy:
            padded = self.max_lookahead.step_tokens
        layout = StepLayout(config, padded_tokens=padded)
        executor = self._executors.pop(config, None) or self._make_executor(layout)
        self._executors[config] = executor
        while len(self._executors) > MAX_EXECUTORS:
            self._executors.popitem(last=False)
        return executor, layout

    def _decoder(self, config: LookaheadConfig, seed: int) -> LookaheadDecoder:
        executor, layout = self.executor_for(config)
        return LookaheadDecoder(executor, layout, stop_tokens=self.stop_token_ids, seed=seed)


def _check_messages(items: list[Any]) -> list[dict[str, str]]:
    """Chat messages: dicts whose `role` and `content` are strings (UserError naming the first bad one)."""
    for i, message in enumerate(items):
        if not all(isinstance(message.get(key), str) for key in ("role", "content")):
            raise UserError(
                f"chat message {i} must have string 'role' and 'content' entries, got {message!r}"
            )
    return cast(list[dict[str, str]], items)


def _stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """None, one stop string, or a sequence of them -> the non-empty ones (empty strings never match)."""
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stops, Sequence) or not all(isinstance(s, str) for s in stops):
        raise UserError(f"stop must be a string or a list of strings, got {stop!r}")
    return tuple(s for s in stops if s)


def _stop_string_cut(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string starts in `text`, if any."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _stable_end(text: str, stops: Sequence[str]) -> int:
    """How much of `text` later tokens cannot change: hold back any tail that could start a stop string."""
    end = len(text)
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
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
