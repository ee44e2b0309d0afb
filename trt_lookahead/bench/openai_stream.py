"""A timed OpenAI streaming client for `bench --peers llama-server`: one streamed `/v1/completions` request with
token-id prompts, and a closed-loop level of N client threads. The stdlib's http.client, one connection per
request, so no client library's buffering or retries sit between the server and the clock.

    answer = stream_completion("http://127.0.0.1:8080", {"prompt": [1, 2, 3], "max_tokens": 32,
                                                          "temperature": 0})
    answers, seconds = run_level("http://127.0.0.1:8080", prompts, concurrency=8, body={"max_tokens": 128})
    answer.ttft, answer.itl, answer.tokens, answer.text

Timing, in perf_counter seconds from just before the request is sent: `ttft` to the first chunk with text,
`seconds` to the chunk that carries the finish_reason; `itl` = (seconds - ttft) / (tokens - 1), the request's
mean inter-token latency (as AIPerf defines it: a server that sends a block of tokens in one chunk is not
charged per chunk). `tokens` is the server's usage.completion_tokens (stream_options.include_usage).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

REQUEST_TIMEOUT = 600.0  # seconds a request may take (connection and each read)


class StreamError(RuntimeError):
    """A request the server refused or broke off (its status and error message)."""


@dataclass
class Answer:
    """What one streamed request saw."""

    prompt: int  # index into the level's prompts
    ttft: float
    seconds: float
    tokens: int
    text: str
    finish_reason: str

    @property
    def itl(self) -> float | None:
        return (self.seconds - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


def _events(response: http.client.HTTPResponse) -> Any:
    """The JSON payloads of a server-sent event stream, up to `data: [DONE]`."""
    while line := response.readline():
        text = line.decode("utf-8").strip()
        if not text.startswith("data:"):
            continue  # blank separators, comments, pings
        data = text[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def stream_completion(url: str, body: dict[str, Any], prompt: int = 0,
                      timeout: float = REQUEST_TIMEOUT) -> Answer:
    """POST `body` to url/v1/completions as a stream (stream and include_usage set here); StreamError on a
    refusal, an error event or a stream without its finish chunk."""
    parts = urlsplit(url)
    payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body=payload, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise StreamError(f"{url}/v1/completions answered {response.status}: {response.read()[:300]!r}")
        first = end = None
        text: list[str] = []
        tokens, finish = None, None
        for event in _events(response):
            now = time.perf_counter()
            if "error" in event:
                raise StreamError(f"{url} broke off the stream: {event['error']}")
            for choice in event.get("choices") or []:
                piece = choice.get("text") or ""
                if piece and first is None:
                    first = now
                text.append(piece)
                if choice.get("finish_reason") is not None:
                    end, finish = now, str(choice["finish_reason"])
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    finally:
        conn.close()
    if end is None or tokens is None or finish is None:
        raise StreamError(f"{url} ended a stream without its finish chunk or its usage chunk")
    return Answer(prompt, (first or end) - start, end - start, tokens, "".join(text), finish)


def run_level(url: str, prompts: Sequence[Sequence[int]], concurrency: int, body: dict[str, Any],
              timeout: float = REQUEST_TIMEOUT) -> tuple[list[Answer], float]:
    """Every prompt once (as token ids), from `concurrency` client threads in a closed loop (each sends its
    next request when its previous one ended, taking prompts in order); returns the answers in prompt order
    and the level's wall seconds. The first error is raised once every thread has stopped."""
    lock = threading.Lock()
    pending = list(range(len(prompts)))[::-1]
    answers: list[Answer] = []
    errors: list[BaseException] = []

    def client() -> None:
        while True:
            with lock:
                if errors or not pending:
                    return
                index = pending.pop()
            try:
                answer = stream_completion(url, {**body, "prompt": list(prompts[index])}, index, timeout)
            except BaseException as exc:  # the other threads stop taking prompts; raised below
                with lock:
                    errors.append(exc)
                return
            with lock:
                answers.append(answer)

    threads = [threading.Thread(target=client, name=f"client {i}", daemon=True) for i in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    if errors:
        raise errors[0]
    return sorted(answers, key=lambda a: a.prompt), seconds
