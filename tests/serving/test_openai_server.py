"""`trt-lookahead serve`: the OpenAI-compatible server on 127.0.0.1, driven by the official `openai` client.

One server runs for the module: `trt-lookahead serve --max-batch 4` in a subprocess, on a copy of
stories260K with a chat template added (the fixture has none). Every answer is compared with
`trt-lookahead generate --json` run in this process for the same request (a solo run). A second server runs
in a thread on the original stories260K (no chat template) with two slots and a queue of one, for the 429
and no-template errors.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import io
import json
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="serve tests need the openai client (pip install 'trt-lookahead[test]')")
uvicorn = pytest.importorskip("uvicorn", reason="serve needs the serve extra (pip install 'trt-lookahead[serve]')")

from trt_lookahead.cli import main  # noqa: E402
from trt_lookahead.serving.server import _die_with_parent  # noqa: E402

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
NAME = "stories260K"
SERVED = "4,3,4"
PROMPTS = ["Once upon a time", "Lily and Tom went to the park. They", "The cat sat on the", "Sam had a red ball"]
LONG_PROMPT = "Once upon a time " * 200  # ~800 tokens; stories260K holds 512
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TIMEOUT = 120
MAX_BATCH = 4
JSON = {"Content-Type": "application/json"}
READY = re.compile(r"on http://127\.0\.0\.1:(\d+)/v1")

pytestmark = pytest.mark.server


# -- servers ------------------------------------------------------------------------------------


class ServeProcess:
    """`python -m trt_lookahead.cli serve ...` on --port 0; the port is read from its ready line. `open_files`:
    the process's limit on open files (soft and hard: serve raises its soft limit to the hard one)."""

    def __init__(self, log: Path, *argv: str, open_files: int | None = None) -> None:
        def prepare() -> None:
            _die_with_parent()
            if open_files is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

        self.log = log
        self._out = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "trt_lookahead.cli", "serve", "--port", "0", *argv],
                                     stdout=self._out, stderr=subprocess.STDOUT, preexec_fn=prepare)
        self.url = ""

    def wait_ready(self, timeout: float) -> ServeProcess:
        deadline = time.monotonic() + timeout
        while not (match := READY.search(self.log.read_text(errors="replace"))):
            assert self.proc.poll() is None and time.monotonic() < deadline, f"serve did not start:\n{self.tail()}"
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{match.group(1)}"
        while True:  # the ready line comes just before uvicorn accepts; the socket already queues connections
            with contextlib.suppress(OSError):
                if get(self.url + "/health")[0] == 200:
                    return self
            assert time.monotonic() < deadline, self.tail()
            time.sleep(0.1)

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=TIMEOUT, **kwargs)

    def tail(self, chars: int = 3000) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> int:
        """SIGTERM, as a process manager stops it: uvicorn finishes and the command exits 0."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        return self.proc.returncode


def templated_copy(folder: Path, template: str) -> Path:
    """A copy of stories260K in `folder` with `template` as the chat template of its tokenizer_config.json."""
    path = folder / NAME
    shutil.copytree(STORIES, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return path


@contextlib.contextmanager
def serving(folder: Path, *args: str, open_files: int | None = None):
    """`serve *args` ready (log in `folder`); stopped with SIGTERM afterwards, which must exit 0."""
    srv = ServeProcess(folder / "serve.log", *args, open_files=open_files)
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        code = srv.stop()
    assert code == 0, f"serve exited with {code} after SIGTERM:\n{srv.tail()}"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, one_torch_thread) -> Path:
    """stories260K with a ChatML template in its tokenizer_config.json."""
    return templated_copy(tmp_path_factory.mktemp("chat"), CHATML)


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("serve"), "--model", str(chat_model), "--lookahead_config", SERVED,
                 "--threads", "1", "--max-batch", str(MAX_BATCH)) as srv:
        yield srv


@pytest.fixture(scope="module")
def thread_server(one_torch_thread):
    """The original stories260K (no chat template), two slots and a queue of one, uvicorn in a thread."""
    from trt_lookahead.runtime import LookaheadRuntime
    from trt_lookahead.serving.openai_api import OpenAIServer, listen

    runtime = LookaheadRuntime.from_pretrained(STORIES, lookahead=SERVED, max_batch=2, max_queue=1)
    sock = listen("127.0.0.1", 0)
    app = OpenAIServer(runtime, model_name=NAME).app()
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    thread.join(timeout=60)
    runtime.close()


# -- clients and references ---------------------------------------------------------------------


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(url: str, body: dict | bytes) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=JSON)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metrics(url: str) -> dict[str, float]:
    """The /metrics samples by `name{labels}`."""
    status, text = get(url + "/metrics")
    assert status == 200, text
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] not in ("#", ""))}


class RawStream:
    """A streamed completion over http.client, its server-sent events parsed here (no OpenAI client).

    The request is sent at once; the response (which starts with the first token) is read on demand."""

    def __init__(self, url: str, body: dict) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        self.conn.request("POST", "/v1/completions", body=json.dumps(body), headers=JSON)
        self.response: http.client.HTTPResponse | None = None
        self.events: list[dict] = []

    def next_event(self) -> dict | None:
        """The next event, or None at `data: [DONE]`."""
        if self.response is None:
            self.response = self.conn.getresponse()
            assert self.response.status == 200, self.response.read()
        while (line := self.response.readline()) != b"data: [DONE]\n":
            assert line, "the stream ended without data: [DONE]"
            if line.startswith(b"data: "):
                self.events.append(json.loads(line[len(b"data: "):]))
                return self.events[-1]
        return None

    def result(self) -> dict:
        """The whole stream -> text, finish reason, usage and the lookahead extension (as `complete`)."""
        while self.next_event() is not None:
            pass
        self.close()
        choices = [(c, e) for e in self.events for c in e["choices"]]
        finish = [(c["finish_reason"], e["lookahead"]) for c, e in choices if c["finish_reason"] is not None]
        assert len(finish) == 1 and self.events[-1]["choices"] == [], self.events
        return {"text": "".join(c["text"] for c, _ in choices), "finish_reason": finish[0][0],
                "usage": self.events[-1]["usage"], "lookahead": finish[0][1]}

    def close(self) -> None:
        if self.response is not None:
            self.response.close()
        self.conn.close()


def wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@functools.cache
def cli_generate(model: str, prompt: str, *args: str) -> dict:
    """`trt-lookahead generate --json` in this process (one torch thread, as the server runs)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", "--model", model, "--prompt", prompt, "--threads", "1", "--json", *args]) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


