"""Issue 39 items 1, 2, 5, 6 and 10 over HTTP: no request can stall, starve or outlive another.

`trt-lookahead serve` on a copy of stories260K whose chat template refuses system messages (a subprocess on
loopback, started as test_openai_server.py starts it, whose helpers this module uses). Hostile requests (a 20 MB
body, a 2,000-entry stop list, JSON the parser cannot take, lone surrogates) are refused with OpenAI error objects
and counted, while /health and a small request beside them still answer, and answer what the same request
alone answers. A second server is stopped with SIGTERM under load: every stream ends with an error event and
[DONE], every waiting request gets a JSON 503, and the process exits 0 without a traceback. A third runs in a
thread with a one-second body timeout, for the 408.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("openai", reason="serve tests need the openai client (pip install 'trt-lookahead[test]')")
uvicorn = pytest.importorskip("uvicorn", reason="serve needs the serve extra (pip install 'trt-lookahead[serve]')")

from test_openai_server import (  # the same directory: one way to start and read `serve`  # noqa: E402
    JSON,
    NAME,
    PROMPTS,
    SERVED,
    STORIES,
    TIMEOUT,
    ServeProcess,
    get,
    metrics,
    post,
    serving,
    templated_copy,
    wait_for,
)

from trt_lookahead.serving import DEFAULT_MAX_BODY_BYTES  # noqa: E402

pytestmark = pytest.mark.server

PROMPT_CHECK = "the template refuses system messages"
STRICT_CHAT = (  # ChatML, but a system message is the template's own error (raise_exception)
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ raise_exception('" + PROMPT_CHECK + "') }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PROMPT_BOUND = 10  # s: "answered promptly": generous, a stalled event loop took 20 s and more (issue 39)
BIG = 20_000_000  # bytes: the issue's 20 MB body
SMALL = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0, "pool_scope": "request"}
INVALID = 'trt_lookahead_requests_total{endpoint="completions",outcome="invalid"}'
CANCELLED = 'trt_lookahead_requests_total{endpoint="completions",outcome="cancelled"}'


@pytest.fixture(scope="module")
def strict_model(tmp_path_factory):
    """stories260K with a chat template that raises on system messages."""
    return templated_copy(tmp_path_factory.mktemp("strict"), STRICT_CHAT)


@pytest.fixture(scope="module")
def server(strict_model, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("serve"), "--model", str(strict_model), "--lookahead_config", SERVED,
                 "--threads", "1", "--max-batch", "2") as srv:
        yield srv


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def send_huge(url: str, chunked: bool, size: int = BIG) -> bytes:
    """POST a body of `size` bytes (Content-Length or chunked) on a raw socket, reading the answer while sending.

    The server answers before it has read the body and closes the connection: the rest of the upload then
    fails (a reset or broken pipe), which is expected; the answer has arrived by then."""
    framing = b"Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {size}\r\n".encode()
    piece = b"x" * 100_000
    wire = (b"%x\r\n" % len(piece) + piece + b"\r\n") if chunked else piece
    sock = socket.create_connection(address(url), timeout=TIMEOUT)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n" + framing
                 + b"\r\n")

    def upload() -> None:
        try:
            for _ in range(size // len(piece)):
                sock.sendall(wire)
        except OSError:
            pass

    sender = threading.Thread(target=upload)
    sender.start()
    answer = b""
    try:
        while block := sock.recv(65536):
            answer += block
    except OSError:  # the reset after the answer
        pass
    sender.join(timeout=TIMEOUT)
    sock.close()
    return answer


def raw_answer(url: str, rest: bytes) -> bytes:
    """Everything the server sends, until it closes, after a POST /v1/completions's first lines and `rest` (the
    other header lines, and what the test sends of a body)."""
    sock = socket.create_connection(address(url), timeout=TIMEOUT)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n" + rest)
    answer = b""
    while block := sock.recv(65536):
        answer += block
    sock.close()
    return answer


def status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_health_and_a_small_request_answer_while_huge_bodies_and_stop_lists_are_refused(server):
    """Item 1 and 2's reproductions: before the fix each of these held the event loop for 20 s and more."""
    alone = post(server.url + "/v1/completions", SMALL)
    assert alone[0] == 200, alone
    huge_prompt = {**SMALL, "prompt": "Once upon a time " * 240_000}  # 4 MB: inside the body limit
    stops = {**SMALL, "prompt": PROMPTS[0], "max_tokens": 300, "stop": ["x" * 2000 + str(i) for i in range(2000)]}
    before = metrics(server.url)
    with ThreadPoolExecutor(4) as pool:
        hostile = [pool.submit(send_huge, server.url, False), pool.submit(send_huge, server.url, True),
                   pool.submit(post, server.url + "/v1/completions", stops),
                   pool.submit(post, server.url + "/v1/completions", huge_prompt)]
        time.sleep(0.5)  # they are being read, parsed and refused
        started = time.monotonic()
        health = get(server.url + "/health")
        health_seconds = time.monotonic() - started
        small = post(server.url + "/v1/completions", SMALL)
        small_seconds = time.monotonic() - started
        answers = [f.result(timeout=TIMEOUT) for f in hostile]
    assert health == (200, '{"status":"ok"}') and health_seconds < PROMPT_BOUND
    assert small_seconds < PROMPT_BOUND
    assert small[0] == 200 and json.loads(small[1])["choices"] == json.loads(alone[1])["choices"]
    assert json.loads(small[1])["usage"] == json.loads(alone[1])["usage"]
    for answer in answers[:2]:
        status, error = status_and_error(answer)
        assert status == 413 and error["code"] == "body_too_large", error
        assert str(DEFAULT_MAX_BODY_BYTES) in error["message"] and "--max-body-bytes" in error["message"]
    status, text = answers[2]
    assert status == 400 and json.loads(text)["error"]["param"] == "stop", text
    assert "at most 16" in json.loads(text)["error"]["message"]
    status, text = answers[3]
    assert status == 400 and json.loads(text)["error"]["param"] == "prompt", text
    assert "cannot fit max_seq_len 512" in json.loads(text)["error"]["message"]
    assert metrics(server.url)[INVALID] - before.get(INVALID, 0) == 4


