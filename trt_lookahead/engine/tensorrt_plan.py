"""Build engine.plan from an engine dir with TensorRT (docs/design.md section 6.7).

    python -m trt_lookahead.engine.tensorrt_plan ENGINE_DIR      # on a GPU host with TensorRT >= 10.9

`build_plan` registers the LookaheadAttention QDP (kernels/tensorrt_plugin.py), parses prefill.onnx (the
dynamic-length graph) with trt.OnnxParser into a strongly typed network, adds the optimisation
profiles below and writes engine.plan; it returns config.json's `targets.tensorrt` entry, which the
build records with the rest of config.json and `record_plan` records for a plan built afterwards.

    profile 0  prefill   input_ids/positions [1 .. max_input_len], output_slots [1 .. max_input_len]
    profile 1  step      T = (W+G)(N-1) fixed, output_slots [1 .. T]
    profile 2  single    T = 1 (greedy baseline, CUDA graph too); absent when the step T is 1
    (the indices are engine/format.py's PREFILL_PROFILE, STEP_PROFILE, SINGLE_PROFILE)

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
    PLAN_FILE,
    PREFILL_GRAPH,
    EngineConfig,
    file_checksums,
    load_engine_config,
    write_engine_config,
)
from trt_lookahead.errors import UserError
from trt_lookahead.files import write_bytes_atomic


def _profiles(config: EngineConfig) -> list[dict[str, tuple[int, int, int]]]:
    """Per profile, (min, opt, max) of the token count and of the output row count."""
    T = config.step_tokens
    longest = config.max_input_len
    profiles = [
        {"tokens": (1, min(longest, 128), longest), "rows": (1, 1, longest)},  # prefill: last row only
        {"tokens": (T, T, T), "rows": (1, T, T)},  # step; a smaller config padded to T reads fewer rows
    ]
    if T != 1:
        profiles.append({"tokens": (1, 1, 1), "rows": (1, 1, 1)})  # single token: the greedy baseline
    return profiles


def build_plan(engine_dir: str | Path, verify: bool = True) -> dict[str, Any]:
    """Parse the engine dir's prefill graph with the plugin registered and write engine.plan.

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
    if not parser.parse_from_file(str(config.path / PREFILL_GRAPH)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise UserError(f"TensorRT could not parse {config.path / PREFILL_GRAPH}: {errors}")
    build_config = builder.create_builder_config()
    for ranges in _profiles(config):
        profile = builder.create_optimization_profile()
        for name, dim in (("input_ids", "tokens"), ("positions", "tokens"), ("output_slots", "rows")):
            low, opt, high = ranges[dim]
            profile.set_shape(name, (low,), (opt,), (high,))
        build_config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, build_config)
    if plan is None:
        raise UserError(f"TensorRT failed to build a plan from {config.path / PREFILL_GRAPH} (see its log above)")
    write_bytes_atomic(config.path / PLAN_FILE, bytes(plan))  # an interrupted write leaves no half plan
    return {"built": True, "plan": PLAN_FILE, "tensorrt": trt.__version__, "profiles": _profiles(config),
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