def reference(model: Path, prompt: str, max_tokens: int, *, temperature: float = 0.0, seed: int = 0,
              top_p: float = 1.0, config: str = SERVED, chat: bool = False) -> dict:
    mode = ["--greedy"] if config == "greedy" else ["--lookahead_config", config]
    return cli_generate(str(model), prompt, "--max-new-tokens", str(max_tokens), "--temperature", str(temperature),
                        "--seed", str(seed), "--top-p", str(top_p), *mode, *(["--chat"] if chat else []))


def complete(client, prompt: str, max_tokens: int, stream: bool = False, chat: bool = False, model: str = NAME,
             **kwargs) -> dict:
    """One request through the openai client -> text, finish reason, usage and the lookahead extension."""
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("seed", 0)
    # request scope: steps then equal a lone `generate` run's (the shared pool changes drafts, not tokens)
    kwargs["extra_body"] = {"pool_scope": "request", **kwargs.get("extra_body", {})}
    if chat:
        call = functools.partial(client.chat.completions.create, messages=[{"role": "user", "content": prompt}],
                                 max_completion_tokens=max_tokens)
    else:
        call = functools.partial(client.completions.create, prompt=prompt, max_tokens=max_tokens)
    if not stream:
        r = call(model=model, **kwargs)
        choice = r.choices[0]
        text = choice.message.content if chat else choice.text
        return {"text": text, "finish_reason": choice.finish_reason, "usage": r.usage.model_dump(),
                "lookahead": r.model_extra["lookahead"], "pieces": 1}
    pieces, finish, extension, usage = [], None, None, None
    for chunk in call(model=model, stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            pieces.append((choice.delta.content or "") if chat else choice.text)
            if choice.finish_reason is not None:
                finish, extension = choice.finish_reason, chunk.model_extra["lookahead"]
    return {"text": "".join(pieces), "finish_reason": finish, "usage": usage, "lookahead": extension,
            "pieces": len(pieces)}


def assert_same(got: dict, want: dict) -> None:
    assert got["text"] == want["text"]
    assert got["finish_reason"] == want["finish_reason"]
    assert got["usage"]["prompt_tokens"] == want["prompt_tokens"]
    assert got["usage"]["completion_tokens"] == want["generated_tokens"]
    assert got["usage"]["total_tokens"] == want["prompt_tokens"] + want["generated_tokens"]
    assert got["lookahead"]["config"] == want["config"]
    if want["config"] != "auto":  # `auto` chooses by the step times it measures: its steps vary from run to run
        assert got["lookahead"]["steps"] == want["steps"]


# -- endpoints ----------------------------------------------------------------------------------


def test_models_health_and_unknown_routes(server):
    assert get(server.url + "/health") == (200, '{"status":"ok"}')
    models = server.client().models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].model_extra["max_model_len"] == 512
    assert models[0].model_extra["lookahead"] == {"window": 4, "ngram": 3, "verification": 4, "auto": False}
    assert server.client().models.retrieve(NAME).id == NAME
    for status, body in (get(server.url + "/v1/models/gpt-4o"), get(server.url + "/v1/nothing-here")):
        assert status == 404 and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}, body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_completions_equal_cli_generate(server, chat_model, prompt, stream):
    got = complete(server.client(), prompt, 48, stream=stream)
    assert_same(got, reference(chat_model, prompt, 48))
    if stream:  # one event per accepted block with text, so fewer events than tokens (lookahead at work)
        assert 1 < got["pieces"] <= got["lookahead"]["steps"] + 1


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_equal_cli_generate_chat(server, chat_model, stream):
    got = complete(server.client(), "Tell me a story about a dog.", 40, stream=stream, chat=True)
    assert_same(got, reference(chat_model, "Tell me a story about a dog.", 40, chat=True))


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(server, chat_model, stream):
    full = reference(chat_model, PROMPTS[0], 48)["text"]
    stop = full[14:20]
    want = full[: full.index(stop)]
    for stops in (stop, ["zzzz", stop]):
        got = complete(server.client(), PROMPTS[0], 48, stream=stream, stop=stops)
        assert (got["text"], got["finish_reason"]) == (want, "stop")


