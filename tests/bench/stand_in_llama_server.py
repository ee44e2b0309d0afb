"""A stand-in for llama.cpp's `llama-server`, for tests/bench/test_llama_server.py: it takes llama-server's
arguments (-m GGUF --host --port -t -tb -np -c [--spec-type X] [--no-webui]), reads the GGUF (it must be a
llama GGUF), and serves GET /health and streamed POST /v1/completions with token-id prompts, answering with our
own runtime's greedy decoding of the checkpoint in $STAND_IN_CHECKPOINT (one chunk per token, as llama-server
streams), so its answers are real and equal ours.

Environment:
  STAND_IN_CHECKPOINT  the checkpoint directory to answer from (required)
  STAND_IN_MODE        greedy (default): ours greedy's answers; differ: prompts of odd length get greedy's answer
                       to max_tokens // 2 (a strict prefix of the full answer); exit: exit 1 at start-up;
                       unhealthy: /health answers 503 forever; refuse: every completion is answered 400
  STAND_IN_ONLY_SPEC   if set, STAND_IN_MODE applies only to starts with this --spec-type (others: greedy)
  STAND_IN_RECORD      a file each start appends its argv to (one JSON list per line)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="llama-server (stand-in)")
    p.add_argument("-m", dest="model", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("-t", dest="threads", type=int, required=True)
    p.add_argument("-tb", dest="threads_batch", type=int, required=True)
    p.add_argument("-np", dest="slots", type=int, required=True)
    p.add_argument("-c", dest="context", type=int, required=True)
    p.add_argument("--spec-type", dest="spec_type", default=None)
    p.add_argument("--no-webui", action="store_true")
    return p.parse_args(argv)


def main() -> int:
    args = parse(sys.argv[1:])
    record = os.environ.get("STAND_IN_RECORD")
    if record:
        with open(record, "a", encoding="utf-8") as f:
            f.write(json.dumps(sys.argv[1:]) + "\n")
    mode = os.environ.get("STAND_IN_MODE", "greedy")
    only = os.environ.get("STAND_IN_ONLY_SPEC")
    if only is not None and args.spec_type != only:
        mode = "greedy"
    if mode == "exit":
        print("stand-in: error: exiting at start-up as STAND_IN_MODE=exit asks", file=sys.stderr, flush=True)
        return 1
    import gguf

    reader = gguf.GGUFReader(args.model)
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama" or not reader.tensors:
        print(f"stand-in: {args.model} is not a llama GGUF ({arch})", file=sys.stderr, flush=True)
        return 1
    print(f"stand-in: {args.model}: {len(reader.tensors)} tensors, {args.slots} slots, {args.threads} threads, "
          f"spec {args.spec_type}", flush=True)

    import torch

    from trt_lookahead.runtime import LookaheadRuntime

    torch.set_num_threads(args.threads)
    rt = None if mode == "unhealthy" else LookaheadRuntime.from_pretrained(
        os.environ["STAND_IN_CHECKPOINT"], lookahead="greedy", max_batch=args.slots, max_queue=args.slots,
        backend="torch")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *a: Any) -> None:
            pass

        def _json(self, status: int, obj: Any) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path != "/health":
                self._json(404, {"error": {"message": "not found"}})
            elif mode == "unhealthy":
                self._json(503, {"error": {"message": "Loading model"}})
            else:
                self._json(200, {"status": "ok"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body.get("prompt")
            if mode == "refuse":
                self._json(400, {"error": {"message": "refused as STAND_IN_MODE=refuse asks"}})
                return
            if self.path != "/v1/completions" or not body.get("stream") or body.get("temperature") != 0 \
                    or not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
                self._json(400, {"error": {"message": "the stand-in takes streamed greedy token-id completions"}})
                return
            max_tokens = int(body["max_tokens"])
            if mode == "differ" and len(prompt) % 2:
                max_tokens = max(1, max_tokens // 2)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()

            def send(obj: Any) -> None:
                self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                self.wfile.flush()

            output = None
            assert rt is not None
            for chunk in rt.stream(prompt, max_tokens, lookahead="greedy"):
                if chunk.text:
                    send({"choices": [{"text": chunk.text, "index": 0, "finish_reason": None}]})
                output = chunk.output or output
            assert output is not None
            send({"choices": [{"text": "", "index": 0, "finish_reason": output.finish_reason}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                send({"choices": [], "usage": {"completion_tokens": output.generated_tokens,
                                               "prompt_tokens": len(prompt)}})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"stand-in: listening on {args.host}:{args.port} at {time.time():.0f}", flush=True)
    try:
        server.serve_forever()
    finally:
        if rt is not None:
            rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
