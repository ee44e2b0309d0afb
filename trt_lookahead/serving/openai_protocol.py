"""The OpenAI API as `trt-lookahead serve` speaks it: request models, the field policy, errors, response bodies.

Requests follow the OpenAI API reference of /v1/completions and /v1/chat/completions. Every field the API
defines is either used, accepted without effect (IGNORED), or accepted only at its "off" value (OFF_ONLY:
anything else is a 400 naming the field); a field the API does not define is a 400, as OpenAI answers it.
Three extensions: `lookahead` ({"window": W, "ngram": N, "verification": G}, true = the served config, false =
greedy), `top_k` (as vLLM has it) and `pool_scope` ("request": this request neither reads nor feeds the server's
shared n-gram pool). Responses carry `usage` and a `lookahead` object: the config that ran,
steps, tokens per step, the seed and the runtime's prefill and decode seconds. docs/design.md section 7.6.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from trt_lookahead.errors import UserError
from trt_lookahead.runtime import GenerationOutput, Prompt
from trt_lookahead.runtime.text import check_stop_strings

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: a request without temperature samples (send 0 for greedy)
DEFAULT_TOP_P = 1.0  # OpenAI's default: no nucleus filter
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens of /v1/completions (chat: the rest of the context)
DONE = "data: [DONE]\n\n"
ERROR_TYPES = {429: "server_error", 500: "server_error"}  # OpenAI answers "overloaded" with server_error
MAX_TEMPERATURE = 2  # OpenAI's range of temperature is [0, 2] (the Python API takes any value >= 0)
OUTCOMES = {429: "overloaded"}  # the metrics' outcome label of an error status; others: invalid (4xx), error (5xx)
# a surrogate in a JSON body: an escape (\\ud800, in a pair or alone) or its UTF-8 form (which json.loads passes)
SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


class ApiError(Exception):
    """An error answered with OpenAI's error object {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        message = _encodable(message)  # it may quote the client's text: a lone surrogate is escaped, never sent
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else _encodable(param)
        self.code = code

    @property
    def outcome(self) -> str:
        return OUTCOMES.get(self.status, "invalid" if self.status < 500 else "error")

    def body(self) -> dict[str, Any]:
        error_type = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.code}}


def _encodable(text: str) -> str:
    """`text` with any lone surrogate written as its escape (\\ud800), so that it can be sent as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _bad(message: str, **context: Any) -> PydanticCustomError:
    return PydanticCustomError("bad_value", message, context)


def _stop_strings(value: Any) -> tuple[str, ...]:
    """The runtime's rule (at most MAX_STOP_STRINGS of MAX_STOP_CHARS each), answered with param "stop"."""
    if value is not None and not isinstance(value, str | list):
        raise _bad("stop must be a string or a list of strings, got {got}", got=_short(value))
    try:
        return check_stop_strings(value)
    except UserError as exc:
        raise _bad(str(exc)) from None


def _token_ids(value: Any) -> bool:
    """A non-empty list of integers (JSON's true and false are not token ids)."""
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _one_prompt(value: Any) -> str | list[int]:
    """One prompt: text or token ids; a list holding exactly one of those is unwrapped (one prompt per request).
    A nested list must be token ids: [["a"]] is not a prompt."""
    if isinstance(value, str) or _token_ids(value):
        return value
    if isinstance(value, list) and len(value) == 1 and (isinstance(value[0], str) or _token_ids(value[0])):
        return value[0]
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        raise _bad("this server takes one prompt per request, got {count}; send them as separate requests",
                   count=len(value))
    raise _bad("prompt must be a string or a non-empty list of token ids, got {got}", got=_short(value))


def _text_content(value: Any) -> str:
    """A message's content: a string, or a list of text parts {"type": "text", "text": ...} joined by newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        kinds = sorted({str(p.get("type")) for p in value} - {"text"})
        if kinds:
            raise _bad("only text content parts are supported, got type {kinds}", kinds=", ".join(kinds))
        if all(isinstance(p.get("text"), str) and set(p) == {"type", "text"} for p in value):
            return "\n".join(p["text"] for p in value)
    raise _bad("content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts, got {got}",
               got=_short(value))


def _same(value: Any, off: Any) -> bool:
    """value equals the off value, and is a bool exactly when that is (JSON's 0 and false are different)."""
    return bool(value == off) and isinstance(value, bool) == isinstance(off, bool)


def _short(value: Any, limit: int = 80) -> str:
    """`value` as JSON (as the client sent it), cut to `limit` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Strict(BaseModel):
    """No coercion (a string is not a number) and no unknown fields; IGNORED and OFF_ONLY fields checked first."""

    model_config = ConfigDict(extra="forbid", strict=True)
    IGNORED: ClassVar[tuple[str, ...]] = ()
    OFF_ONLY: ClassVar[dict[str, tuple[Any, ...]]] = {}  # field -> the values that mean "off"

    @model_validator(mode="before")
    @classmethod
    def _field_policy(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, allowed in cls.OFF_ONLY.items():
            if name in data and not any(_same(data[name], a) for a in allowed):
                offer = f" (or send {json.dumps(allowed[1])})" if len(allowed) > 1 else ""
                raise PydanticCustomError(
                    "unsupported", "{field}={got} is not supported by this server; omit {field}{offer}",
                    {"field": name, "got": _short(data[name]), "offer": offer},
                )
        return {k: v for k, v in data.items() if k not in cls.IGNORED and k not in cls.OFF_ONLY}


class LookaheadOption(_Strict):
    """The `lookahead` extension: each value at most the served config's; omitted ones take the served value."""

    window: int | None = None
    ngram: int | None = None
    verification: int | None = None


def _lookahead_option(value: Any) -> LookaheadOption | bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, dict):
        try:
            return LookaheadOption.model_validate(value)
        except ValidationError as exc:
            raise _bad("lookahead: {detail}", detail=api_error(exc).message) from None
    raise _bad("lookahead must be false (greedy), true (the served config) or an object {\"window\": W, "
               "\"ngram\": N, \"verification\": G}, got {got}", got=_short(value))


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted; this server adds no obfuscation field