def test_seeded_sampling_is_reproducible_and_equals_cli(server, chat_model):
    client = server.client()
    want = reference(chat_model, PROMPTS[1], 48, temperature=0.9, top_p=0.9, seed=7)
    first = complete(client, PROMPTS[1], 48, temperature=0.9, top_p=0.9, seed=7)
    again = complete(client, PROMPTS[1], 48, stream=True, temperature=0.9, top_p=0.9, seed=7)
    assert_same(first, want)
    assert again["text"] == first["text"] and again["lookahead"]["seed"] == 7
    # lookahead never changes a sample: greedy decoding draws the same tokens with the same seed
    plain = complete(client, PROMPTS[1], 48, temperature=0.9, top_p=0.9, seed=7, extra_body={"lookahead": False})
    assert plain["text"] == first["text"] and plain["lookahead"]["config"] == "greedy"
    assert complete(client, PROMPTS[1], 48, temperature=0.9, top_p=0.9, seed=8)["text"] != first["text"]


@pytest.mark.parametrize(
    ("option", "config"),
    [(False, "greedy"), (True, "4/3/4"), ({"window": 2}, "2/3/4"), ({"window": 1, "ngram": 2, "verification": 0},
                                                                    "greedy"), ({"verification": 0}, "4/3/0")],
)
def test_lookahead_extension_picks_the_config_and_never_the_text(server, chat_model, option, config):
    got = complete(server.client(), PROMPTS[3], 40, extra_body={"lookahead": option})
    assert got["lookahead"]["config"] == config
    assert_same(got, reference(chat_model, PROMPTS[3], 40, config=config.replace("/", ",")))
    assert got["text"] == reference(chat_model, PROMPTS[3], 40, config="greedy")["text"]


