"""`trt-lookahead triton-repo`: write a Triton Inference Server model repository for lookahead decoding.

REPO/NAME/config.pbtxt   Python backend, decoupled; inputs and outputs from schema.py (TensorRT-LLM's
                         ensemble names); the `parameters` block records what model.py needs: model or
                         engine path, backend, dtype, a checkpoint's weights and activations (its cached
                         quantized engine, built here), served lookahead config (W,N,G or auto), max_seq_len,
                         default max_tokens, max_batch (concurrent requests per instance).
REPO/NAME/1/model.py     one LookaheadRuntime per model instance, serving up to max_batch decoupled requests
                         at once through its scheduler (templates/model.py).

model.py imports `trt_lookahead` from the `trt_lookahead_path` parameter (the directory this package was
imported from when the repository was written) when it is there, else from the server's Python: in
another Python (a user's Triton container) install it there (`pip install trt-lookahead`); PYTHONPATH
does not reach the Python backend's stub. Everything the server would refuse at load time (a bad name,
config, max_seq_len beyond the model's context or the engine's, an unwritable output) is refused here.
See docs/design.md section 7.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from string import Template

import trt_lookahead
from trt_lookahead.engine.quantize import check_scheme
from trt_lookahead.errors import UserError, as_int
from trt_lookahead.files import check_output_dir, check_output_file, write_text_atomic
from trt_lookahead.lookahead.config import AUTO, DEFAULT, LookaheadConfig
from trt_lookahead.model.fetch import resolve_model
from trt_lookahead.runtime import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MAX_SEQ_LEN,
    cached_checkpoint_engine,
    check_pool_scope,
    check_tensor_parallel,
    checkpoint_backend,
    checkpoint_tree,
    refuse_weights_on_engine,
)
from trt_lookahead.serving.schema import INPUTS, OUTPUTS, pbtxt_list

TEMPLATES = Path(__file__).parent / "templates"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
INT32_MAX = 2**31 - 1  # config.pbtxt's max_batch_size and instance count are int32 fields


def served_lookahead(lookahead_config: str | None) -> tuple[str, LookaheadConfig | None]:
    """The instances' lookahead parameter and the fixed config asked for: AUTO by default (each instance reads this
    machine's tuning entry when it loads, `trt-lookahead tune`, else runs on the built-in priors, up to an engine's
    built config), or W,N,G every step (ValueError naming the forms otherwise)."""
    if lookahead_config is None or lookahead_config.strip().lower() == AUTO:
        return AUTO, None
    asked = LookaheadConfig.parse(lookahead_config)
    return f"{asked.W},{asked.N},{asked.G}", asked


def _pbtxt_parameters(params: dict[str, str]) -> str:
    rows = [
        f'  {{ key: {json.dumps(key)} value: {{ string_value: {json.dumps(str(value))} }} }}'
        for key, value in params.items()
    ]
    return "parameters [\n" + ",\n".join(rows) + "\n]"


def write_repository(
    output: str | Path,
    name: str,
    model: str | None = None,
    engine: str | None = None,
    lookahead_config: str | None = None,
    instances: int = 1,
    max_batch_size: int = 0,
    max_seq_len: int | None = None,
    dtype: str = "float32",
    backend: str | None = None,
    default_max_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    verify: bool = True,
    max_batch: int | None = None,
    pool_scope: str = "shared",
    weights: str = "float",
    activations: str | None = None,
    tensor_parallel: int = 1,
) -> Path:
    """Write REPO/NAME/{config.pbtxt,1/model.py}; returns the model directory. weights, activations: a checkpoint's
    quantized engine (`build --weights --activations`), built now and cached; an engine dir keeps its own.
    tensor_parallel: each instance shards a checkpoint over that many rank processes (checked here)."""
    if (model is None) == (engine is None):
        raise UserError("give exactly one of --model (checkpoint dir or known name) and --engine (engine dir)")
    if not _NAME.match(name or ""):
        raise UserError(f"--name {name!r} must be a plain directory name (letters, digits, _ . -)")
    if not 1 <= as_int("--instances", instances) <= INT32_MAX:
        raise UserError(f"--instances must be in [1, {INT32_MAX}], got {instances}")
    if not 0 <= as_int("--max_batch_size", max_batch_size) <= INT32_MAX:
        raise UserError(f"--max_batch_size must be in [0, {INT32_MAX}], got {max_batch_size}")
    if max_batch is not None and as_int("--max-batch", max_batch) < 1:
        raise UserError(f"--max-batch must be >= 1 (concurrent requests per instance), got {max_batch}")
    model_root = Path(output) / name
    for directory in (Path(output), model_root, model_root / "1"):  # all before a build; nothing half written
        check_output_dir(directory, "--output")
    for file in (model_root / "config.pbtxt", model_root / "1" / "model.py"):
        check_output_file(file, "--output")
    params: dict[str, str] = {}
    lookahead, asked = served_lookahead(lookahead_config)
    if engine is not None:
        from trt_lookahead.engine.format import load_engine_config

        built = load_engine_config(Path(engine).expanduser(), verify=verify)  # UserError if not an engine dir
        if tensor_parallel != 1:
            check_tensor_parallel(built.path, tensor_parallel)  # refuses an engine dir
        refuse_weights_on_engine(weights, activations)
        if asked is not None:
            asked.check_fits(built.lookahead)
        built.check_request(max_seq_len=max_seq_len, max_batch=max_batch)
        params["engine"] = str(built.path.resolve())
        dtype = built.dtype  # an engine runs in the dtype it was built for
    else:
        from trt_lookahead.model.checkpoint import check_max_seq_len, read_config

        assert model is not None  # exactly one of model and engine
        model_dir = resolve_model(model).resolve()
        check_max_seq_len(max_seq_len, read_config(model_dir).max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        params["model"] = str(model_dir)
        if tensor_parallel != 1:
            check_tensor_parallel(model_dir, tensor_parallel, backend, None, weights, activations)
        weights, activations = check_scheme(weights, activations)
        # the cached engine, built now: the instances only open it (ranks shard the checkpoint itself: none)
        if tensor_parallel == 1 and checkpoint_backend(backend, dtype, asked, weights=weights)[0] == "onnxruntime":
            cached_checkpoint_engine(model_dir, dtype, max_seq_len, max_batch, asked,
                                     checkpoint_tree(DEFAULT, asked, "onnxruntime"), weights, activations)
        params.update(weights=weights, activations=activations, tensor_parallel=str(tensor_parallel))
    params.update(
        backend=backend or "",
        dtype=dtype,
        lookahead_config=lookahead,
        max_batch="" if max_batch is None else str(max_batch),
        max_seq_len="" if max_seq_len is None else str(max_seq_len),
        default_max_tokens=str(default_max_tokens),
        verify=str(verify).lower(),
        pool_scope=check_pool_scope(pool_scope),
        trt_lookahead_path=str(Path(trt_lookahead.__file__).resolve().parent.parent),
    )

    (model_root / "1").mkdir(parents=True, exist_ok=True)
    config = Template((TEMPLATES / "config.pbtxt").read_text()).substitute(
        name=name, max_batch_size=max_batch_size, instances=instances, parameters=_pbtxt_parameters(params),
        inputs=pbtxt_list(INPUTS), outputs=pbtxt_list(OUTPUTS),
    )
    write_text_atomic(model_root / "config.pbtxt", config)
    write_text_atomic(model_root / "1" / "model.py", (TEMPLATES / "model.py").read_text())
    return model_root
