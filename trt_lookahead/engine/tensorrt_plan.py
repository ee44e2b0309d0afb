"""Build engine.plan from an engine dir with TensorRT (docs/design.md section 6.7).

    python -m trt_lookahead.engine.tensorrt_plan ENGINE_DIR      # on a GPU host with TensorRT >= 10.9

`build_plan` registers the LookaheadAttention QDP (kernels/tensorrt_plugin.py), parses model.onnx (dynamic
batch, tokens and output rows) with trt.OnnxParser into a strongly typed network, adds the optimisation
profiles below and writes engine.plan; it returns config.json's `targets.tensorrt` entry, which the
build records with the rest of config.json and `record_plan` records for a plan built afterwards.

    profile 0       prefill   one row (batch 1) of 1 .. max_input_len tokens, one output row
    profile 1 + k   step      bucket k of engine/format.py's `step_buckets`: a fixed batch (1, 2, 4, ..,
                              max_batch) of fixed T (1, or the built T), T output rows

Every input with a batch dimension gets its range in each profile (the caches' batch too: an executor binds
the first B slots of its [max_batch, Hkv, S, D] caches). The executor (backends/tensorrt.py) holds one
execution context per step bucket, each with its own profile and its captured CUDA graph.

TensorRT cannot be installed on the project's CPU machines, so this is written to the TensorRT 11 Python
API as documented and has not run yet; its tests skip where TensorRT or a GPU is missing.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from trt_lookahead.backends.devices import import_tensorrt, tensorrt_unavailable_reason
from trt_lookahead.engine.format import (
    INPUTS,
    PLAN_FILE,
    EngineConfig,
    cache_names,
    file_checksums,
    load_engine_config,
    plan_profiles,
    write_engine_config,
)
from trt_lookahead.errors import UserError
from trt_lookahead.files import write_bytes_atomic


def _input_dims(config: EngineConfig) -> dict[str, tuple[str | int, ...]]:
    """Each graph input's shape: dynamic dimensions by name (engine/format.py's graph I/O)."""
    cache = ("batch", config.num_kv_heads, config.cache_rows, config.head_dim)
    shapes: dict[str, tuple[str | int, ...]] = {
        "input_ids": ("batch", "tokens"), "positions": ("batch", "tokens"), "cache_len": ("batch",),
        "step_config": ("batch", 3), "output_slots": ("batch", "rows"),
    }
    assert tuple(shapes) == INPUTS
    return shapes | {name: cache for name in cache_names(config.num_layers)}


def build_plan(engine_dir: str | Path, verify: bool = True) -> dict[str, Any]:
    """Parse the engine dir's graph with the plugin registered and write engine.plan.

    -> the `targets.tensorrt` entry of config.json (written by the caller: the build or `record_plan`).
    `verify=False` for the build itself, whose config.json does not list the files' checksums yet.
    """
    trt = import_tensorrt()
    import tensorrt.plugin as trtp

    from trt_lookahead.kernels import tensorrt_plugin

    start = time.perf_counter()
    config = load_engine_config(engine_dir, verify=verify)
    tensorrt_plugin.register(trt, trtp)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if int(trt.__version__.split(".")[0]) < 11:  # TensorRT 11 networks are always strongly typed
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(config.graph)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise UserError(f"TensorRT could not parse {config.graph}: {errors}")
    build_config = builder.create_builder_config()
    for ranges in plan_profiles(config):
        profile = builder.create_optimization_profile()
        for name, dims in _input_dims(config).items():
            low, opt, high = ([d if isinstance(d, int) else ranges[d][k] for d in dims] for k in range(3))
            profile.set_shape(name, low, opt, high)
        build_config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, build_config)
    if plan is None:
        raise UserError(f"TensorRT failed to build a plan from {config.graph} (see its log above)")
    write_bytes_atomic(config.path / PLAN_FILE, bytes(plan))  # an interrupted write leaves no half plan
    return {"built": True, "plan": PLAN_FILE, "tensorrt": trt.__version__, "profiles": plan_profiles(config),
            "build_seconds": round(time.perf_counter() - start, 2)}


def record_plan(engine_dir: str | Path, entry: dict[str, Any]) -> None:
    """Record a plan built after the engine dir: its `targets.tensorrt` entry and the files' checksums."""
    config = load_engine_config(engine_dir)
    raw = dict(config.raw)
    raw["targets"] = {**raw.get("targets", {}), "tensorrt": entry}
    raw["files"] = file_checksums(config.path)
    write_engine_config(config.path, raw)


def main(argv: list[str] | None = None) -> int:
    """`python -m trt_lookahead.engine.tensorrt_plan ENGINE_DIR`: build engine.plan on a GPU host."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m trt_lookahead.engine.tensorrt_plan ENGINE_DIR", file=sys.stderr)
        return 2
    reason = tensorrt_unavailable_reason()
    if reason is not None:
        print(f"error: cannot build a TensorRT plan here: {reason}", file=sys.stderr)
        return 2
    try:
        entry = build_plan(argv[0])
        record_plan(argv[0], entry)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{Path(argv[0]) / PLAN_FILE} built in {entry['build_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
