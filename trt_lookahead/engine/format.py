"""The engine dir format: file and graph I/O names, config.json read as a typed `EngineConfig`, checksums.

A leaf (docs/design.md section 6): backends read engine dirs through it without importing the build.

engines/NAME/
    config.json         format version (under FORMAT_KEY), model dims, dtype, lengths, W/N/G and T,
                        attention mode, I/O, file checksums, what was built for which target and how it
                        was checked
    step.onnx           the step graph at fixed T = (W+G)(N-1)
    prefill.onnx        the same network with a dynamic token count (prefill, T = 1 greedy steps;
                        TensorRT builds all its profiles from this one)
    weights.bin         the weights, once, as external data of both graphs
    tokenizer files, generation_config.json
    engine.plan         TensorRT only, built where TensorRT and a GPU exist

Graph I/O (both graphs; the cache layout is [Hkv, S, D] per layer, S = max_seq_len + T):

    input_ids int32 [T]   positions int32 [T]   cache_len int32 [1]   step_config int32 [3] (W, N, G; 0 = causal)
    output_slots int32 [K]   key_cache_{l}, value_cache_{l} [Hkv, S, D] for each layer l
    -> next_ids int32 [K] (argmax)   logits float32 [K, V]   present_keys, present_values [L, Hkv, T, D]
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trt_lookahead.errors import UserError
from trt_lookahead.files import sha256_file, write_text_atomic
from trt_lookahead.lookahead.config import LookaheadConfig

FORMAT_KEY = "trt_lookahead_engine"
FORMAT_VERSION = 2  # 2: tokens_per_step was renamed step_tokens
CONFIG_FILE = "config.json"
STEP_GRAPH, PREFILL_GRAPH, WEIGHTS_FILE, PLAN_FILE = "step.onnx", "prefill.onnx", "weights.bin", "engine.plan"
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_MODES = ("plugin", "native")
TARGETS = ("onnx", "tensorrt")
PREFILL_PROFILE, STEP_PROFILE, SINGLE_PROFILE = 0, 1, 2  # engine.plan's optimisation profiles (section 6.7)
INPUTS = ("input_ids", "positions", "cache_len", "step_config", "output_slots")
OUTPUTS = ("next_ids", "logits", "present_keys", "present_values")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json",
)


def plan_command(engine_dir: str | os.PathLike) -> str:
    """The shell command that builds engine.plan for `engine_dir` on a GPU host with TensorRT."""
    return f"python -m trt_lookahead.engine.tensorrt_plan {engine_dir}"


def cache_names(layers: int) -> list[str]:
    """Graph input names of the per-layer caches: every key cache, then every value cache."""
    return [f"key_cache_{i}" for i in range(layers)] + [f"value_cache_{i}" for i in range(layers)]


@dataclass(frozen=True)
class EngineConfig:
    """config.json of an engine dir, the fields the backends read typed; `raw` keeps every recorded field."""

    path: Path
    lookahead: LookaheadConfig  # the (W, N, G) the step graph was built for
    step_tokens: int
    max_seq_len: int
    max_input_len: int
    cache_rows: int
    dtype: str
    attention: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    raw: dict[str, Any]

    @classmethod
    def from_raw(cls, path: Path, raw: dict[str, Any]) -> EngineConfig:
        model = raw["model"]
        return cls(
            path=path,
            lookahead=LookaheadConfig(**raw["lookahead"]),
            step_tokens=int(raw["step_tokens"]),
            max_seq_len=int(raw["max_seq_len"]),
            max_input_len=int(raw["max_input_len"]),
            cache_rows=int(raw["cache_rows"]),
            dtype=str(raw["dtype"]),
            attention=str(raw["attention"]),
            vocab_size=int(model["vocab_size"]),
            num_layers=int(model["num_layers"]),
            num_kv_heads=int(model["num_kv_heads"]),
            head_dim=int(model["head_dim"]),
            raw=raw,
        )

    @property
    def source(self) -> str | None:
        return self.raw["model"].get("source")

    @property
    def weights_sha256(self) -> str | None:
        return self.raw["model"].get("weights_sha256")

    def graph(self, which: str) -> Path:
        """The file of graph `which` ("step" or "prefill")."""
        return self.path / self.raw["graphs"][which]

    def check_request(self, *, lookahead: LookaheadConfig | None = None, dtype: str | None = None,
                      max_seq_len: int | None = None, model_sha256: str | None = None) -> None:
        """Raise UserError naming every way a request differs from what this engine was built for."""
        problems = []
        if lookahead is not None:
            try:
                lookahead.check_fits(self.lookahead)
            except ValueError as exc:
                problems.append(str(exc))
        if dtype is not None and dtype != self.dtype:
            problems.append(f"dtype {dtype} was asked for but the engine holds {self.dtype} weights "
                            f"(pass --dtype {self.dtype} or rebuild)")
        if max_seq_len is not None and max_seq_len > self.max_seq_len:
            problems.append(f"max_seq_len {max_seq_len} exceeds the engine's {self.max_seq_len} "
                            "(rebuild with a larger one)")
        if model_sha256 is not None and model_sha256 != self.weights_sha256:
            problems.append(f"the engine was built from another model ({self.source})")
        if problems:
            raise UserError(f"engine {self.path} does not fit the request: " + "; ".join(problems))


def _read_json(file: Path) -> Any:
    return json.loads(file.read_text(encoding="utf-8"))


def is_engine_dir(path: str | os.PathLike) -> bool:
    """Whether `path` holds a trt-lookahead engine's config.json (any format version)."""
    try:
        raw = _read_json(Path(path) / CONFIG_FILE)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(raw, dict) and FORMAT_KEY in raw


def load_engine_config(path: str | os.PathLike) -> EngineConfig:
    """Read and validate an engine dir's config.json (UserError naming what is wrong and the fix)."""
    root = Path(path)
    file = root / CONFIG_FILE
    if not file.is_file():
        raise UserError(f"{root} is not an engine dir (no config.json); build one with `trt-lookahead build`")
    try:
        raw = _read_json(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{file} is not valid JSON ({exc}); rebuild the engine") from exc
    if not isinstance(raw, dict) or FORMAT_KEY not in raw:
        raise UserError(f"{root} is a model checkpoint or another tool's output, not a trt-lookahead engine dir")
    version = raw[FORMAT_KEY]
    if version != FORMAT_VERSION:
        raise UserError(
            f"engine {root} has format version {version!r} but this trt-lookahead reads version {FORMAT_VERSION}; "
            "rebuild it with `trt-lookahead build --force`"
        )
    missing = [name for name in raw.get("graphs", {}).values() if not (root / name).is_file()]
    if "graphs" not in raw or missing:
        raise UserError(f"engine {root} is incomplete (missing {', '.join(missing) or 'graphs'}); rebuild it")
    try:
        return EngineConfig.from_raw(root, raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"engine {root} has a malformed config.json ({exc!r}); rebuild it") from exc


def write_engine_config(root: Path, raw: dict[str, Any]) -> None:
    """Write config.json atomically (a reader never sees half of it)."""
    write_text_atomic(root / CONFIG_FILE, json.dumps(raw, indent=2) + "\n")


def file_checksums(root: Path) -> dict[str, dict[str, Any]]:
    """bytes and sha256 of every file in an engine dir but config.json (what config.json records as `files`)."""
    return {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(root.iterdir()) if p.is_file() and p.name != CONFIG_FILE}