def test_concurrent_clients_each_get_the_cli_answer(server, chat_model):
    """8 clients (the openai client, and raw SSE over http.client) on 4 slots: batched, queued, each answer solo's."""
    requests = [dict(prompt=PROMPTS[i % 4], max_tokens=24 + 8 * (i % 3), stream=bool(i % 2), chat=i % 4 == 3,
                     temperature=0.8 * (i % 2), seed=i % 3) for i in range(8)]
    want = [reference(chat_model, r["prompt"], r["max_tokens"], temperature=r["temperature"], seed=r["seed"],
                      chat=r["chat"]) for r in requests]

    def ask(c: openai.OpenAI, k: int, raw: bool) -> dict:
        r = requests[k]
        if raw and not r["chat"]:
            return RawStream(server.url, {"model": NAME, "prompt": r["prompt"], "max_tokens": r["max_tokens"],
                                          "temperature": r["temperature"], "seed": r["seed"]}).result()
        return complete(c, **r)

    def client(i: int) -> list[tuple[int, dict]]:
        c = server.client()
        return [(k, ask(c, k, raw=i % 2 == 0)) for k in ((i + j) % 8 for j in range(3))]

    with ThreadPoolExecutor(8) as pool:
        answers = [a for batch in pool.map(client, range(8)) for a in batch]
    assert len(answers) == 24
    wrong = [k for k, got in answers if (got["text"], got["usage"]["completion_tokens"]) !=
             (want[k]["text"], want[k]["generated_tokens"])]
    assert not wrong, f"wrong answers for requests {wrong}: {[(k, a['text']) for k, a in answers if k in wrong]}"


