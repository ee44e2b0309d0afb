"""Serving: `triton-repo`, `triton-serve` and the Triton model against a real tritonserver on loopback.

One server (stories260K, lookahead 4,3,4, one instance; three models) is started for the whole module
(~7-20 s); answers are compared with LookaheadRuntime.generate and `trt-lookahead generate --json` in this process.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("pytriton", reason="serving tests need nvidia-pytriton (pip install 'trt-lookahead[serve]')")
grpcclient = pytest.importorskip("tritonclient.grpc")

from trt_lookahead.cli import main  # noqa: E402
from trt_lookahead.files import free_port  # noqa: E402
from trt_lookahead.serving.server import TritonServer  # noqa: E402

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
NAME = "lookahead"
BATCHED = "lookahead_batched"  # the same with max_batch_size 4: tensors carry a batch dimension
ONE = "lookahead_one"  # one request slot, bfloat16 on the torch executor: a long request holds it for seconds
QUANT = "lookahead_int4"  # the checkpoint's int4 engine (int8 activations), built by triton-repo
TP = "lookahead_tp2"  # the checkpoint sharded over two rank processes the instance starts
SERVED = "4,3,4"
PROMPTS = ["Once upon a time", "Lily and Tom went to the park. They", "The cat sat on the", "Sam had a red ball"]
TIMEOUT = 60


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime():
    import torch

    from trt_lookahead.runtime import LookaheadRuntime

    torch.set_num_threads(1)
    # request scope here and on the server: the tests compare steps with a lone run of each prompt
    return LookaheadRuntime.from_pretrained(STORIES, lookahead=SERVED, pool_scope="request")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton")
    for name, batch in ((NAME, "0"), (BATCHED, "4")):  # one server, two models: ~7 s per start saved
        assert main(["triton-repo", "--model", str(STORIES), "--output", str(root / "repo"), "--name", name,
                     "--lookahead_config", SERVED, "--max_batch_size", batch, "--pool-scope", "request"]) == 0
    assert main(["triton-repo", "--model", str(STORIES), "--output", str(root / "repo"), "--name", ONE,
                 "--lookahead_config", SERVED, "--max-batch", "1", "--dtype", "bfloat16"]) == 0
    assert main(["triton-repo", "--model", str(STORIES), "--output", str(root / "repo"), "--name", QUANT,
                 "--lookahead_config", SERVED, "--weights", "int4", "--pool-scope", "request"]) == 0
    assert main(["triton-repo", "--model", str(STORIES), "--output", str(root / "repo"), "--name", TP,
                 "--lookahead_config", SERVED, "--tensor-parallel", "2", "--pool-scope", "request"]) == 0
    yield from serve(root, timeout=180)


def serve(root: Path, timeout: float):
    """Run tritonserver on root/repo (log and backends beside it) while the caller's fixture lives."""
    srv = TritonServer(root / "repo", log=root / "server.log", backend_dir=root / "backends", die_with_parent=True)
    srv.start()
    try:
        srv.wait_ready(timeout=timeout)
        yield srv
    finally:
        srv.stop()


def expect(server: TritonServer, condition: bool, message: str) -> None:
    """assert, with the server log's tail in the failure message."""
    if not condition:
        pytest.fail(f"{message}\n--- server log tail ---\n{server.log_tail(30)}")


# -- clients ------------------------------------------------------------------------------------


def http_post(server: TritonServer, endpoint: str, body, model: str = NAME) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/{endpoint}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def generate(server: TritonServer, **body) -> dict:
    status, text = http_post(server, "generate", body)
    record = json.loads(text)
    expect(server, status == 200 and "error" not in record, f"generate {body} -> {status} {text}")
    return record


def generate_stream(server: TritonServer, model: str = NAME, **body) -> tuple[int, list[dict]]:
    """SSE events of /generate_stream, as dicts."""
    status, text = http_post(server, "generate_stream", body, model)
    events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
    return status, events


INPUT_TYPES = {
    "text_input": ("BYTES", object), "max_tokens": ("INT64", np.int64), "stream": ("BOOL", bool),
    "temperature": ("FP64", np.float64), "top_k": ("INT64", np.int64), "top_p": ("FP64", np.float64),
    "random_seed": ("UINT64", np.uint64), "stop_words": ("BYTES", object),
    "lookahead_window_size": ("INT64", np.int64), "lookahead_ngram_size": ("INT64", np.int64),
    "lookahead_verification_set_size": ("INT64", np.int64), "pool_scope": ("BYTES", object),
}


