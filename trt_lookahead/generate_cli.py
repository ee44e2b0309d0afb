"""`trt-lookahead generate`: one prompt, streamed to the terminal (or one JSON object with --json)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trt_lookahead.config import LookaheadConfig
from trt_lookahead.errors import UserError


def lookahead_choice(args: argparse.Namespace) -> LookaheadConfig | str | None:
    """--greedy -> None, --lookahead_config auto|W,N,G, or the runtime's default; validated before loading."""
    if getattr(args, "greedy", False):
        return None
    if args.lookahead_config is None:
        return "default"
    if args.lookahead_config.strip() == "auto":
        return "auto"
    return LookaheadConfig.parse(args.lookahead_config)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    path = Path(args.prompt_file)
    if not path.is_file():
        raise UserError(f"prompt file {path} does not exist; check the path given to --prompt-file")
    return path.read_text(encoding="utf-8")


def model_source(args: argparse.Namespace) -> str:
    if bool(args.model) == bool(getattr(args, "engine", None)):
        raise UserError("give exactly one of --model (checkpoint dir or known name) or --engine (engine dir)")
    return args.model or args.engine


def run_generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    lookahead = lookahead_choice(args)
    prompt = read_prompt(args)
    source = model_source(args)

    from trt_lookahead.runtime import LookaheadRuntime

    runtime = LookaheadRuntime.from_pretrained(
        source,
        backend=args.backend,
        dtype=args.dtype,
        lookahead=lookahead,
        max_seq_len=args.max_seq_len,
        threads=args.threads,
    )
    request = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        chat=args.chat,
    )
    if args.json:
        output = runtime.generate(prompt, **request)
        print(json.dumps(output.to_dict()))
        return 0
    output = None
    for chunk in runtime.stream(prompt, **request):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        output = chunk.output or output
    assert output is not None
    sys.stdout.write("\n")
    print(
        f"[{output.config} {output.backend} {output.dtype}] {output.generated_tokens} tokens in {output.steps} steps "
        f"(compression {output.compression:.2f}), prefill {output.prefill_seconds:.3f} s, "
        f"decode {output.decode_seconds:.3f} s, {output.tokens_per_second:.1f} tok/s, finish: {output.finish_reason}",
        file=sys.stderr,
    )
    return 0