def test_a_body_declared_too_large_is_refused_before_it_is_sent(server):
    """Content-Length alone decides: the answer comes with no byte of the body sent."""
    answer = raw_answer(server.url, b"Content-Length: %d\r\n\r\n" % (DEFAULT_MAX_BODY_BYTES + 1))
    status, error = status_and_error(answer)
    assert status == 413 and f"{DEFAULT_MAX_BODY_BYTES + 1} bytes" in error["message"], error
    assert status_and_error(send_huge(server.url, True, DEFAULT_MAX_BODY_BYTES + 200_000))[0] == 413
    assert post(server.url + "/v1/completions", SMALL)[0] == 200


def test_a_client_waiting_for_100_continue_gets_the_413_instead(server):
    """curl sends `Expect: 100-continue` before a large upload and waits; a body declared too large is refused
    at once, with no 100 Continue first, so the client never starts sending it."""
    declared = 2 * DEFAULT_MAX_BODY_BYTES
    answer = raw_answer(server.url, b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % declared)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    error = status_and_error(answer)[1]
    assert error["code"] == "body_too_large" and f"{declared} bytes" in error["message"], error
    assert post(server.url + "/v1/completions", SMALL)[0] == 200


def test_serve_raises_its_open_file_limit_to_the_hard_one():
    """Every connection holds a file; a process started at soft 256 under a hard 1024 may open 1024."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 1024)); "
            "from trt_lookahead.serving.openai_api import allow_many_connections; allow_many_connections(); "
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() \
        == ["1024", "1024"]


def test_a_refusal_sent_mid_upload_reaches_the_client_whole(server):
    """The 413 comes while the client still uploads; closing then, with its input unread, reset the connection,
    and the reset lost the answer's body for some in a hundred (the status line alone arrived). The server reads
    and drops the rest of the upload before it closes, so every answer arrives whole."""
    size = 5_200_000  # past the limit in send_huge's whole pieces: each upload ends, none waits out LINGER_SECONDS
    answers = [send_huge(server.url, False, size) for _ in range(100)]
    whole = [answer for answer in answers if answer.endswith(b"}")]
    assert len(whole) == len(answers), f"{len(answers) - len(whole)} of {len(answers)} answers lost their body"
    assert {(status, error["code"]) for status, error in map(status_and_error, whole)} == {(413, "body_too_large")}
    assert post(server.url + "/v1/completions", SMALL)[0] == 200


def closed_by_server(sock: socket.socket, head: bytes) -> bool:
    """Send `head` a byte every half second; True once the server closes the connection, False if all was sent."""
    sock.settimeout(0.5)
    try:
        for i in range(len(head)):
            sock.send(head[i:i + 1])
            with contextlib.suppress(TimeoutError):
                if sock.recv(1) == b"":
                    return True
    except OSError:  # reset: closed, and this byte came after
        return True
    return False


def test_idle_and_trickling_connections_are_closed_so_others_can_connect(tmp_path):
    """uvicorn alone kept a connection that sent nothing, or its head a byte at a time, open forever: 400 of them
    at a 256-file limit, and /health could not connect for as long as they stayed (while asyncio logged two
    thousand tracebacks a second). Each is closed HEAD_TIMEOUT_SECONDS after it opened, unanswered; /health,
    waiting behind them, is then accepted and answered; the server says once that it could not accept."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nX-Padding: " + b"x" * 200  # 100 s at 2 bytes/s
    with serving(tmp_path, "--model", str(STORIES), "--lookahead_config", SERVED, "--threads", "1",
                 open_files=256) as srv:
        trickling = socket.create_connection(address(srv.url), timeout=TIMEOUT)
        idle = [socket.create_connection(address(srv.url), timeout=TIMEOUT) for _ in range(400)]
        with ThreadPoolExecutor(1) as pool:
            closed = pool.submit(closed_by_server, trickling, head)
            health = get(srv.url + "/health")
            assert closed.result(timeout=TIMEOUT), "a head sent a byte every half second held its connection"
        assert health == (200, '{"status":"ok"}')
        assert all(sock.recv(1) == b"" for sock in idle)  # closed by the server, with no answer
        assert post(srv.url + "/v1/completions", SMALL)[0] == 200
        for sock in [trickling, *idle]:
            sock.close()
        log = srv.tail(100_000)
    assert log.count("cannot accept new connections (") == 1 and "Traceback" not in log, log[-3000:]


