"""The engine dir format: file and graph I/O names, config.json read as a typed `EngineConfig`, checksums.

A leaf (docs/design.md section 6): backends read engine dirs through it without importing the build.

engines/NAME/
    config.json         format version (under FORMAT_KEY), model dims, dtype, lengths, max_batch, W/N/G and
                        T, attention mode, `exact` (true: onnxruntime runs the row-invariant decomposition,
                        docs/design.md section 4.2; absent: false), `tree` (the draft tree's parents, docs/
                        design.md 2.7; absent or null: linear candidates), I/O, file checksums, what was built
                        for which target and how it was checked
    model.onnx          the network with a dynamic batch B and token count T: lookahead steps, greedy
                        and causal rows mixed in one batch, and prefill chunks all run this one graph
                        (TensorRT builds all its profiles from it)
    weights.bin         the weights, as the graph's external data
    tokenizer files, generation_config.json
    engine.plan         TensorRT only, built where TensorRT and a GPU exist

Graph I/O (B <= max_batch rows, T tokens per row, K output rows per row; L layers, Hkv KV heads, head size
D; S <= cache_rows = max_seq_len + the built T, dynamic: an onnxruntime executor opened for a shorter
max_seq_len keeps S = its max_seq_len + T, a TensorRT plan fixes S = cache_rows):

    input_ids int32 [B, T]   positions int32 [B, T]   cache_len int32 [B]
    step_config int32 [B, 3] (W, N, G) per row; (0, 0, 0) = causal     output_slots int32 [B, K]
    key_cache_{l}, value_cache_{l} [B, Hkv, S, D] for each layer l, read only (row b: rows < cache_len[b])
    -> next_ids int32 [B, K] (argmax)   logits float32 [B, K, V]   present_keys, present_values [L, B, Hkv, T, D]

An executor keeps [max_batch, Hkv, S, D] caches per layer and binds their first B slots.

Integrity (docs/design.md section 6): config.json records the size and sha256 of every other file
(`files`) and the sha256 of its own other fields (`config_sha256`). Loading checks both by default: the
hashes are streamed, and a match is remembered in the cache dir by path, size, mtime and ctime, so a
second load of an unchanged engine reads no file again. `verify=False` (CLI `--no-verify`) skips the
hashes; the fields of config.json are checked for type, range and consistency either way.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trt_lookahead.errors import UserError, as_int
from trt_lookahead.files import file_digests, sha256_file, write_text_atomic
from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.tree import TreeTemplate

FORMAT_KEY = "trt_lookahead_engine"
FORMAT_VERSION = 6  # 2: tokens_per_step was renamed step_tokens; 3: config_sha256; 4: one graph with a batch
# dimension (model.onnx) replaced step.onnx + prefill.onnx; 5: LookaheadAttention takes tree_ends and `tree`;
# 6: tree_ends holds each node's (preorder index, subtree end), so `tree` may list its nodes best-first
CONFIG_FILE = "config.json"
CONFIG_DIGEST = "config_sha256"  # config.json's key for the sha256 of its other fields
NO_VERIFY = "pass --no-verify (verify=False) to run it anyway"
GRAPH_FILE, WEIGHTS_FILE, PLAN_FILE = "model.onnx", "weights.bin", "engine.plan"
# the projections' weights: float (the dtype's), or int8 / int4 blocks (engine/quantize.py); config.json
# `quantization`, absent in engines built before it (float)
WEIGHT_SCHEMES = ("float", "int8", "int4")
# what quantized weights multiply: float activations, or int8 blocks quantized per row (engine/quantize.py);
# config.json `activations`, absent in engines built before it (float)
ACTIVATION_SCHEMES = ("float", "int8")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_BUILD_SEQ_LEN = 2048  # a build's max_seq_len when none is given (at most the model's context)
DEFAULT_MAX_BATCH = 8  # rows per step an engine is built for unless `build --max-batch` says otherwise
ATTENTION_MODES = ("plugin", "native")
TARGETS = ("onnx", "tensorrt")
INPUTS = ("input_ids", "positions", "cache_len", "step_config", "output_slots")
OUTPUTS = ("next_ids", "logits", "present_keys", "present_values")
# config.json's keys in the order a build writes them (`EngineConfig.to_raw`); the ones a build adds later
# (CONFIG_DIGEST, files, build_seconds) follow in the order they were added
CONFIG_ORDER = (
    FORMAT_KEY, "model", "eos_token_id", "dtype", "max_seq_len", "max_input_len", "max_batch", "lookahead",
    "step_tokens", "output_slots", "cache_rows", "cache_layout", "attention", "exact", "tree", "quantization",
    "activations", "weight_blocks", "plugin", "graphs", "weights", "inputs", "outputs", "dims", "opset",
    "tokenizer_files", "build_key", "built_with", "targets",
)
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
    lookahead: LookaheadConfig  # the (W, N, G) the engine was built for
    step_tokens: int  # its T: the most tokens a step row may have
    max_batch: int  # the most rows a step may have
    max_seq_len: int
    max_input_len: int
    cache_rows: int
    dtype: str
    attention: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    exact: bool  # the row-invariant attention graph on onnxruntime (docs/design.md section 4.2)
    tree: TreeTemplate | None  # the verification slots' draft tree (docs/design.md 2.7); None: linear candidates
    raw: dict[str, Any]
    quantization: str = "float"  # the projections' weights, one of WEIGHT_SCHEMES (engine/quantize.py)
    activations: str = "float"  # what quantized projections multiply, one of ACTIVATION_SCHEMES

    @classmethod
    def from_raw(cls, path: Path, raw: dict[str, Any]) -> EngineConfig:
        """The typed config; UserError naming the first field of the wrong type, range or consistency."""
        lookahead = LookaheadConfig(*(as_int(f"lookahead.{k}", _field(raw, "lookahead", k)) for k in "WNG"))
        config = cls(
            path=path,
            lookahead=lookahead,
            step_tokens=_positive(raw, "step_tokens"),
            max_batch=_positive(raw, "max_batch"),
            max_seq_len=_positive(raw, "max_seq_len"),
            max_input_len=_positive(raw, "max_input_len"),
            cache_rows=_positive(raw, "cache_rows"),
            dtype=_choice(raw, "dtype", DTYPES),
            attention=_choice(raw, "attention", ATTENTION_MODES),
            vocab_size=_positive(raw, "model", "vocab_size"),
            num_layers=_positive(raw, "model", "num_layers"),
            num_kv_heads=_positive(raw, "model", "num_kv_heads"),
            head_dim=_positive(raw, "model", "head_dim"),
            exact=_flag(raw, "exact"),
            tree=_tree(raw),
            raw=raw,
            quantization=_choice(raw, "quantization", WEIGHT_SCHEMES) if "quantization" in raw else "float",
            activations=_choice(raw, "activations", ACTIVATION_SCHEMES) if "activations" in raw else "float",
        )
        rules = (
            (config.step_tokens == lookahead.step_tokens, f"step_tokens is not (W+G)(N-1) of {lookahead}"),
            (config.max_input_len <= config.max_seq_len, "max_input_len exceeds max_seq_len"),
            (config.cache_rows == config.max_seq_len + config.step_tokens, "cache_rows is not max_seq_len + T"),
            (config.tree is None or config.tree.nodes == lookahead.G * lookahead.levels,
             f"tree does not have the G(N-1) nodes of {lookahead}"),
            (config.activations == "float" or config.quantization != "float",
             "activations are int8 but the weights are float (int8 activations come with quantized weights)"),
        )
        for holds, broken in rules:
            if not holds:
                raise UserError(broken)
        _file_name("graphs.model", _field(raw, "graphs", "model"))
        for eos in _field(raw, "eos_token_id") if isinstance(_field(raw, "eos_token_id"), list) else [None]:
            as_int("eos_token_id", eos)
        return config

    def to_raw(self) -> dict[str, Any]:
        """config.json's fields, the inverse of `from_raw`: the typed fields from this config, every other field as
        `raw` records it (copied), in CONFIG_ORDER and then raw's other keys in their order."""
        typed: dict[str, Any] = {
            FORMAT_KEY: FORMAT_VERSION,
            "model": {**self.raw.get("model", {}), "vocab_size": self.vocab_size, "num_layers": self.num_layers,
                      "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim},
            "dtype": self.dtype,
            "max_seq_len": self.max_seq_len,
            "max_input_len": self.max_input_len,
            "max_batch": self.max_batch,
            "lookahead": {"W": self.lookahead.W, "N": self.lookahead.N, "G": self.lookahead.G},
            "step_tokens": self.step_tokens,
            "cache_rows": self.cache_rows,
            "attention": self.attention,
            "exact": self.exact,
            "tree": None if self.tree is None else list(self.tree.parents),
            "quantization": self.quantization,
            "activations": self.activations,
        }
        fields = {**copy.deepcopy(self.raw), **typed}
        ordered = {key: fields.pop(key) for key in CONFIG_ORDER if key in fields}
        return {**ordered, **fields}

    @property
    def source(self) -> str | None:
        return self.raw["model"].get("source")

    @property
    def weights_sha256(self) -> str | None:
        return self.raw["model"].get("weights_sha256")

    @property
    def graph(self) -> Path:
        """The engine's ONNX graph file."""
        return self.path / self.raw["graphs"]["model"]

    def graph_io(self) -> dict[str, tuple[int | None, ...]]:
        """The dims each input and output of the graph must have (None: dynamic), from these fields."""
        cache = (None, self.num_kv_heads, None, self.head_dim)  # [B, Hkv, S, D]
        present = (self.num_layers, None, self.num_kv_heads, None, self.head_dim)  # [L, B, Hkv, T, D]
        return {
            "input_ids": (None, None), "positions": (None, None), "cache_len": (None,), "step_config": (None, 3),
            "output_slots": (None, None), **{name: cache for name in cache_names(self.num_layers)},
            "next_ids": (None, None), "logits": (None, None, self.vocab_size), "present_keys": present,
            "present_values": present,
        }

    def check_graph_io(self, dims: Mapping[str, tuple[int | None, ...]]) -> None:
        """UserError if the graph (its I/O name -> dims, None for a dynamic dim) disagrees with config.json."""
        def fits(shape: tuple[int | None, ...], got: tuple[int | None, ...]) -> bool:
            return len(got) == len(shape) and all(w is None or w == d for w, d in zip(shape, got, strict=True))

        want = self.graph_io()
        differ = [
            f"{name} {list(dims.get(name, ()))} (config.json implies {list(shape)})"
            for name, shape in want.items() if not fits(shape, dims.get(name, ()))
        ] + [f"{name} (config.json has no such input)" for name in dims if name not in want]
        if differ:
            raise UserError(
                f"engine {self.path}: {self.raw['graphs']['model']} does not match its config.json: "
                f"{'; '.join(differ[:3])}; the config.json was edited or the files come from different builds: rebuild"
            )

    def check_request(self, *, lookahead: LookaheadConfig | None = None, dtype: str | None = None,
                      max_seq_len: int | None = None, max_batch: int | None = None,
                      model_sha256: str | None = None, exact: bool | None = None) -> None:
        """Raise UserError naming every way a request differs from what this engine was built for."""
        problems = []
        if exact and not self.exact:
            problems.append("exact steps were asked for but the engine was built without them (rebuild it with "
                            "`trt-lookahead build --exact`, or drop --exact)")
        if exact is False and self.exact:  # it has no other graph: the fast step was asked for and is not here
            problems.append("the fast step was asked for (--no-exact) but the engine was built with exact steps only "
                            "(build one without --exact, or drop --no-exact)")
        if lookahead is not None:
            try:
                lookahead.check_fits(self.lookahead)
            except ValueError as exc:
                problems.append(str(exc))
        if dtype is not None and dtype != self.dtype:
            problems.append(f"dtype {dtype} was asked for but the engine holds {self.dtype} weights "
                            f"(pass --dtype {self.dtype} or rebuild)")
        if max_seq_len is not None and as_int("max_seq_len", max_seq_len) < 2:
            problems.append(f"max_seq_len {max_seq_len} is too small (give at least 2: prompt + one new token)")
        if max_seq_len is not None and max_seq_len > self.max_seq_len:
            problems.append(f"max_seq_len {max_seq_len} exceeds the engine's {self.max_seq_len} "
                            "(rebuild with a larger one)")
        if max_batch is not None and max_batch > self.max_batch:
            problems.append(f"max_batch {max_batch} exceeds the engine's {self.max_batch} "
                            f"(rebuild with --max-batch {max_batch})")
        if model_sha256 is not None and model_sha256 != self.weights_sha256:
            problems.append(f"the engine was built from another model ({self.source})")
        if problems:
            raise UserError(f"engine {self.path} does not fit the request: " + "; ".join(problems))


def _field(raw: dict[str, Any], *keys: str) -> Any:
    value: Any = raw
    for i, key in enumerate(keys):
        if not isinstance(value, dict) or key not in value:
            raise UserError(f"config.json has no {'.'.join(keys[: i + 1])}")
        value = value[key]
    return value


def _tree(raw: dict[str, Any]) -> TreeTemplate | None:
    """The optional draft tree: a list of parents, each before its children (absent or null: none)."""
    parents = raw.get("tree")
    if parents is None:
        return None
    try:
        return TreeTemplate(tuple(as_int("tree parent", p) for p in parents))
    except (TypeError, ValueError) as exc:
        raise UserError(f"tree = {parents!r} is not a draft tree ({exc}); rebuild the engine") from None


def _flag(raw: dict[str, Any], key: str) -> bool:
    """An optional true/false field (absent: false)."""
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise UserError(f"{key} = {value!r}; it must be true or false")
    return value


def _positive(raw: dict[str, Any], *keys: str) -> int:
    name = ".".join(keys)
    value = as_int(name, _field(raw, *keys))
    if value < 1:
        raise UserError(f"{name} = {value}; it must be >= 1")
    return value


def _choice(raw: dict[str, Any], key: str, allowed: tuple[str, ...]) -> str:
    value = _field(raw, key)
    if value not in allowed:
        raise UserError(f"{key} = {value!r}; it must be one of {', '.join(allowed)}")
    return value


def _file_name(key: str, name: Any) -> str:
    """`name` if it names a file inside the engine dir (no path), else UserError naming `key`."""
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise UserError(f"{key} must be a file name in the engine dir, got {name!r}")
    return name


def _listed_files(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json's `files`: file name -> {"bytes", "sha256"}."""
    files = _field(raw, "files")
    if not isinstance(files, dict):
        raise UserError(f"files must map file names to their bytes and sha256, got {type(files).__name__}")
    for name in files:
        _file_name("files", name)
    return files


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes a padded step runs at (a batch of B rows is padded up to the next): 1, 2, 4, .., max_batch.

    The one formula for the TensorRT plan's step profiles, the padded torch executor's buckets and the row
    counts `tune` measures."""
    sizes = [1 << k for k in range(max_batch.bit_length()) if 1 << k < max_batch]
    return [*sizes, max_batch]


def plan_profiles(config: EngineConfig) -> list[dict[str, tuple[int, int, int]]]:
    """engine.plan's optimisation profiles: (min, opt, max) of the graph's dynamic dims (section 6.7).

    Profile 0 runs prefill chunks: one row of 1 .. max_input_len tokens, its last token's output. Then one
    profile of fixed shape per step bucket (batch bucket, T of 1 or the built T): TensorRT lets a live
    execution context hold a profile alone, and the TensorRT executor keeps one context, with its captured
    CUDA graph, per bucket.
    """
    longest = config.max_input_len
    profiles = [{"batch": (1, 1, 1), "tokens": (1, min(longest, 128), longest), "rows": (1, 1, 1)}]
    for batch, tokens in step_buckets(config):
        profiles.append({"batch": (batch,) * 3, "tokens": (tokens,) * 3, "rows": (tokens,) * 3})
    return profiles


def step_buckets(config: EngineConfig) -> list[tuple[int, int]]:
    """(batch, tokens) of every step profile, in profile order (profile 1 + index)."""
    tokens = sorted({1, config.step_tokens})
    return [(batch, t) for batch in batch_buckets(config.max_batch) for t in tokens]


def _read_json(file: Path) -> Any:
    return json.loads(file.read_text(encoding="utf-8"))


def config_digest(raw: Mapping[str, Any]) -> str:
    """sha256 of config.json's fields but CONFIG_DIGEST, as canonical JSON (sorted keys, no spaces)."""
    body = {key: value for key, value in raw.items() if key != CONFIG_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def is_engine_dir(path: str | os.PathLike) -> bool:
    """Whether `path` holds a trt-lookahead engine's config.json (any format version): the engine marker."""
    try:
        raw = _read_json(Path(path) / CONFIG_FILE)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(raw, dict) and FORMAT_KEY in raw


def check_engine_json(path: str | os.PathLike, flag: str) -> None:
    """UserError naming the file and the fix if `path`'s config.json exists but is not valid JSON (a truncated or
    damaged engine config, which `is_engine_dir` cannot tell from another directory)."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        return
    try:
        _read_json(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{flag} {path}: {file} is not valid JSON ({exc}); it is damaged or truncated: rebuild the "
                        "engine with `trt-lookahead build --force`, or restore the file") from None


def load_engine_config(path: str | os.PathLike, verify: bool = True) -> EngineConfig:
    """Read and check an engine dir's config.json, and with `verify` every file's checksum (UserError naming
    what is wrong and the fix)."""
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
    if verify and raw.get(CONFIG_DIGEST) != config_digest(raw):
        raise UserError(
            f"{file} was changed after the build (its {CONFIG_DIGEST} does not match its fields); rebuild the "
            f"engine, or {NO_VERIFY}"
        )
    try:
        config = EngineConfig.from_raw(root, raw)
        listed = _listed_files(raw) if verify else {}
    except UserError as exc:
        raise UserError(f"engine {root} has a malformed config.json: {exc}; rebuild it") from exc
    missing = [name for name in (*raw["graphs"].values(), *listed) if not (root / name).is_file()]
    if missing:
        raise UserError(f"engine {root} is incomplete (missing {', '.join(dict.fromkeys(missing))}); rebuild it")
    if verify:
        verify_files(root, listed)
    return config


def write_engine_config(root: Path, raw: dict[str, Any]) -> None:
    """Write config.json atomically (a reader never sees half of it), with its CONFIG_DIGEST."""
    raw[CONFIG_DIGEST] = config_digest(raw)
    write_text_atomic(root / CONFIG_FILE, json.dumps(raw, indent=2) + "\n")


def file_checksums(root: Path) -> dict[str, dict[str, Any]]:
    """bytes and sha256 of every file in an engine dir but config.json (what config.json records as `files`)."""
    return {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(root.iterdir()) if p.is_file() and p.name != CONFIG_FILE}


def verify_files(root: Path, files: dict[str, Any]) -> None:
    """Every file `files` lists has its recorded size and sha256; UserError naming the first that differs.

    Sizes first (a truncated file costs no hashing); the digests are files.file_digests', which rereads a file
    only when it changed since it was last hashed.
    """
    for name in files:
        file = root / name
        want_bytes = as_int(f"files.{name}.bytes", _field(files, name, "bytes"))
        size = file.stat().st_size
        if size != want_bytes:
            raise UserError(
                f"engine file {file} has {size} bytes but config.json recorded {want_bytes} at build time "
                f"(truncated or replaced); rebuild the engine, or {NO_VERIFY}"
            )
    for name, got in zip(files, file_digests([root / name for name in files]), strict=True):
        if got != _field(files, name, "sha256"):
            raise UserError(
                f"engine file {root / name} does not match the sha256 config.json recorded at build time (modified "
                f"or corrupted); rebuild the engine, or {NO_VERIFY}"
            )
