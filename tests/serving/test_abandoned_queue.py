"""Issue 39 item 3 over HTTP: clients that leave while their request waits for a slot free their place at once.

`trt-lookahead serve --max-batch 1 --max-queue 2` on stories260K (a subprocess on loopback, as
test_openai_server.py starts it, whose helpers this module uses): one long greedy request holds the slot, two
queued clients hang up, and the queue gauge must drop to 0 while the long request still runs; a new request
must then be queued (not 429) and answered correctly.
"""

from __future__ import annotations

import http.client
import json

import pytest

pytest.importorskip("openai", reason="serve tests need the openai client (pip install 'trt-lookahead[test]')")
pytest.importorskip("uvicorn", reason="serve needs the serve extra (pip install 'trt-lookahead[serve]')")

from test_openai_server import (  # the same directory: one way to start and read `serve`
    JSON,
    NAME,
    PROMPTS,
    SERVED,
    STORIES,
    TIMEOUT,
    RawStream,
    cli_generate,
    metrics,
    serving,
    wait_for,
)

pytestmark = pytest.mark.server

QUEUE = "trt_lookahead_queue_length"
RUNNING = "trt_lookahead_running_requests"
# greedy on the torch executor: one token per step, so it holds the slot for the whole check (480 steps, the
# model holds 512; seconds where the check takes a fraction of one)
LONG = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0, "lookahead": False}


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory, one_torch_thread):
    with serving(tmp_path_factory.mktemp("serve"), "--model", str(STORIES), "--backend", "torch",
                 "--lookahead_config", SERVED, "--threads", "1", "--max-batch", "1", "--max-queue", "2") as srv:
        yield srv


def test_queued_clients_that_hang_up_free_their_places_at_once(one_slot):
    url = one_slot.url
    long = RawStream(url, LONG)
    assert long.next_event() is not None  # it holds the only slot
    streaming = RawStream(url, {**LONG, "prompt": PROMPTS[1]})  # queued: no response until a slot frees
    host, port = url.removeprefix("http://").split(":")
    plain = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    plain.request("POST", "/v1/completions", body=json.dumps({**LONG, "prompt": PROMPTS[2]}), headers=JSON)
    wait_for(lambda: metrics(url)[QUEUE] == 2, "two requests to wait")

    streaming.close()  # both waiting clients go away
    plain.close()
    wait_for(lambda: metrics(url)[QUEUE] == 0, "the queue to forget them", timeout=10)
    assert metrics(url)[RUNNING] == 1  # the long request still holds the slot: nothing was admitted

    late = RawStream(url, {**LONG, "prompt": PROMPTS[3], "max_tokens": 24, "lookahead": True})
    # queued behind the long request, not refused: a 429 would have answered at once and never waited
    wait_for(lambda: metrics(url)[QUEUE] == 1, "the new request to wait for the slot", timeout=10)
    got = late.result()
    want = cli_generate(str(STORIES), PROMPTS[3], "--max-new-tokens", "24", "--temperature", "0.0",
                        "--lookahead_config", SERVED, "--backend", "torch")
    assert (got["text"], got["usage"]["completion_tokens"]) == (want["text"], want["generated_tokens"])
    long.close()
    wait_for(lambda: metrics(url)[RUNNING] == 0 and metrics(url)[QUEUE] == 0, "the server to be idle")