NOT_JSON = [  # item 6: each was a 500 (and not counted) before the fix
    (b'{"model": "stories260K", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nested too deeply"),
    (b'{"model": "stories260K", "prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}", None, "4300 digits"),
    (b'{"model": "stories260K", "prompt": "Hi", "temperature": NaN}', None, "NaN is not a JSON number"),
    (json.dumps({**SMALL, "prompt": "a\ud800"}).encode(), "prompt", "lone surrogate"),
    (json.dumps({**SMALL, "prompt": ["a\udfff"]}).encode(), "prompt.0", "lone surrogate"),
    (json.dumps({**SMALL, "stop": ["ok", "\ud800"]}).encode(), "stop.1", "lone surrogate"),
    (json.dumps({**SMALL, "model": "\ud800"}).encode(), "model", "lone surrogate"),  # once echoed: 500
    (json.dumps({**SMALL, "\ud800": 1}).encode(), "\\ud800", "lone surrogate"),
    (b'{"model": "stories260K", "prompt": "a\xed\xa0\x80"}', "prompt", "lone surrogate"),  # raw UTF-8 form
]


@pytest.mark.parametrize(("raw", "param", "words"), NOT_JSON, ids=[w + str(i) for i, (_, _, w) in enumerate(NOT_JSON)])
def test_bodies_the_parser_cannot_take_are_400_and_counted(server, raw, param, words):
    before = metrics(server.url)
    status, text = post(server.url + "/v1/completions", raw)
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == param and words in error["message"], text
    assert metrics(server.url)[INVALID] - before.get(INVALID, 0) == 1


def test_a_lone_surrogate_in_a_chat_message_is_400(server):
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi \ud83d"}], "max_tokens": 4}
    status, text = post(server.url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and json.loads(text)["error"]["param"] == "messages.0.content", text


OPENAI_RULES = [  # item 10: OpenAI's rules of these values
    ({**SMALL, "temperature": 5}, "temperature", "temperature must be in [0, 2]"),
    ({**SMALL, "temperature": 1e308}, "temperature", "temperature must be in [0, 2]"),
    ({**SMALL, "prompt": [["a"]]}, "prompt", "a non-empty list of token ids"),
    ({**SMALL, "n": 0}, "n", "one choice per request; send n=1"),
]


@pytest.mark.parametrize(("body", "param", "words"), OPENAI_RULES, ids=[str(i) for i in range(len(OPENAI_RULES))])
def test_openai_value_rules_are_400(server, body, param, words):
    status, text = post(server.url + "/v1/completions", body)
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == param and words in error["message"], text
    assert "0 separate" not in error["message"]


def test_a_chat_template_error_names_the_model_not_its_path(server, strict_model):
    body = {"model": NAME, "messages": [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]}
    status, text = post(server.url + "/v1/chat/completions", body)
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "messages", text
    assert PROMPT_CHECK in error["message"] and repr(NAME) in error["message"], text
    assert str(strict_model.parent) not in text


def test_a_client_leaving_mid_upload_is_counted_cancelled_without_a_traceback(server):
    before = metrics(server.url)
    sock = socket.create_connection(address(server.url), timeout=TIMEOUT)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"model\": ")
    time.sleep(0.3)
    sock.close()
    wait_for(lambda: metrics(server.url).get(CANCELLED, 0) == before.get(CANCELLED, 0) + 1, "the cancellation")
    log = server.tail(20_000)
    assert "Traceback" not in log and "ClientDisconnect" not in log, log


@pytest.fixture(scope="module")
def impatient(one_torch_thread):
    """A server in a thread that waits one second for a request body (the default is BODY_TIMEOUT_SECONDS)."""
    from trt_lookahead.runtime import LookaheadRuntime
    from trt_lookahead.serving.openai_api import OpenAIServer, listen

    runtime = LookaheadRuntime.from_pretrained(STORIES, lookahead=SERVED, max_batch=1)
    sock = listen("127.0.0.1", 0)
    app = OpenAIServer(runtime, model_name=NAME, body_timeout=1).app()
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: srv.started, "uvicorn to start")
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    thread.join(timeout=60)
    runtime.close()


def test_a_body_that_never_completes_is_408(impatient):
    before = metrics(impatient)
    answer = raw_answer(impatient, b"Content-Length: 1000\r\n\r\n{\"model\": ")  # the rest never comes
    status, error = status_and_error(answer)
    assert status == 408 and error["code"] == "request_timeout" and "within 1 s" in error["message"], error
    assert metrics(impatient)[INVALID] - before.get(INVALID, 0) == 1
    assert post(impatient + "/v1/completions", SMALL)[0] == 200


# -- SIGTERM ----------------------------------------------------------------------------------------

# greedy on the torch executor: one token per step, so requests queued behind it still wait when the grace ends
LONG = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0, "lookahead": False}


