"""`trt-lookahead triton-repo`: write a Triton Inference Server model repository for lookahead decoding.

REPO/NAME/config.pbtxt   Python backend, decoupled; inputs and outputs from schema.py (TensorRT-LLM's
                         ensemble names); the `parameters` block records what model.py needs: model or
                         engine path, backend, dtype, served lookahead config, max_seq_len, default
                         max_tokens.
REPO/NAME/1/model.py     drives one LookaheadRuntime per model instance (templates/model.py).

model.py imports `trt_lookahead`; in another Python (a user's Triton container) install it there
(`pip install trt-lookahead`) or put its source on PYTHONPATH. As a fallback model.py also tries the
`trt_lookahead_path` parameter: the directory this package was imported from when the repo was written.
See docs/design.md section 7.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from string import Template

import trt_lookahead
from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import AUTO, DEFAULT_LOOKAHEAD, LookaheadConfig
from trt_lookahead.model.fetch import resolve_model
from trt_lookahead.runtime import DEFAULT_MAX_NEW_TOKENS
from trt_lookahead.serving.schema import INPUTS, OUTPUTS, pbtxt_list

TEMPLATES = Path(__file__).parent / "templates"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


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
) -> Path:
    """Write REPO/NAME/{config.pbtxt,1/model.py}; returns the model directory."""
    if (model is None) == (engine is None):
        raise UserError("give exactly one of --model (checkpoint dir or known name) and --engine (engine dir)")
    if not _NAME.match(name or ""):
        raise UserError(f"--name {name!r} must be a plain directory name (letters, digits, _ . -)")
    if instances < 1:
        raise UserError(f"--instances must be >= 1, got {instances}")
    if max_batch_size < 0:
        raise UserError(f"--max_batch_size must be >= 0, got {max_batch_size}")
    if max_seq_len is not None and max_seq_len < 2:
        raise UserError(f"--max_seq_len must be >= 2, got {max_seq_len}")
    params: dict[str, str] = {}
    if engine is not None:
        from trt_lookahead.engine.format import load_engine_config

        built = load_engine_config(Path(engine).expanduser())  # UserError if it is not an engine dir
        served = LookaheadConfig.parse(lookahead_config) if lookahead_config else built.lookahead
        served.check_fits(built.lookahead)
        params["engine"] = str(built.path.resolve())
        dtype = built.dtype  # an engine runs in the dtype it was built for
    else:
        assert model is not None  # exactly one of model and engine
        model_dir = resolve_model(model).resolve()
        if not (model_dir / "config.json").is_file():
            raise UserError(f"--model {model}: {model_dir} has no config.json (expected a HF Llama checkpoint dir)")
        params["model"] = str(model_dir)
        if (lookahead_config or "").strip().lower() == AUTO:  # tuned for this machine, fixed in the repo
            served = _tuned_config(model_dir, dtype)
        else:
            served = LookaheadConfig.parse(lookahead_config) if lookahead_config else DEFAULT_LOOKAHEAD
    params.update(
        backend=backend or "",
        dtype=dtype,
        lookahead_config=f"{served.W},{served.N},{served.G}",
        max_seq_len="" if max_seq_len is None else str(max_seq_len),
        default_max_tokens=str(default_max_tokens),
        trt_lookahead_path=str(Path(trt_lookahead.__file__).resolve().parent.parent),
    )

    model_root = Path(output) / name
    (model_root / "1").mkdir(parents=True, exist_ok=True)
    config = Template((TEMPLATES / "config.pbtxt").read_text()).substitute(
        name=name, max_batch_size=max_batch_size, instances=instances, parameters=_pbtxt_parameters(params),
        inputs=pbtxt_list(INPUTS), outputs=pbtxt_list(OUTPUTS),
    )
    (model_root / "config.pbtxt").write_text(config)
    (model_root / "1" / "model.py").write_text((TEMPLATES / "model.py").read_text())
    return model_root


def _tuned_config(model_dir: Path, dtype: str) -> LookaheadConfig:
    """`auto` for a checkpoint on this machine, resolved by a runtime of it (tuned there on first use)."""
    from trt_lookahead.runtime import LookaheadRuntime
    from trt_lookahead.tuning.tune import tuning_seq_len

    rt = LookaheadRuntime.from_pretrained(model_dir, dtype=dtype, lookahead=None, max_seq_len=tuning_seq_len(model_dir))
    return rt.request_config(AUTO)