class GenerationRequest(_Strict):
    """The fields /v1/completions and /v1/chat/completions share."""

    ENDPOINT: ClassVar[str]  # the metrics label
    OBJECT: ClassVar[str]
    CHUNK_OBJECT: ClassVar[str]
    ID_PREFIX: ClassVar[str]
    PROMPT_PARAM: ClassVar[str]  # the field the prompt came in (an error about the prompt names it)

    model: str
    # types only: the values' ranges are the runtime's checks (LookaheadRuntime.check_request), one rule for all;
    # max_tokens against the context: length_error, naming this API's fields
    max_tokens: int | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM): 0 = off
    pool_scope: Literal["shared", "request"] | None = None  # extension: None = the server's --pool-scope
    seed: int | None = None
    stop: Annotated[tuple[str, ...], BeforeValidator(_stop_strings)] = ()
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    lookahead: Annotated[LookaheadOption | bool | None, BeforeValidator(_lookahead_option)] = None

    @field_validator("temperature")
    @classmethod
    def _openai_temperature(cls, value: float | None) -> float | None:
        if value is not None and not 0 <= value <= MAX_TEMPERATURE:  # NaN too
            raise _bad("temperature must be in [0, {top}] (OpenAI's range), got {got}", top=MAX_TEMPERATURE, got=value)
        return value

    @model_validator(mode="after")
    def _check(self) -> GenerationRequest:
        if self.n not in (None, 1):
            also = " (or {n} separate requests, with different seeds when sampling)" if self.n > 1 else ""
            raise PydanticCustomError(
                "unsupported", "n={n} is not supported: this server returns one choice per request; send n=1" + also,
                {"field": "n", "n": self.n},
            )
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError(
                "unsupported", "stream_options is only allowed with stream=true", {"field": "stream_options"}
            )
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self) -> dict[str, Any]:
        """temperature, top_p and top_k as LookaheadRuntime.stream takes them, OpenAI's defaults filled in."""
        return {
            "temperature": DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            "top_p": DEFAULT_TOP_P if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k is None else self.top_k,
        }

    def runtime_prompt(self) -> Prompt:
        """What LookaheadRuntime.encode takes: text or token ids, or chat messages."""
        raise NotImplementedError

    def requested_tokens(self, room: int) -> int:
        """The new tokens asked for, or the endpoint's default; `room` is what the context has left."""
        raise NotImplementedError

    @property
    def tokens_param(self) -> str:
        """The field that asked for the new tokens (the one an error about them names)."""
        return "max_tokens"

    def param(self, argument: str | None) -> str | None:
        """The field that gave the runtime's `argument` (a UserError's `field`): the same name but for the prompt
        and the new tokens."""
        return {"prompt": self.PROMPT_PARAM, "max_new_tokens": self.tokens_param}.get(argument or "", argument)

    def choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        raise NotImplementedError

    def delta(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def opening(self) -> list[dict[str, Any]]:
        """Stream chunks' choices sent before the first text."""
        return []


class CompletionRequest(GenerationRequest):
    ENDPOINT = "completions"
    OBJECT = "text_completion"
    CHUNK_OBJECT = "text_completion"
    ID_PREFIX = "cmpl-"
    PROMPT_PARAM = "prompt"
    IGNORED = ("user",)
    OFF_ONLY = {
        "best_of": (None, 1), "echo": (None, False), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
        "logit_bias": (None, {}), "logprobs": (None,), "suffix": (None, ""),
    }

    prompt: Annotated[str | list[int], BeforeValidator(_one_prompt)]

    def runtime_prompt(self) -> Prompt:
        return self.prompt

    def requested_tokens(self, room: int) -> int:
        return DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def delta(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return self.choice(text, finish_reason)


class ChatMessage(_Strict):
    """A message; `developer` is OpenAI's new name of `system` (chat templates know `system`)."""

    # fields an assistant message copied from a response carries, empty
    OFF_ONLY = {"refusal": (None,), "tool_calls": (None, []), "function_call": (None,), "audio": (None,),
                "annotations": (None, [])}

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, BeforeValidator(_text_content)]
    name: str | None = None  # accepted; the chat templates we serve do not use it

    def template_message(self) -> dict[str, str]:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatRequest(GenerationRequest):
    ENDPOINT = "chat"
    OBJECT = "chat.completion"
    CHUNK_OBJECT = "chat.completion.chunk"
    ID_PREFIX = "chatcmpl-"
    PROMPT_PARAM = "messages"
    IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
               "parallel_tool_calls")
    OFF_ONLY = {
        "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}),
        "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none"),
        "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
        "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
        "verbosity": (None,), "web_search_options": (None,),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise PydanticCustomError(
                "unsupported", "max_tokens={a} and max_completion_tokens={b} disagree; send max_completion_tokens only",
                {"field": "max_completion_tokens", "a": self.max_tokens, "b": self.max_completion_tokens},
            )
        return self

    def runtime_prompt(self) -> Prompt:
        return [m.template_message() for m in self.messages]

    @property
    def tokens_param(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def requested_tokens(self, room: int) -> int:
        asked = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        return max(room, 1) if asked is None else asked  # a prompt that fills the context: the runtime says so

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text, "refusal": None}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}

    def delta(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def opening(self) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]


