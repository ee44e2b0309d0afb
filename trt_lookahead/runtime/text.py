"""Text in and out of a runtime: prompts to token ids (chat templates, the bounds checked before tokenizing),
ids back to text incrementally, and stop strings (their limits and where they cut).

Owns no request state but the tokenizer's lock; imports only errors and the HF tokenizer it is given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from trt_lookahead.errors import UserError, as_int

Prompt = str | Sequence[dict[str, str]] | Sequence[int] | np.ndarray
PROMPT_KINDS = "a prompt is text, a list of chat messages {'role': ..., 'content': ...}, or a list of token ids"
# a text prompt longer than max_seq_len * (the most characters one token covers) * this is refused untokenized:
# it cannot fit; the margin covers what the bound's argument (`token_chars`) leaves out (a normalizer that
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


class PromptTooLong(UserError):
    """A prompt refused by its size before tokenizing (ids by their count, text by its characters): it cannot fit
    max_seq_len whatever its tokens."""


class PromptTokenizer:
    """A HF tokenizer behind a lock (fast tokenizers are not safe to call from several threads), with every prompt
    checked before any tokenizing: its kind, Unicode, and a length that can fit max_seq_len."""

    def __init__(self, tokenizer: Any, max_seq_len: int, model_path: Path) -> None:
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.model_path = model_path
        self._lock = threading.Lock()
        self.token_chars = token_chars(tokenizer)  # None: no bound known for this tokenizer

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids of a text prompt, of chat messages (chat template), or the ids themselves.

        A prompt that cannot fit max_seq_len is refused before tokenizing (UserError): text by its length in
        characters, token ids by their count."""
        if not isinstance(chat, bool):
            raise UserError(f"chat must be True or False, got {chat!r}")
        if isinstance(prompt, str):
            if chat:
                return self._apply_chat_template([{"role": "user", "content": prompt}])
            self._check_text([prompt])
            with self._lock:
                return list(self.tokenizer(prompt, verbose=False)["input_ids"])
        if not isinstance(prompt, Sequence | np.ndarray) or isinstance(prompt, bytes | bytearray):
            raise UserError(f"{PROMPT_KINDS}, got {type(prompt).__name__}")
        if len(prompt) and all(isinstance(m, dict) for m in prompt):
            return self._apply_chat_template(_check_messages(list(prompt)))
        if len(prompt) > self.max_seq_len:  # by its length, before converting a single id
            raise PromptTooLong(f"a prompt of {len(prompt)} token ids exceeds max_seq_len {self.max_seq_len}; "
                                "shorten the prompt")
        items = list(prompt)
        try:
            ids = [as_int("token id", t) for t in items]
        except UserError:
            raise UserError(f"{PROMPT_KINDS}, got a list holding {sorted({type(t).__name__ for t in items})}") from None
        if chat:
            raise UserError("chat=True wraps text in the chat template; a list of token ids is used as it is")
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        with self._lock:
            return cast(str, self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

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
        if self.token_chars is None:
            return
        chars = sum(len(t) for t in texts)
        if chars > self.max_seq_len * self.token_chars * PROMPT_CHARS_MARGIN:
            raise PromptTooLong(
                f"the prompt has {chars} characters and no token of this tokenizer covers more than "
                f"{self.token_chars}: it needs at least {-(-chars // self.token_chars)} tokens, which cannot fit "
                f"max_seq_len {self.max_seq_len}; shorten the prompt"
            )

    def _apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(f"{self.model_path} has no chat template; send a plain text prompt (drop --chat)")
        self._check_text([m["content"] for m in messages])
        try:
            with self._lock:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template is the model's own Jinja code: any error means these messages
            raise ChatTemplateError(self.model_path, exc) from exc
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _check_messages(items: list[Any]) -> list[dict[str, str]]:
    """Chat messages: dicts whose `role` and `content` are strings (UserError naming the first bad one)."""
    for i, message in enumerate(items):
        if not all(isinstance(message.get(key), str) for key in ("role", "content")):
            raise UserError(
                f"chat message {i} must have string 'role' and 'content' entries, got {message!r}"
            )
    return cast(list[dict[str, str]], items)


def token_chars(tokenizer: Any) -> int | None:
    """The most characters of a prompt one token covers: its vocabulary entry's length (added tokens included),
    for BPE with byte fallback (a piece's own characters, or 6 for one `<0xNN>` byte) and byte-level BPE (a
    vocabulary character per byte, at least one byte per character; an NFC normalizer's compositions keep
    that). None for other tokenizers: an unknown token fused over a run, or a pre-tokenizer that drops
    whitespace, covers any length. One exception, by choice: a normalizer that folds runs of spaces (the
    stories260K tokenizer's) lets a token cover a run of any length; such a prompt is refused by its raw length
    all the same, as that normalizer's regex takes time quadratic in a run's length, with the tokenizer lock
    held: the Llama tokenizers (sentencepiece's and byte-level) fold nothing."""
    from tokenizers.models import BPE

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.model, BPE):
        return None
    if not (backend.model.byte_fallback or "ByteLevel" in repr(backend.pre_tokenizer)):
        return None
    return max((len(token) for token in tokenizer.get_vocab()), default=None)


class Detokenizer:
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


def check_stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
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


def stop_string_cut(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the first stop string starts in `text`, if any, searching from `start`."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def stable_end(text: str, stops: Sequence[str]) -> int:
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
