#!/usr/bin/env python
"""Short requests at 8 streams against 1, measured by NVIDIA's AIPerf (a client we did not write).

AIPerf lives in its own venv (its pins clash with ours):

    python3 -m venv ~/aiperf-venv && ~/aiperf-venv/bin/pip install aiperf==0.13.0
    python scripts/aiperf_scaling.py --aiperf ~/aiperf-venv/bin/aiperf   # serve and Triton, auto, 1 and 8 streams
    python scripts/aiperf_scaling.py --targets serve --variants auto,greedy --rounds 2 --json

For each target (`serve`: `trt-lookahead serve`'s /v1/chat/completions; `triton`: a repository written by
`trt-lookahead triton-repo --max-batch 8`, served by `trt-lookahead triton-serve`, through AIPerf's `template`
endpoint on /v2/models/NAME/generate_stream) and each variant (a server setting: `auto`, `greedy` or a W,N,G
lookahead config, optionally `:PREFILL` for serve's --prefill, e.g. `auto:chunked`), the script starts the
server on 127.0.0.1, runs `aiperf profile` at each --concurrency (synthetic prompts of --input-tokens tokens,
--output-tokens answers, streaming, --requests-per-stream x concurrency requests after a warmup), reads AIPerf's
exported profile_export_aiperf.json and prints output tok/s, TTFT and ITL per level and the ratio of the highest
level's tok/s to the lowest's. With --rounds R the variants run R times in turn (interleaved) on the same
machine, so a slow period hits each; compare figures only within one run. The machine's load
(/proc/loadavg) is printed beside each level. AIPerf counts output tokens with the model's own tokenizer
(--tokenizer, the checkpoint's directory by default: nothing is downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from trt_lookahead.files import free_port

AIPERF = "aiperf"  # the command, on PATH unless --aiperf names it
HOST = "127.0.0.1"
SERVE_READY = re.compile(r"on (http://127\.0\.0\.1:\d+)/v1")
TRITON_NAME = "lookahead"
# Triton's generate_stream body: TensorRT-LLM's ensemble names (docs/triton.md); `text_output` is the answer
TRITON_TEMPLATE = '{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens }}, "stream": true}'
METRICS = {  # our name -> AIPerf's metric tag in profile_export_aiperf.json
    "tok_s": "output_token_throughput",
    "ttft_ms": "time_to_first_token",
    "itl_ms": "inter_token_latency",
    "output_tokens": "output_sequence_length",
    "requests": "request_count",
}


@dataclass(frozen=True)
class Variant:
    label: str
    lookahead: str  # "auto", "greedy" (1,2,0) or W,N,G
    prefill: str | None  # the server's --prefill, None: its default

    @classmethod
    def parse(cls, text: str) -> Variant:
        lookahead, _, prefill = text.partition(":")
        return cls(text, lookahead, prefill or None)

    @property
    def config(self) -> str:
        return "1,2,0" if self.lookahead == "greedy" else self.lookahead


def cli() -> list[str]:
    return [sys.executable, "-m", "trt_lookahead.cli"]


def wait_for(predicate, proc: subprocess.Popen, log: Path, seconds: float = 900.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"the server did not start; its log ({log}) ends:\n{tail}")
        time.sleep(0.5)


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Server:
    """One server process for a target and variant; `url` and `endpoint` say where AIPerf sends requests."""

    def __init__(self, target: str, variant: Variant, args: argparse.Namespace, work: Path) -> None:
        self.target, self.variant, self.args = target, variant, args
        self.log = work / f"{target}-{variant.label.replace(':', '-').replace(',', '_')}.log"
        self.work = work
        self.proc: subprocess.Popen | None = None
        self.url = self.endpoint = ""

    def start(self) -> Server:
        out = open(self.log, "wb")  # noqa: SIM115 - the server's log, kept for the run
        a, v = self.args, self.variant
        if self.target == "serve":
            argv = [*cli(), "serve", "--model", a.model, "--port", "0", "--threads", str(a.threads),
                    "--max-batch", str(a.max_batch), "--lookahead_config", v.config, "--served-model-name", a.name]
            if v.prefill:
                argv += ["--prefill", v.prefill]
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            wait_for(lambda: SERVE_READY.search(self.log.read_text(errors="replace")) is not None, self.proc, self.log)
            match = SERVE_READY.search(self.log.read_text(errors="replace"))
            assert match is not None
            self.url, self.endpoint = match.group(1), ""
            return self
        repo = self.work / f"repo-{v.label.replace(':', '-').replace(',', '_')}"
        shutil.rmtree(repo, ignore_errors=True)
        subprocess.run([*cli(), "triton-repo", "--model", a.model, "--output", str(repo), "--name", TRITON_NAME,
                        "--lookahead_config", v.config, "--max-batch", str(a.max_batch)], check=True)
        if v.prefill:
            raise SystemExit(f"{v.label}: a Triton repository takes no prefill setting; give :PREFILL for serve only")
        http = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
        self.proc = subprocess.Popen(
            [*cli(), "triton-serve", "--repo", str(repo), "--http-port", str(http), "--grpc-port", str(free_port()),
             "--metrics-port", str(free_port())],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        wait_for(lambda: ready(f"http://{HOST}:{http}/v2/models/{TRITON_NAME}/ready"), self.proc, self.log)
        self.url, self.endpoint = f"http://{HOST}:{http}", f"/v2/models/{TRITON_NAME}/generate_stream"
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # the session we started: the server and its stubs
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def aiperf_command(server: Server, level: int, args: argparse.Namespace, out: Path) -> list[str]:
    argv = [args.aiperf, "profile", "--model", args.name, "--url", server.url, "--streaming",
            "--tokenizer", args.tokenizer, "--concurrency", str(level),
            "--request-count", str(args.requests_per_stream * level),
            "--warmup-request-count", str(level),
            "--synthetic-input-tokens-mean", str(args.input_tokens), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(args.output_tokens), "--output-tokens-stddev", "0",
            "--random-seed", "1", "--artifact-dir", str(out), "--ui", "none", "--no-server-metrics",
            "--no-gpu-telemetry", "--request-timeout-seconds", "600"]
    if args.temperature is not None:  # else AIPerf's payload as it is: OpenAI's default 1.0 on serve, 0 on Triton
        argv += ["--extra-inputs", f"temperature:{args.temperature:g}"]
    if server.target == "serve":
        # our server refuses fields it does not know, as OpenAI does: max_tokens is the field it takes
        return [*argv, "--endpoint-type", "chat", "--use-legacy-max-tokens"]
    template = out.parent / "triton_template.json"  # a file: AIPerf splits --extra-inputs values at commas
    template.write_text(TRITON_TEMPLATE)
    return [*argv, "--endpoint-type", "template", "--custom-endpoint", server.endpoint,
            "--extra-inputs", f"payload_template:{template}", "--extra-inputs", "response_field:text_output"]


def read_profile(out: Path) -> dict[str, float]:
    found = sorted(out.rglob("profile_export_aiperf.json"))
    if not found:
        raise SystemExit(f"AIPerf wrote no profile_export_aiperf.json under {out}")
    data = json.loads(found[-1].read_text())
    metrics = data.get("records", data)
    result: dict[str, float] = {}
    for name, tag in METRICS.items():
        entry = metrics.get(tag) or {}
        value = entry.get("avg") if isinstance(entry, dict) else entry
        result[name] = float(value) if value is not None else float("nan")
    errors = data.get("error_summary") or []
    result["errors"] = float(sum(int(e.get("count", 0)) for e in errors if isinstance(e, dict)))
    return result


def run_level(server: Server, level: int, args: argparse.Namespace, work: Path, tag: str) -> dict[str, float]:
    out = work / f"aiperf-{tag}-c{level}"
    shutil.rmtree(out, ignore_errors=True)
    load = Path("/proc/loadavg").read_text().split()[0]
    proc = subprocess.run(aiperf_command(server, level, args, out), capture_output=True, text=True,
                          timeout=args.level_timeout)
    if proc.returncode != 0:
        raise SystemExit(f"aiperf failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    result = read_profile(out)
    result["load"] = float(load)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--name", default="smollm2-135m-instruct", help="the served model name AIPerf sends")
    p.add_argument("--tokenizer", default=None, help="AIPerf's tokenizer (default: the checkpoint's directory)")
    p.add_argument("--targets", default="serve,triton", help="comma list: serve, triton")
    p.add_argument("--variants", default="auto", help="comma list: auto, greedy or W,N,G (as W/N/G), each "
                   "optionally :PREFILL (serve's --prefill: separate, chunked or a chunk size)")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests-per-stream", type=int, default=4, help="requests per level = this x concurrency")
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=None, help="sent with every request (default: none sent: "
                   "serve samples at OpenAI's default 1.0, Triton's template decodes greedily)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1, help="run every target x variant this many times, in turn")
    p.add_argument("--level-timeout", type=float, default=1800.0, help="seconds one aiperf run may take")
    p.add_argument("--aiperf", default=AIPERF)
    p.add_argument("--work", default=None, help="where logs and AIPerf's artifacts go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = p.parse_args(argv)
    found = shutil.which(args.aiperf)
    if found is None:
        p.error(f"AIPerf not found as {args.aiperf!r}: install it in its own venv (see this script's docstring) and "
                "pass its path with --aiperf")
    args.aiperf = found
    if args.tokenizer is None:
        from trt_lookahead.model.fetch import resolve_model

        args.tokenizer = str(resolve_model(args.model))
    levels = [int(c) for c in args.concurrency.split(",")]
    variants = [Variant.parse(v) for v in split_variants(args.variants)]
    work = Path(args.work or tempfile.mkdtemp(prefix="aiperf-scaling-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work dir {work}; load {Path('/proc/loadavg').read_text().strip()}", flush=True)
    rows = []
    for rnd in range(args.rounds):
        for target in args.targets.split(","):
            for variant in variants:
                server = Server(target, variant, args, work).start()
                try:
                    per_level = {}
                    for level in levels:
                        tag = f"{target}-{variant.label.replace(':', '-').replace(',', '_')}-r{rnd}"
                        per_level[level] = r = run_level(server, level, args, work, tag)
                        print(f"round {rnd} {target:6} {variant.label:16} c={level:<2} {r['tok_s']:7.1f} tok/s  "
                              f"TTFT {r['ttft_ms']:8.1f} ms  ITL {r['itl_ms']:6.1f} ms  out {r['output_tokens']:5.1f} "
                              f"tok/req  {r['requests']:.0f} req  {r['errors']:.0f} errors  load {r['load']:.2f}",
                              flush=True)
                finally:
                    server.stop()
                ratio = per_level[levels[-1]]["tok_s"] / per_level[levels[0]]["tok_s"]
                print(f"round {rnd} {target:6} {variant.label:16} {levels[-1]}/{levels[0]} streams: {ratio:.2f}x",
                      flush=True)
                rows.append({"round": rnd, "target": target, "variant": variant.label, "ratio": ratio,
                             "levels": {str(k): v for k, v in per_level.items()}})
    if args.json:
        print(json.dumps({"load_end": Path("/proc/loadavg").read_text().strip(), "runs": rows}))
    return 0


def split_variants(text: str) -> list[str]:
    """`auto,greedy,4,3,4:separate` -> ['auto', 'greedy', '4,3,4:separate']: digits after a comma join a W,N,G."""
    out: list[str] = []
    for part in text.split(","):
        if out and part[:1].isdigit() and re.fullmatch(r"\d+(,\d+)?", out[-1].split(":")[0]):
            out[-1] += "," + part
        else:
            out.append(part)
    return [v for v in out if v]


if __name__ == "__main__":
    sys.exit(main())