def test_metrics_count_what_a_request_did(server):
    before = metrics(server.url)
    got = complete(server.client(), PROMPTS[2], 40, stream=True)
    after = metrics(server.url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    tokens, steps = got["usage"]["completion_tokens"], got["lookahead"]["steps"]
    assert delta('trt_lookahead_requests_total{endpoint="completions",outcome="length"}') == 1
    assert delta("trt_lookahead_prompt_tokens_total") == got["usage"]["prompt_tokens"]
    assert delta("trt_lookahead_generation_tokens_total") == tokens
    assert delta("trt_lookahead_steps_total") == steps
    assert delta("trt_lookahead_accepted_tokens_per_step_count") == steps - 1  # decode steps: the prefill's is not
    assert delta("trt_lookahead_accepted_tokens_per_step_sum") == tokens - 1
    assert delta("trt_lookahead_time_to_first_token_seconds_count") == 1
    assert delta("trt_lookahead_inter_token_latency_seconds_count") == tokens - 1
    assert after["trt_lookahead_running_requests"] == 0 and after["trt_lookahead_queue_length"] == 0
    (info,) = [name for name in after if name.startswith("trt_lookahead_model_info{")]
    assert 'dtype="float32"' in info and 'weights="float"' in info


# -- errors ---------------------------------------------------------------------------------------

GOOD = {"model": NAME, "prompt": "Hi", "max_tokens": 8}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}]}
MALFORMED = [
    ("completions", b'{"model": "stories260K", "prompt": ', 400, None, "not valid JSON"),
    ("completions", b"[1, 2]", 400, None, "must be a JSON object"),
    ("completions", {**GOOD, "model": "gpt-4o"}, 404, "model", "does not exist on this server"),
    ("completions", {"prompt": "Hi"}, 400, "model", "model is required"),
    ("completions", {**GOOD, "max_tokens": -3}, 400, "max_tokens", "max_tokens must be a positive integer, got -3"),
    ("completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens", "max_tokens must be a positive integer, got 0"),
    ("completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens", "valid integer"),
    ("completions", {**GOOD, "n": 2}, 400, "n", "n=2 is not supported"),
    ("completions", {**GOOD, "prompt": LONG_PROMPT}, 400, "prompt", "leave no room to generate in max_model_len 512"),
    ("completions", {**GOOD, "max_tokens": 600}, 400, "max_tokens", "+ max_tokens 600 exceed max_model_len 512"),
    # other ranges are the runtime's checks (its messages; `param` the field it names)
    ("completions", {**GOOD, "lookahead": {"window": 5}}, 400, "lookahead", "exceeds the served config (4, 3, 4)"),
    ("completions", {**GOOD, "lookahead": {"ngram": 4}}, 400, "lookahead", "exceeds the served config"),
    ("completions", {**GOOD, "lookahead": {"window": 0}}, 400, "lookahead", "W=0 is impossible"),
    ("completions", {**GOOD, "lookahead": {"width": 2}}, 400, "lookahead", "unrecognized request argument"),
    ("completions", {**GOOD, "lookahead": "fast"}, 400, "lookahead", "must be false"),
    ("completions", {**GOOD, "temperature": -1}, 400, "temperature", "temperature must be in [0, 2]"),  # OpenAI
    ("completions", {**GOOD, "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
    ("completions", {**GOOD, "top_k": -1}, 400, "top_k", "top_k must be >= 0"),
    ("completions", {**GOOD, "seed": -1}, 400, "seed", "seed must be in [0, 2**64)"),
    ("chat/completions", {**CHAT, "top_p": 1.5}, 400, "top_p", "top_p must be in (0, 1]"),
    ("completions", {**GOOD, "seed": "7"}, 400, "seed", "valid integer"),
    ("completions", {**GOOD, "echo": True}, 400, "echo", "not supported"),
    ("completions", {**GOOD, "logprobs": 2}, 400, "logprobs", "not supported"),
    ("completions", {**GOOD, "stop": 7}, 400, "stop", "a string or a list of strings"),
    ("completions", {**GOOD, "prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ("completions", {**GOOD, "prompt": [1, 99999]}, 400, "prompt", "outside the vocabulary"),  # the runtime's check
    ("completions", {**GOOD, "frobnicate": 1}, 400, "frobnicate", "unrecognized request argument"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages", "at least 1 item"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content", "only text content"),
    ("chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "42"}]}, 400, "messages.0.role", "'user'"),
    ("chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    ("chat/completions", {**CHAT, "max_tokens": 4, "max_completion_tokens": 5}, 400, "max_completion_tokens",
     "disagree"),
    ("chat/completions", {**CHAT, "n": 3}, 400, "n", "n=3 is not supported"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages",
     "the prompt's 842 tokens leave no room to generate in max_model_len 512; shorten the prompt"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens",
     "max_completion_tokens must be a positive integer, got 0"),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "param", "words"), MALFORMED,
                         ids=[f"{i}-{case[0]}" for i, case in enumerate(MALFORMED)])
def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(server, chat_model, endpoint, body, status,
                                                                          param, words):
    bodies = [body] if isinstance(body, bytes) else [body, {**body, "stream": True}]  # an error, never an SSE stream
    for sent in bodies:
        code, text = post(f"{server.url}/v1/{endpoint}", sent)
        error = json.loads(text)["error"]
        assert code == status, text
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, text
        assert words in error["message"], text
    assert_same(complete(server.client(), PROMPTS[0], 16), reference(chat_model, PROMPTS[0], 16))


def test_a_request_past_the_context_gets_openais_code_naming_the_field_it_sent(server, chat_model):
    """context_length_exceeded, the field the client sent as `param` and the most it may ask for: what OpenAI's
    clients (and frameworks that trim a prompt on that code) act on; exactly that many is served."""
    client = server.client(max_retries=0)
    context = json.loads(get(f"{server.url}/v1/models")[1])["data"][0]["max_model_len"]
    room = context - reference(chat_model, PROMPTS[0], 1)["prompt_tokens"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=room + 1)
    assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "max_tokens")
    assert f"lower max_tokens to at most {room} or shorten the prompt" in caught.value.message
    assert "max_new_tokens" not in caught.value.message and "max_seq_len" not in caught.value.message
    served = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=room, temperature=0)
    assert served.usage.total_tokens <= context
    for prompt in ([5] * (context + 1), "Once upon a time " * 60 * context):  # refused by size before tokenizing
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=NAME, prompt=prompt, max_tokens=4)
        assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "prompt"), caught.value.message
    messages = [{"role": "user", "content": PROMPTS[0]}]
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=NAME, messages=messages, **{field: context})
        assert (caught.value.code, caught.value.param) == ("context_length_exceeded", field), caught.value.message