def sse_events(url: str, body: dict, first: threading.Event) -> tuple[int, str, list]:
    """(status, content type, events) of a request: a stream's events (dicts, "[DONE]"), or a JSON body."""
    conn = http.client.HTTPConnection(*address(url), timeout=TIMEOUT)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=JSON)
    response = conn.getresponse()
    kind = response.getheader("content-type", "")
    if not kind.startswith("text/event-stream"):
        return response.status, kind, [json.loads(response.read())]
    events: list = []
    while line := response.readline():  # to the end of the response: nothing may follow [DONE]
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip()
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
            first.set()
    conn.close()
    return response.status, kind, events


def test_sigterm_under_load_ends_every_stream_with_an_error_event_and_done(tmp_path, one_torch_thread):
    """Five long requests, one slot, a 2 s grace: the stream running when the grace is nearly over ends with an
    error event and [DONE], the waiting ones (streams and the plain request last in the queue) get a JSON 503;
    any that finished before end as usual. Nothing is cut mid-event, nothing is logged as a traceback."""
    srv = ServeProcess(tmp_path / "serve.log", "--model", str(STORIES), "--backend", "torch", "--lookahead_config",
                       SERVED, "--threads", "1", "--max-batch", "1", "--shutdown-grace", "2")
    try:
        srv.wait_ready(timeout=300)
        started = threading.Event()
        with ThreadPoolExecutor(5) as pool:
            first = pool.submit(sse_events, srv.url, {**LONG, "stream": True}, started)
            assert started.wait(TIMEOUT), "the first stream did not start"
            queued = [pool.submit(sse_events, srv.url, {**LONG, "stream": i < 3, "prompt": PROMPTS[i]},
                                  threading.Event()) for i in range(4)]
            wait_for(lambda: metrics(srv.url)["trt_lookahead_queue_length"] == 4, "four requests to wait")
            srv.proc.send_signal(signal.SIGTERM)
            answers = [f.result(timeout=TIMEOUT) for f in [first, *queued]]
        assert srv.proc.wait(timeout=60) == 0
        log = srv.tail(50_000)
    finally:
        srv.stop()
    ends = []
    for status, kind, events in answers:
        if status == 503:
            assert kind == "application/json" and events[0]["error"]["code"] == "shutting_down", events
            ends.append("503")
            continue
        assert status == 200 and kind.startswith("text/event-stream"), (status, kind, events)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
        assert all("choices" in e for e in events[:-2]), events  # whole events before the last: nothing cut
        if "error" in events[-2]:
            error = events[-2]["error"]
            assert error["code"] == "shutting_down" and "retry the request" in error["message"], error
            ends.append("error event")
        else:
            assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2]
            ends.append("finished")
    # one slot: one stream ran when the grace was nearly over (the load takes many times the grace), the rest waited
    assert ends.count("error event") == 1 and "503" in ends and ends[-1] == "503", ends
    assert "Traceback" not in log and "CancelledError" not in log, log