def grpc_inputs(**values):
    inputs = []
    for name, value in values.items():
        datatype, dtype = INPUT_TYPES[name]
        array = np.array(value if isinstance(value, list) else [value], dtype=dtype)
        if dtype is object:
            array = np.array([v.encode() for v in array.tolist()], dtype=object)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class GrpcStream:
    """One gRPC bidirectional stream; `responses(request_id)` yields results until the final flag."""

    def __init__(self, server: TritonServer):
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.queue: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.queue.put((result, error)))

    def send(self, request_id: str, model: str = NAME, **values) -> None:
        self.client.async_stream_infer(model, grpc_inputs(**values), request_id=request_id,
                                       enable_empty_final_response=True)

    def next(self, timeout: float = TIMEOUT):
        result, error = self.queue.get(timeout=timeout)
        if error is not None:
            raise error
        final = result.get_response().parameters["triton_final_response"].bool_param
        return result, final

    def collect(self, timeout: float = TIMEOUT) -> list[dict]:
        rows = []
        while True:
            result, final = self.next(timeout)
            if result.as_numpy("text_output") is not None:
                rows.append({name: result.as_numpy(name).reshape(-1)[0]
                             for name in ("text_output", "generated_tokens", "steps", "finish_reason")})
            if final:
                return rows

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


# -- repository writer (no server) --------------------------------------------------------------