def parse_request(raw: bytes, kind: type[GenerationRequest]) -> GenerationRequest:
    """The request body as `kind`, or ApiError(400) naming the first problem and its field.

    Whatever the bytes, the answer is a 400, never a 500: JSON nested too deeply for the parser, an integer
    past Python's 4,300 digits, NaN or Infinity (not JSON), and strings holding a lone surrogate (\\ud800 alone:
    not Unicode text, which the tokenizer and the response's UTF-8 cannot take) are refused here."""
    try:
        data = json.loads(raw, parse_constant=_not_json)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply to parse; send a flat JSON object",
                       code="invalid_json") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, an integer of over 4,300 digits, NaN
        raise ApiError(400, f"the request body is not valid JSON ({exc}); send a JSON object", code="invalid_json") \
            from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    if SURROGATE.search(raw):  # else no string can hold one: the walk is skipped
        _check_unicode(data)
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        raise api_error(exc) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply; send the fields as the API defines them") \
            from None


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")


def _check_unicode(data: dict[str, Any]) -> None:
    """ApiError(400) naming a string (or key) of `data` that holds a lone surrogate; a loop, not a recursion."""
    pending: list[tuple[str, Any]] = [("", data)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                here = f"{path}.{key}" if path else key
                _check_text(here, key)
                pending.append((here, item))
        elif isinstance(value, list):
            pending.extend((f"{path}.{i}", item) for i, item in enumerate(value) if isinstance(item, str | dict | list))
        elif isinstance(value, str):
            _check_text(path, value)


def _check_text(path: str, text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{path} holds a lone surrogate ({_encodable(text[exc.start])} at character {exc.start}), "
                       "which is not Unicode text; send each surrogate in a pair (or the character itself)",
                       param=path) from None


def api_error(exc: ValidationError) -> ApiError:
    """The first validation error as one message with the field's path as `param`."""
    error = exc.errors(include_url=False)[0]
    context = error.get("ctx") or {}
    path = [str(p) for p in error["loc"]] + ([context["field"]] if "field" in context else [])
    param = ".".join(path) or None
    if error["type"] == "missing":
        message = f"{param} is required"
    elif error["type"] == "extra_forbidden":
        message = f"unrecognized request argument supplied: {param}"
    elif error["type"] in ("bad_value", "unsupported"):
        message = error["msg"]
    else:
        message = f"{param}: {error['msg']}, got {_short(error['input'])}"
    return ApiError(400, message, param=param)


# -- responses --------------------------------------------------------------------------------------


def usage(output: GenerationOutput) -> dict[str, int]:
    return {
        "prompt_tokens": output.prompt_tokens,
        "completion_tokens": output.generated_tokens,
        "total_tokens": output.prompt_tokens + output.generated_tokens,
    }


def lookahead_report(output: GenerationOutput, seed: int) -> dict[str, Any]:
    """The response's `lookahead` extension (measures as docs/design.md section 8 defines them)."""
    return {
        "config": output.config,
        "steps": output.steps,
        "tokens_per_step": round(output.compression, 4),
        "seed": seed,
        "prefill_seconds": round(output.prefill_seconds, 6),
        "decode_seconds": round(output.decode_seconds, 6),
    }


def envelope(kind: GenerationRequest, rid: str, created: int, chunk: bool, choices: list[dict[str, Any]],
             **extra: Any) -> dict[str, Any]:
    """A response (chunk=False) or stream chunk body around `choices`."""
    body = {"id": rid, "object": kind.CHUNK_OBJECT if chunk else kind.OBJECT, "created": created, "model": kind.model,
            "choices": choices}
    body.update(extra)
    return body


def sse(body: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
