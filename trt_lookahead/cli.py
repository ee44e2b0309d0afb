"""`trt-lookahead` entry point: argument parsing here, each command's work in its own module.

User errors (UserError, ValueError, FileNotFoundError) print one `error:` line and exit 2; set
TRT_LOOKAHEAD_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from trt_lookahead.errors import UserError

# command -> "module:function"; modules are imported only when their command runs.
COMMANDS = {
    "fetch-model": "trt_lookahead.models.fetch:run_fetch_model",
    "generate": "trt_lookahead.generate_cli:run_generate",
    "bench": "trt_lookahead.bench:run_bench",
    "tune": "trt_lookahead.tune:run_tune",
    "build": "trt_lookahead.builder:run_build",
    "triton-repo": "trt_lookahead.serving.repository:run_triton_repo",
    "triton-serve": "trt_lookahead.serving.server:run_triton_serve",
}


def _add_model_arguments(p: argparse.ArgumentParser, engine: bool = True) -> None:
    p.add_argument("--model", help="local HF Llama checkpoint dir, or a known name: smollm2-135m-instruct")
    if engine:
        p.add_argument("--engine", help="engine dir written by `trt-lookahead build`")
    p.add_argument("--backend", choices=["torch", "onnxruntime", "tensorrt"], default=None,
                   help="executor (default: torch for --model, onnxruntime for --engine)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--max-seq-len", "--max_seq_len", dest="max_seq_len", type=int, default=None,
                   help="KV-cache length (default: min(model context, 4096))")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _add_lookahead_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lookahead_config", "--lookahead-config", dest="lookahead_config", default=None,
                   help="W,N,G (also W/N/G or [W,N,G]) or `auto` (tuned); default 4,3,4")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trt-lookahead", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("fetch-model", help="download and convert a known model; prints its directory")
    p.add_argument("name", help="smollm2-135m-instruct")
    p.add_argument("--cache-dir", default=None, help="default: $TRT_LOOKAHEAD_CACHE or $XDG_CACHE_HOME/trt-lookahead")

    p = sub.add_parser("generate", help="generate text with lookahead (or greedy) decoding")
    _add_model_arguments(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file", "--prompt_file", dest="prompt_file")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", "--max_new_tokens", dest="max_new_tokens", type=int, default=128)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--lookahead_config", "--lookahead-config", dest="lookahead_config", default=None,
                      help="W,N,G (also W/N/G or [W,N,G]) or `auto`; default 4,3,4")
    mode.add_argument("--greedy", action="store_true", help="plain greedy (or sampled) decoding, T = 1")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=0)
    p.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object with text, ids and stats")

    p = sub.add_parser("bench", help="measure greedy and lookahead side by side on a prompt set")
    _add_model_arguments(p, engine=True)
    p.add_argument("--dataset", required=True, help="mt_bench, humaneval, gsm8k or a JSONL path (comma list ok)")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", "--max_new_tokens", dest="max_new_tokens", type=int, default=128)
    p.add_argument("--configs", default="greedy,4/3/4,7/5/7,15/5/15", help="comma list of greedy, W/N/G, auto")
    p.add_argument("--peers", default="", help="extra rows: hf-greedy,hf-prompt-lookup")
    p.add_argument("--out", default=None, help="write results.json, results.md and plots here")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("tune", help="choose W,N,G for this machine, model and workload")
    _add_model_arguments(p, engine=False)
    p.add_argument("--dataset", default="mt_bench,humaneval,gsm8k")
    p.add_argument("--budget-seconds", "--budget_seconds", dest="budget_seconds", type=float, default=300.0)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("build", help="compile a checkpoint into an engine dir at fixed W,N,G")
    p.add_argument("--model", required=True)
    p.add_argument("--output", required=True, help="engine dir, e.g. engines/NAME")
    _add_lookahead_argument(p)
    p.add_argument("--max_seq_len", "--max-seq-len", dest="max_seq_len", type=int, default=2048)
    p.add_argument("--max_input_len", "--max-input-len", dest="max_input_len", type=int, default=None)
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--attention", choices=["plugin", "native"], default="plugin")
    p.add_argument("--target", choices=["onnx", "tensorrt"], default="onnx")
    p.add_argument("--force", action="store_true", help="overwrite an existing engine dir")

    p = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository")
    p.add_argument("--model")
    p.add_argument("--engine")
    p.add_argument("--output", required=True, help="repository dir")
    p.add_argument("--name", default="lookahead")
    _add_lookahead_argument(p)
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--max_batch_size", "--max-batch-size", dest="max_batch_size", type=int, default=0)
    p.add_argument("--max_seq_len", "--max-seq-len", dest="max_seq_len", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")

    p = sub.add_parser("triton-serve", help="run tritonserver (from nvidia-pytriton) on a repository")
    p.add_argument("--repo", required=True)
    p.add_argument("--http-port", "--http_port", dest="http_port", type=int, default=8000)
    p.add_argument("--grpc-port", "--grpc_port", dest="grpc_port", type=int, default=8001)
    p.add_argument("--metrics-port", "--metrics_port", dest="metrics_port", type=int, default=8002)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, function_name = COMMANDS[args.command].split(":")
    try:
        run = getattr(importlib.import_module(module_name), function_name)
        return int(run(args) or 0)
    except (UserError, ValueError, FileNotFoundError) as exc:
        if os.environ.get("TRT_LOOKAHEAD_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