def test_triton_repo_writes_config_and_model(tmp_path, capsys):
    code = main(["triton-repo", "--model", str(STORIES), "--output", str(tmp_path / "repo"), "--name", "la",
                 "--lookahead_config", "[7,5,7]", "--instances", "2", "--max_batch_size", "4", "--max-batch", "6"])
    assert code == 0
    assert capsys.readouterr().out.strip() == str((tmp_path / "repo").resolve())
    config = (tmp_path / "repo" / "la" / "config.pbtxt").read_text()
    assert 'name: "la"' in config and "max_batch_size: 4" in config and "count: 2" in config
    assert "decoupled: true" in config
    for name in ("text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "random_seed", "stop_words",
                 "lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size", "pool_scope",
                 "text_output", "prompt_tokens", "generated_tokens", "steps"):
        assert f'name: "{name}"' in config, name
    assert f'key: "model" value: {{ string_value: "{STORIES.resolve()}" }}' in config
    assert 'key: "lookahead_config" value: { string_value: "7,5,7" }' in config
    assert 'key: "pool_scope" value: { string_value: "shared" }' in config  # the default
    assert 'key: "max_batch" value: { string_value: "6" }' in config
    model_py = (tmp_path / "repo" / "la" / "1" / "model.py").read_text()
    assert "class TritonPythonModel" in model_py and "is_cancelled" in model_py
    capsys.readouterr()
    assert main(["triton-repo", "--model", str(STORIES), "--output", str(tmp_path / "plain"), "--name", "la"]) == 0
    config = (tmp_path / "plain" / "la" / "config.pbtxt").read_text()
    assert 'key: "lookahead_config" value: { string_value: "auto" }' in config  # the default


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([], "exactly one of --model"),
        (["--model", str(STORIES), "--engine", str(STORIES)], "exactly one of --model"),
        (["--engine", "/nonexistent/engine"], "no config.json"),
        (["--model", str(STORIES), "--name", "a/b"], "plain directory name"),
        (["--model", str(STORIES), "--lookahead_config", "0,3,4"], "W=0 is impossible"),
        (["--model", str(STORIES), "--instances", "0"], "--instances"),
        (["--model", str(STORIES), "--max-batch", "0"], "--max-batch must be >= 1"),
        (["--model", str(STORIES), "--weights", "int4", "--dtype", "bfloat16"], "float32 onnxruntime engine"),
        (["--model", str(STORIES), "--activations", "int8"], "multiplies quantized weights"),
        (["--model", str(STORIES), "--tensor-parallel", "3"], "tensor_parallel 3 cannot split 8 attention heads"),
        (["--model", str(STORIES), "--tensor-parallel", "2", "--weights", "int4"],
         "on float weights for now; drop --weights/--activations"),
    ],
)
def test_triton_repo_bad_arguments(tmp_path, capsys, argv, words):
    if "--name" not in argv:
        argv = [*argv, "--name", "la"]
    code = main(["triton-repo", "--output", str(tmp_path / "repo"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err, err


@pytest.mark.parametrize(("in_the_way", "kind"), [("la", "file"), ("la/1", "file"), ("la/config.pbtxt", "directory"),
                                                  ("la/1/model.py", "directory")])
def test_triton_repo_refuses_a_path_in_the_way_naming_it(tmp_path, capsys, in_the_way, kind):
    path = tmp_path / "repo" / in_the_way
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir() if kind == "directory" else path.write_text("mine")
    code = main(["triton-repo", "--output", str(tmp_path / "repo"), "--model", str(STORIES), "--name", "la"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"--output {path} is a " in err, err
    assert (path.is_dir() if kind == "directory" else path.read_text() == "mine")


# -- triton-serve command (a tiny echo model: starts in ~2 s) ------------------------------------

ECHO_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            reply = np.array([b"echo:" + t for t in text.reshape(-1)], dtype=np.object_)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", reply)]))
        return out
'''
ECHO_CONFIG = '''name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
'''


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.server
def test_triton_serve_command_serves_and_stops_on_sigint(tmp_path):
    (tmp_path / "repo" / "echo" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (tmp_path / "repo" / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    http, grpc, metrics = free_port(), free_port(), free_port()
    log = open(tmp_path / "cli.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "trt_lookahead.cli", "triton-serve", "--repo", str(tmp_path / "repo"),
         "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
        stdout=log, stderr=subprocess.STDOUT,
    )

    def tail() -> str:
        log.flush()
        return (tmp_path / "cli.log").read_text(errors="replace")[-3000:]

    try:
        deadline = time.monotonic() + 120
        while b"tritonserver ready" not in (tmp_path / "cli.log").read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, tail()
            time.sleep(0.1)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        data = grpcclient.InferInput("INPUT", [1], "BYTES")
        data.set_data_from_numpy(np.array([b"hi"], dtype=object))
        assert client.infer("echo", [data]).as_numpy("OUTPUT").tolist() == [b"echo:hi"]
        client.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, tail()
        assert not _listening(http) and not _listening(grpc), tail()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_triton_serve_rejects_a_directory_without_models(tmp_path, capsys):
    assert main(["triton-serve", "--repo", str(tmp_path)]) == 2
    assert "not a Triton model repository" in capsys.readouterr().err


# -- the lookahead model on a real server -------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_generate_equals_runtime(server, runtime, prompt):
    want = runtime.generate(prompt, max_new_tokens=48)
    got = generate(server, text_input=prompt, max_tokens=48)
    assert got["text_output"] == want.text
    assert (got["prompt_tokens"], got["generated_tokens"], got["steps"]) == (
        want.prompt_tokens, want.generated_tokens, want.steps)
    assert got["finish_reason"] == want.finish_reason


@pytest.mark.server
def test_generate_equals_cli_generate_json(server, capsys):
    assert main(["generate", "--model", str(STORIES), "--prompt", PROMPTS[1], "--max-new-tokens", "64",
                 "--lookahead_config", SERVED, "--temperature", "0.8", "--seed", "5", "--json"]) == 0
    want = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    got = generate(server, text_input=PROMPTS[1], max_tokens=64, temperature=0.8, random_seed=5)
    assert got["text_output"] == want["text"]
    assert (got["generated_tokens"], got["steps"]) == (want["generated_tokens"], want["steps"])


@pytest.mark.server
def test_generate_stream_streams_each_block(server, runtime):
    want = runtime.generate(PROMPTS[0], max_new_tokens=64)
    status, events = generate_stream(server, text_input=PROMPTS[0], max_tokens=64, stream=True)
    expect(server, status == 200 and all("error" not in e for e in events), f"{status} {events}")
    assert "".join(e["text_output"] for e in events) == want.text
    assert len(events) == want.steps + 1  # one per accepted block, then the final one
    assert [e["steps"] for e in events[:-1]] == list(range(1, want.steps + 1))
    assert all(e["finish_reason"] == "" for e in events[:-1])
    assert events[-1]["finish_reason"] == want.finish_reason
    assert events[-1]["generated_tokens"] == want.generated_tokens
    assert any(b["generated_tokens"] - a["generated_tokens"] > 1 for a, b in itertools.pairwise(events))
    # without stream=true, one event with the whole text
    status, events = generate_stream(server, text_input=PROMPTS[0], max_tokens=64)
    assert status == 200 and len(events) == 1 and events[0]["text_output"] == want.text


@pytest.mark.server
def test_grpc_stream_equals_runtime_stream(server, runtime):
    chunks = list(runtime.stream(PROMPTS[2], max_new_tokens=40))
    stream = GrpcStream(server)
    try:
        stream.send("r1", text_input=PROMPTS[2], max_tokens=40, stream=True)
        rows = stream.collect()
    finally:
        stream.close()
    assert [r["text_output"].decode() for r in rows] == [c.text for c in chunks]
    assert rows[-1]["finish_reason"].decode() == chunks[-1].output.finish_reason


@pytest.mark.server
@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"lookahead_window_size": 1, "lookahead_ngram_size": 2, "lookahead_verification_set_size": 0},  # greedy
        {"lookahead_window_size": 0},  # no lookahead for this request: greedy
        {"lookahead_window_size": 2, "lookahead_ngram_size": 2, "lookahead_verification_set_size": 1},
        {"lookahead_window_size": 3},  # the others from the served config: 3,3,4
        {"lookahead_verification_set_size": 0},
    ],
)
def test_per_request_lookahead_settings(server, runtime, settings):
    served = dict(zip(("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size"),
                      (4, 3, 4), strict=True))
    config = ",".join(str(v) for v in {**served, **settings}.values())
    config = "greedy" if settings.get("lookahead_window_size") == 0 else config
    want = runtime.generate(PROMPTS[3], max_new_tokens=64, lookahead=config)
    greedy = runtime.generate(PROMPTS[3], max_new_tokens=64, lookahead="greedy")
    got = generate(server, text_input=PROMPTS[3], max_tokens=64, **settings)
    assert got["text_output"] == want.text == greedy.text
    assert got["steps"] == want.steps


@pytest.mark.server
def test_sampling_and_stop_words(server, runtime):
    kwargs = dict(temperature=0.9, top_k=40, top_p=0.95, seed=7)
    want = runtime.generate(PROMPTS[0], max_new_tokens=48, **kwargs)
    got = generate(server, text_input=PROMPTS[0], max_tokens=48, temperature=0.9, top_k=40, top_p=0.95,
                   random_seed=7)
    assert got["text_output"] == want.text
    stop = want.text[15:21]
    want = runtime.generate(PROMPTS[0], max_new_tokens=48, stop=[stop], **kwargs)
    got = generate(server, text_input=PROMPTS[0], max_tokens=48, temperature=0.9, top_k=40, top_p=0.95,
                   random_seed=7, stop_words=[stop, "zzzz"])
    assert got["text_output"] == want.text and got["finish_reason"] == "stop"


@pytest.mark.server
def test_eight_concurrent_clients(server, runtime):
    settings = [dict(max_tokens=24 + 8 * (i % 4), stream=bool(i % 2)) for i in range(8)]
    want = {(p, s["max_tokens"]): runtime.generate(p, max_new_tokens=s["max_tokens"]).text
            for p in PROMPTS for s in settings}

    def client(i: int) -> list[tuple[str, int, str]]:
        answers = []
        for j in range(4):
            prompt, s = PROMPTS[(i + j) % 4], settings[i]
            if i % 4 == 3:  # two clients use gRPC streams, the rest HTTP
                stream = GrpcStream(server)
                try:
                    stream.send(f"c{i}-{j}", text_input=prompt, **s)
                    text = "".join(r["text_output"].decode() for r in stream.collect())
                finally:
                    stream.close()
            elif s["stream"]:
                _, events = generate_stream(server, text_input=prompt, **s)
                text = "".join(e.get("text_output", "<error>") for e in events)
            else:
                text = generate(server, text_input=prompt, **s)["text_output"]
            answers.append((prompt, s["max_tokens"], text))
        return answers

    with ThreadPoolExecutor(8) as pool:
        answers = [a for batch in pool.map(client, range(8)) for a in batch]
    assert len(answers) == 32
    wrong = [(p, n) for p, n, text in answers if text != want[(p, n)]]
    expect(server, not wrong, f"wrong answers: {wrong}")


LONG_PROMPT = "Once upon a time " * 200  # ~800 tokens; stories260K holds 512


@pytest.mark.server
@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"max_tokens": 8}, 400, "text_input is required"),
        ({"text_input": "Hi", "max_tokens": -3}, 400, "max_tokens must be a positive integer"),
        ({"text_input": "Hi", "max_tokens": 0}, 400, "max_tokens must be a positive integer"),
        ({"text_input": "Hi", "max_tokens": "ten"}, None, "signed-integer"),  # wrong JSON type: Triton rejects it
        ({"text_input": 42}, None, "string"),
        ({"text_input": "Hi", "stream": "yes"}, None, "boolean"),
        ({"text_input": LONG_PROMPT, "max_tokens": 8}, 400, "leave no room to generate in the model's max_seq_len 512"),
        ({"text_input": "Hi", "max_tokens": 511}, 400, "+ max_tokens 511 exceed the model's max_seq_len 512; lower "
                                                       "max_tokens to at most"),
        ({"text_input": "Hi", "lookahead_window_size": 5}, 400, "exceeds the served config"),
        ({"text_input": "Hi", "lookahead_ngram_size": 4}, 400, "exceeds the served config"),
        ({"text_input": "Hi", "lookahead_verification_set_size": 9}, 400, "exceeds the served config"),
        ({"text_input": "Hi", "lookahead_window_size": -1}, 400, "W=-1 is impossible"),  # 0: no lookahead
        ({"text_input": "Hi", "temperature": -1.0}, 400, "temperature must be >= 0"),
        ({"text_input": "Hi", "top_p": 0.0}, 400, "top_p must be in (0, 1]"),
    ],
)
def test_malformed_requests_get_errors_and_the_server_keeps_serving(server, runtime, body, status, words):
    for endpoint in ("generate", "generate_stream"):
        code, text = http_post(server, endpoint, body)
        expect(server, code >= 400 and "error" in text, f"{endpoint} {body} -> {code} {text[:300]}")
        if status is not None:
            assert code == status, text
        message = text if endpoint == "generate" else text.split("data: ", 1)[-1]
        assert words.lower() in json.loads(message)["error"].lower(), text
    want = runtime.generate(PROMPTS[0], max_new_tokens=16).text
    assert generate(server, text_input=PROMPTS[0], max_tokens=16)["text_output"] == want


OUT_OF_RANGE = [  # issue 10: tritonserver wrapped these into INT32/FP32 inputs, and they were served as 1, 0, 8, inf
    ({"max_tokens": 2**32 + 8}, "exceed the model's max_seq_len 512"),
    ({"max_tokens": 2**31}, "max_tokens 2147483648 exceed"),  # was refused naming -2147483648
    ({"lookahead_verification_set_size": 2**40}, "above the limit of 1024"),
    ({"lookahead_window_size": 2**32 + 1}, "above the limit of 1024"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": float("inf"), "top_k": 5}, "temperature must be a finite number"),
    ({"parameters": {"temperature": float("-inf")}}, "temperature must be a finite number"),
    ({"top_p": 1e39}, "top_p must be in (0, 1]"),
    ({"parameters": {"chat": "yes"}}, "chat must be bool"),
    ({"temprature": 0.7}, "unknown request parameter(s) temprature"),  # a typo was ignored in silence
    ({"parameters": {"repetition_penalty": 1.2}}, "unknown request parameter(s) repetition_penalty"),
    ({"pool_scope": "tenant"}, "pool_scope must be one of shared, request"),
]


@pytest.mark.server
@pytest.mark.parametrize(("body", "words"), OUT_OF_RANGE, ids=[str(b)[:50] for b, _ in OUT_OF_RANGE])
def test_out_of_range_values_get_400_naming_them(server, runtime, body, words):
    for endpoint in ("generate", "generate_stream"):
        code, text = http_post(server, endpoint, {"text_input": "Hi", "max_tokens": 8, **body})
        message = text if endpoint == "generate" else text.split("data: ", 1)[-1]
        expect(server, code == 400 and words.lower() in json.loads(message)["error"].lower(),
               f"{endpoint} {body} -> {code} {text[:300]}")
    want = runtime.generate(PROMPTS[0], max_new_tokens=16).text
    assert generate(server, text_input=PROMPTS[0], max_tokens=16)["text_output"] == want


@pytest.mark.server
def test_64_bit_values_are_served_as_sent(server, runtime):
    kwargs = dict(temperature=0.9, top_k=2**40 + 1, seed=3)  # top_k above the vocabulary: no filter (not 1)
    want = runtime.generate(PROMPTS[1], max_new_tokens=24, **kwargs).text
    assert want == runtime.generate(PROMPTS[1], max_new_tokens=24, temperature=0.9, seed=3).text
    got = generate(server, text_input=PROMPTS[1], max_tokens=24, temperature=0.9, top_k=2**40 + 1, random_seed=3)
    assert got["text_output"] == want
    # a huge but finite temperature samples among the top_k (it was inf, then token 0, in FP32)
    want = runtime.generate(PROMPTS[1], max_new_tokens=16, temperature=1e39, top_k=5, seed=1)
    got = generate(server, text_input=PROMPTS[1], max_tokens=16, temperature=1e39, top_k=5, random_seed=1)
    assert got["text_output"] == want.text and got["generated_tokens"] == 16 and 0 not in want.token_ids


@pytest.mark.server
def test_the_server_runs_the_package_that_wrote_the_repository(server):
    # the Python backend's stub ignores PYTHONPATH: model.py takes config.pbtxt's trt_lookahead_path first
    import trt_lookahead

    here = f"trt_lookahead={Path(trt_lookahead.__file__).resolve().parent}"
    models = sum(1 for d in server.repo.iterdir() if (d / "config.pbtxt").is_file())
    expect(server, server.log_tail(100000).count(here) == models, f"all {models} models should log {here}")


@pytest.mark.server
def test_generate_with_stream_true_is_answered_by_tritonservers_front_end(server, runtime):
    """Issue 10 asked for a 400 here; tritonserver decides this status itself (docs/triton.md, "What
    tritonserver answers before model.py runs"): it takes the HTTP status from the first response and only then
    counts them, and /generate and /generate_stream hand the model identical requests. So: 200 with
    tritonserver's error body, documented."""
    code, text = http_post(server, "generate", {"text_input": PROMPTS[0], "max_tokens": 8, "stream": True})
    assert code == 200 and "generate expects model to produce exactly 1 response" in json.loads(text)["error"]
    status, events = generate_stream(server, text_input=PROMPTS[0], max_tokens=8, stream=True)
    assert status == 200 and "".join(e["text_output"] for e in events) == runtime.generate(PROMPTS[0], 8).text


@pytest.mark.server
def test_grpc_wrong_types_and_missing_input_get_errors(server, runtime):
    wrong_type = grpcclient.InferInput("max_tokens", [1], "FP32")
    wrong_type.set_data_from_numpy(np.array([8.0], dtype=np.float32))
    for inputs, words in (([*grpc_inputs(text_input="Hi"), wrong_type], "data-type"),
                          (grpc_inputs(max_tokens=8), "text_input")):
        stream = GrpcStream(server)
        try:
            stream.client.async_stream_infer(NAME, inputs, request_id="bad")
            with pytest.raises(Exception, match=words):
                stream.next()
        finally:
            stream.close()
    stream = GrpcStream(server)
    try:
        stream.send("good", text_input=PROMPTS[1], max_tokens=16)
        assert stream.collect()[-1]["text_output"].decode() == runtime.generate(PROMPTS[1], max_new_tokens=16).text
    finally:
        stream.close()


@pytest.mark.server
def test_cancelled_stream_frees_the_instance(server, runtime):
    prompt_tokens = len(runtime.encode(PROMPTS[0]))
    max_tokens = 512 - prompt_tokens
    stream = GrpcStream(server)
    stream.send("long", text_input=PROMPTS[0], max_tokens=max_tokens, stream=True)
    result, final = stream.next()
    assert not final and result.as_numpy("generated_tokens").reshape(-1)[0] < max_tokens
    stream.close(cancel=True)

    # the model sees the cancellation, stops decoding and logs it
    deadline = time.monotonic() + 30
    pattern = "request 'long' cancelled after "
    while pattern not in server.log_tail(200) and time.monotonic() < deadline:
        time.sleep(0.05)
    tail = server.log_tail(200)
    expect(server, pattern in tail, "the model did not report the cancellation")
    line = next(l for l in tail.splitlines() if pattern in l)
    done = int(line.split(pattern)[1].split()[0])
    assert done < max_tokens, line

    # and the single instance, free again, serves the next request
    want = runtime.generate(PROMPTS[1], max_new_tokens=16).text
    assert generate(server, text_input=PROMPTS[1], max_tokens=16)["text_output"] == want


# -- issue 39: one request's size never holds up the others ----------------------------------------


HUGE_TEXT = "Once upon a time " * 300_000  # 5.1 MB: stories260K holds 512 tokens
ANSWERED = 10  # seconds: "not stalled" (the small request alone takes a fraction of one)


def beside(server: TritonServer, runtime, big: list[dict]) -> list[tuple[int, str]]:
    """Send the `big` bodies at once, then a small request: it must be answered correctly within ANSWERED
    seconds of being sent, whatever the big ones cost. Returns the big ones' (status, text)."""
    want = runtime.generate(PROMPTS[0], max_new_tokens=16).text
    with ThreadPoolExecutor(len(big)) as pool:
        answers = [pool.submit(http_post, server, "generate", body) for body in big]
        time.sleep(0.5)  # their bodies are on their way first
        sent = time.monotonic()
        small = generate(server, text_input=PROMPTS[0], max_tokens=16)
        waited = time.monotonic() - sent
        results = [a.result() for a in answers]
    expect(server, small["text_output"] == want, f"the small request got {small}")
    expect(server, waited < ANSWERED, f"the small request waited {waited:.1f} s behind {len(big)} big ones")
    return results


@pytest.mark.server
def test_huge_text_inputs_are_refused_while_a_small_request_is_served(server, runtime):
    """A 5 MB text_input was tokenized inside execute() before any size check (5.6 s), holding up every other
    request of the instance; three of them at once held a small request up for their sum."""
    for status, text in beside(server, runtime, [{"text_input": HUGE_TEXT, "max_tokens": 8}] * 3):
        expect(server, status == 400 and "prompt" in json.loads(text)["error"].lower(), f"{status} {text[:300]}")


@pytest.mark.server
def test_a_2000_entry_stop_list_is_refused_while_a_small_request_is_served(server, runtime):
    """2,000 stop strings of 2,000 characters were accepted and matched at every block."""
    stops = [f"{i:04d}" + "z" * 1996 for i in range(2000)]
    body = {"text_input": PROMPTS[1], "max_tokens": 300, "stop_words": stops}
    for status, text in beside(server, runtime, [body]):
        expect(server, status == 400 and "stop" in json.loads(text)["error"].lower(), f"{status} {text[:300]}")


def triton_metrics(server: TritonServer) -> dict[str, float]:
    with contextlib.closing(urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                                   timeout=10)) as r:
        lines = r.read().decode().splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line[:1] not in ("#", ""))}


@pytest.mark.server
def test_a_request_cancelled_while_queued_leaves_the_queue_at_once(server):
    """Issue 39 item 3 for Triton: a request waiting for the one slot whose client cancels leaves the queue
    while the running request still runs, not once the slot frees; the next request is served."""
    executed = f'nv_inference_exec_count{{model="{ONE}",version="1"}}'
    before = triton_metrics(server).get(executed, 0)
    long, queued = GrpcStream(server), GrpcStream(server)
    long.send("long", model=ONE, text_input=PROMPTS[0], max_tokens=480, stream=True, lookahead_window_size=0)
    _, final = long.next()
    assert not final  # greedy, one token per step: it holds the slot for seconds
    queued.send("queued", model=ONE, text_input=PROMPTS[1], max_tokens=8, stream=True)
    deadline = time.monotonic() + 30
    while triton_metrics(server).get(executed, 0) < before + 2:  # the model has it: it waits in the runtime's queue
        expect(server, time.monotonic() < deadline, "the queued request never reached the model")
        time.sleep(0.05)
    queued.close(cancel=True)
    pattern = "request 'queued' cancelled"
    deadline = time.monotonic() + 30
    while pattern not in server.log_tail(200):
        expect(server, time.monotonic() < deadline, "the model did not report the cancellation")
        time.sleep(0.05)
    arrived = []  # the long request's responses so far: it was still running when the queued one left
    with contextlib.suppress(queue.Empty):
        while True:
            arrived.append(long.queue.get_nowait())
    expect(server, not any(r.get_response().parameters["triton_final_response"].bool_param for r, _ in arrived),
           "the long request had ended before the queued one left")
    final = long.collect()[-1]  # the rest: it runs to the end (the final response carries the totals)
    assert final["finish_reason"] == b"length" and final["generated_tokens"] == 480
    long.close()
    line = next(l for l in server.log_tail(200).splitlines() if pattern in l)
    assert "while waiting for a slot" in line, line
    follow = GrpcStream(server)
    follow.send("next", model=ONE, text_input=PROMPTS[2], max_tokens=8, stream=True)
    assert follow.collect()[-1]["generated_tokens"] == 8
    follow.close()


@pytest.mark.server
def test_batched_model_serves_one_prompt_per_request(server, runtime):
    want = runtime.generate(PROMPTS[2], max_new_tokens=32)
    status, text = http_post(server, "generate", {"text_input": PROMPTS[2], "max_tokens": 32}, model=BATCHED)
    assert status == 200 and json.loads(text)["text_output"] == want.text, text
    status, events = generate_stream(server, BATCHED, text_input=PROMPTS[2], max_tokens=32, stream=True)
    assert status == 200 and "".join(e["text_output"] for e in events) == want.text, events
    status, text = http_post(server, "generate", {"text_input": ["a", "b"]}, model=BATCHED)
    assert status == 400 and "text_input must hold one value" in text, text


@pytest.mark.server
def test_quantized_checkpoint_repository_serves_its_own_greedy(server):
    """triton-repo --weights int4 builds the checkpoint's cached int4 engine and the instances open it: answers equal
    the runtime's on the same quantized model, lookahead and greedy alike (its own greedy, not the float model's)."""
    from trt_lookahead.runtime import LookaheadRuntime

    config = (server.repo / QUANT / "config.pbtxt").read_text()
    assert 'key: "weights" value: { string_value: "int4" }' in config
    assert 'key: "activations" value: { string_value: "int8" }' in config
    quantized = LookaheadRuntime.from_pretrained(STORIES, lookahead=SERVED, weights="int4", pool_scope="request")
    for prompt in PROMPTS[:2]:
        want = quantized.generate(prompt, max_new_tokens=40)
        assert want.text == quantized.generate(prompt, max_new_tokens=40, lookahead="greedy").text
        status, text = http_post(server, "generate", {"text_input": prompt, "max_tokens": 40}, model=QUANT)
        assert status == 200 and json.loads(text)["text_output"] == want.text, text


@pytest.mark.server
def test_tensor_parallel_repository_serves_its_own_greedy(server):
    """triton-repo --tensor-parallel 2: the instance shards the checkpoint over itself and one rank process it
    starts; answers equal a runtime on two ranks here, lookahead and greedy alike, and the server keeps serving
    the other models beside it."""
    from trt_lookahead.runtime import LookaheadRuntime

    config = (server.repo / TP / "config.pbtxt").read_text()
    assert 'key: "tensor_parallel" value: { string_value: "2" }' in config
    with LookaheadRuntime.from_pretrained(STORIES, lookahead=SERVED, tensor_parallel=2, pool_scope="request") as rt:
        for prompt in PROMPTS[:2]:
            want = rt.generate(prompt, max_new_tokens=40)
            assert want.text == rt.generate(prompt, max_new_tokens=40, lookahead="greedy").text
            status, text = http_post(server, "generate", {"text_input": prompt, "max_tokens": 40}, model=TP)
            assert status == 200 and json.loads(text)["text_output"] == want.text, text
    assert generate(server, text_input=PROMPTS[0], max_tokens=8)["text_output"]


@pytest.mark.server
def test_server_metrics_count_requests(server):
    generate(server, text_input=PROMPTS[0], max_tokens=4)
    with contextlib.closing(urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                                   timeout=10)) as r:
        metrics = dict(line.rsplit(" ", 1) for line in r.read().decode().splitlines() if line[:1] not in ("#", ""))
    labels = f'{{model="{NAME}",version="1"}}'
    assert float(metrics[f"nv_inference_request_success{labels}"]) >= 1  # decoupled error responses count here too


# -- slow: an engine dir and SmolLM2 behind one more server -------------------------------------


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton_slow")
    assert main(["build", "--model", str(STORIES), "--output", str(root / "engine"), "--lookahead_config", "4,3,4",
                 "--max_seq_len", "256"]) == 0
    assert main(["triton-repo", "--engine", str(root / "engine"), "--output", str(root / "repo"),
                 "--name", "engine"]) == 0
    assert main(["triton-repo", "--model", "smollm2-135m-instruct", "--output", str(root / "repo"), "--name", "smollm2",
                 "--lookahead_config", "4,3,4", "--max_seq_len", "1024"]) == 0
    for srv in serve(root, timeout=600):
        srv.engine = root / "engine"
        yield srv


@pytest.mark.server
@pytest.mark.export
@pytest.mark.slow
def test_engine_dir_repository_and_serving(slow_server, tmp_path, capsys):
    from trt_lookahead.runtime import LookaheadRuntime

    config = (slow_server.repo / "engine" / "config.pbtxt").read_text()
    assert f'key: "engine" value: {{ string_value: "{slow_server.engine.resolve()}" }}' in config
    assert 'key: "lookahead_config" value: { string_value: "auto" }' in config  # the default, within the engine
    code = main(["triton-repo", "--engine", str(slow_server.engine), "--output", str(tmp_path), "--name", "x",
                 "--lookahead_config", "5,3,4"])
    assert code == 2 and "does not fit the engine" in capsys.readouterr().err
    code = main(["triton-repo", "--engine", str(slow_server.engine), "--output", str(tmp_path), "--name", "x",
                 "--lookahead_config", "4,3,2"])
    assert code == 0 and 'string_value: "4,3,2"' in (tmp_path / "x" / "config.pbtxt").read_text()
    capsys.readouterr()
    code = main(["triton-repo", "--engine", str(slow_server.engine), "--output", str(tmp_path), "--name", "x",
                 "--weights", "int4"])
    assert code == 2 and "weights were set by its build" in capsys.readouterr().err
    want = LookaheadRuntime.from_pretrained(slow_server.engine).generate(PROMPTS[0], max_new_tokens=40)
    status, text = http_post(slow_server, "generate", {"text_input": PROMPTS[0], "max_tokens": 40}, model="engine")
    assert status == 200 and json.loads(text)["text_output"] == want.text, text


@pytest.mark.server
@pytest.mark.slow
def test_smollm2_chat_request(slow_server):
    from trt_lookahead.runtime import LookaheadRuntime

    runtime = LookaheadRuntime.from_pretrained("smollm2-135m-instruct", lookahead="4,3,4", max_seq_len=1024)
    question = "What is the capital of France?"
    want = runtime.generate(question, max_new_tokens=24, chat=True)
    body = {"text_input": question, "max_tokens": 24, "stream": True, "parameters": {"chat": True}}
    status, events = generate_stream(slow_server, "smollm2", **body)
    assert status == 200 and "".join(e["text_output"] for e in events) == want.text, events
    assert events[-1]["prompt_tokens"] == want.prompt_tokens


# -- fuzz: random JSON bodies (issue 10) --------------------------------------------------------------

INT64 = st.one_of(st.integers(-5, 40), st.integers(-(2**63), 2**63 - 1))
REAL = st.one_of(st.floats(-1, 3), st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3))
JSON_SCALAR = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(-1e6, 1e6), st.text(max_size=6))
BODIES = st.fixed_dictionaries(
    {"text_input": st.text(max_size=24)},
    optional={
        "max_tokens": INT64, "stream": st.booleans(), "temperature": REAL, "top_k": INT64, "top_p": REAL,
        "random_seed": st.integers(0, 2**64 - 1), "stop_words": st.one_of(st.text(max_size=4),
                                                                            st.lists(st.text(max_size=4), max_size=3)),
        "lookahead_window_size": INT64, "lookahead_ngram_size": INT64, "lookahead_verification_set_size": INT64,
        "parameters": st.fixed_dictionaries({}, optional={"chat": JSON_SCALAR, "bogus": JSON_SCALAR, "top_k": INT64,
                                                          "temperature": REAL, "stream": st.booleans()}),
        "extra_key": JSON_SCALAR,  # not an input: tritonserver passes it on as a request parameter
    },
)
FRONT_END = "generate expects model to produce exactly 1 response"  # /generate with several responses (docs/triton.md)


def answered(status: int, text: str, endpoint: str) -> str:
    """'result' or 'refused'; fails on anything else (a 500, an error inside a 200 but the documented one)."""
    if text.startswith("data: "):  # server-sent events: one record per response
        records = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
    else:  # one JSON body: /generate, or an error the front end answered before any event
        records = [json.loads(text)]
    errors = [r["error"] for r in records if "error" in r]
    if status == 400 and errors:
        return "refused"
    if status == 200 and len(errors) == 1 and errors[0].startswith(FRONT_END) and endpoint == "generate":
        return "refused"
    assert status == 200 and records and not errors, f"{status} {text[:400]}"
    assert all(isinstance(r["text_output"], str) for r in records)
    return "result"


@pytest.mark.server
def test_random_json_bodies_get_a_result_or_a_400(server, runtime, record_property):
    want = runtime.generate(PROMPTS[0], max_new_tokens=6).text
    ran = {"result": 0, "refused": 0}

    @settings(max_examples=80, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(body=BODIES, endpoint=st.sampled_from(["generate", "generate_stream"]))
    def case(body: dict, endpoint: str) -> None:
        body.setdefault("max_tokens", 8)  # keep the valid ones short: the default is 128 tokens
        if 0 < body["max_tokens"] < 2**31:
            body["max_tokens"] = min(body["max_tokens"], 24)
        status, text = http_post(server, endpoint, body)
        ran[answered(status, text, endpoint)] += 1
        expect(server, generate(server, text_input=PROMPTS[0], max_tokens=6)["text_output"] == want,
               f"after {body}: the server no longer answers correctly")

    case()
    record_property("cases", ran)
    print(f"{ran} cases")
    assert ran["result"] >= 10 and ran["refused"] >= 10