LONG = {**GOOD, "prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0}  # ~3 s of decoding


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_the_slot(server, chat_model, stream):
    before = metrics(server.url)
    if stream:  # hang up after the first event
        raw = RawStream(server.url, LONG)
        assert raw.next_event() is not None
        raw.close()
    else:  # hang up once the request runs
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
        conn.request("POST", "/v1/completions", body=json.dumps(LONG), headers=JSON)
        wait_for(lambda: metrics(server.url)["trt_lookahead_running_requests"] == 1, "the request to start")
        conn.close()
    cancelled = 'trt_lookahead_requests_total{endpoint="completions",outcome="cancelled"}'
    wait_for(lambda: metrics(server.url).get(cancelled, 0) == before.get(cancelled, 0) + 1, "the cancellation")
    wait_for(lambda: metrics(server.url)["trt_lookahead_running_requests"] == 0, "the scheduler to free the slot")
    generated = metrics(server.url)["trt_lookahead_generation_tokens_total"]
    assert generated - before["trt_lookahead_generation_tokens_total"] < 480  # it stopped early
    assert_same(complete(server.client(), PROMPTS[1], 24), reference(chat_model, PROMPTS[1], 24))


def test_full_queue_answers_429_while_the_others_complete(thread_server):
    """2 slots and a queue of 1: a 4th request is refused at once; a disconnect hands its slot to the waiting one."""
    url, prompts = thread_server, PROMPTS[1:4]
    running = [RawStream(url, {**LONG, "prompt": p}) for p in prompts[:2]]
    assert all(r.next_event() is not None for r in running)  # both slots hold a started request
    queued = RawStream(url, {**LONG, "prompt": prompts[2]})
    wait_for(lambda: metrics(url)["trt_lookahead_queue_length"] == 1, "the third request to wait")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=NAME, prompt="Hi", max_tokens=8)
    assert caught.value.status_code == 429 and caught.value.body["code"] == "queue_full", caught.value.response.text
    assert "max_queue=1" in caught.value.body["message"]
    assert caught.value.response.headers["Retry-After"] == "1"

    running[0].close()  # the first client goes away: the waiting request takes its slot
    for stream, prompt in zip((running[1], queued), prompts[1:], strict=True):
        got, want = stream.result(), reference(STORIES, prompt, LONG["max_tokens"])
        assert (got["text"], got["usage"]["completion_tokens"]) == (want["text"], want["generated_tokens"])
    wait_for(lambda: metrics(url)["trt_lookahead_running_requests"] == 0, "the slots to be free")
    assert client.completions.create(model=NAME, prompt="Hi", max_tokens=8).usage.completion_tokens == 8


def test_chat_on_a_model_without_a_chat_template_is_400(thread_server):
    client = openai.OpenAI(base_url=thread_server + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}])
    assert "no chat template" in caught.value.body["message"] and caught.value.body["param"] == "messages"


# -- the command's own arguments (no server starts) ----------------------------------------------


def test_serve_bad_arguments_exit_2_with_one_error_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for argv, words in (
            ([], "exactly one of --model"),
            (["--model", str(STORIES), "--max-batch", "0"], "max_batch must be a positive integer"),
            (["--model", str(STORIES), "--max-queue", "-1"], "max_queue must be an integer >= 0"),
            (["--model", str(STORIES), "--prefill", "sideways"], "prefill takes separate, chunked or a chunk"),
            (["--model", str(STORIES), "--prefill", "100000"], "or a chunk of 1 .. "),
            (["--model", str(STORIES), "--port", "70000"], "not a TCP port"),
            (["--model", str(STORIES), "--port", port], f"cannot listen on 127.0.0.1:{port}"),
            (["--model", str(STORIES), "--lookahead_config", "0,3,4"], "W=0 is impossible"),
        ):
            assert main(["serve", *argv]) == 2, argv
            err = capsys.readouterr().err
            assert err.startswith("error: ") and words in err and "Traceback" not in err, err


# -- an engine dir: the served config is the built one ---------------------------------------------


@pytest.mark.export
def test_engine_dir_serves_at_most_its_built_config(tmp_path, one_torch_thread):
    engine = tmp_path / "engine"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["build", "--model", str(STORIES), "--output", str(engine), "--lookahead_config", "4,3,4",
                     "--max_seq_len", "256"]) == 0
    srv = ServeProcess(tmp_path / "serve.log", "--engine", str(engine), "--threads", "1")
    try:
        srv.wait_ready(timeout=300)
        client = srv.client(max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:  # the engine's T was built for 4,3,4
            client.completions.create(model="engine", prompt="Hi", extra_body={"lookahead": {"window": 5}})
        assert caught.value.body["param"] == "lookahead" and "served config (4, 3, 4)" in caught.value.body["message"]
        got = [complete(client, PROMPTS[0], 40, model="engine", extra_body={"lookahead": option})
               for option in (True, {"window": 2, "verification": 1})]
    finally:
        assert srv.stop() == 0, srv.tail()
    want = cli_generate(str(engine), PROMPTS[0], "--max-new-tokens", "40", "--temperature", "0.0", "--seed", "0",
                        "--top-p", "1.0")
    assert_same(got[0], want)  # both the default: `auto` within the built 4,3,4
    assert want["config"] == "auto"
    assert got[1]["text"] == want["text"] and got[1]["lookahead"]["config"] == "2/3/1"


# -- slow: SmolLM2 and its own chat template ------------------------------------------------------


@pytest.mark.slow
def test_smollm2_chat_stream_equals_cli(tmp_path):
    srv = ServeProcess(tmp_path / "serve.log", "--model", "smollm2-135m-instruct", "--max-seq-len", "1024",
                       "--threads", "1")
    try:
        srv.wait_ready(timeout=600)
        question = "What is the capital of France?"
        got = complete(srv.client(), question, 32, stream=True, chat=True, model="smollm2-135m-instruct")
    finally:
        assert srv.stop() == 0, srv.tail()
    want = cli_generate("smollm2-135m-instruct", question, "--max-new-tokens", "32", "--temperature", "0.0", "--seed",
                        "0", "--top-p", "1.0", "--chat", "--max-seq-len", "1024")  # both the default, `auto`
    assert_same(got, want)
