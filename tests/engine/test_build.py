"""`trt-lookahead build` on stories260K: the engine dir, its graphs and config, and every bad input.

Each build exports the model once (about 10 s for stories260K), so builds are shared where possible.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from trt_lookahead.backends.devices import tensorrt_unavailable_reason
from trt_lookahead.cli import main
from trt_lookahead.engine import build, format
from trt_lookahead.errors import UserError
from trt_lookahead.files import sha256_file
from trt_lookahead.kernels import onnx_op
from trt_lookahead.lookahead.tree import TREE_DEPTH, tree_template

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
LAYERS = 5

pytestmark = pytest.mark.export  # every test here builds or reads engine dirs


def build_args(output, *extra, config="4,3,4", model=STORIES):
    return ["build", "--model", str(model), "--output", str(output), "--lookahead_config", config,
            "--max_seq_len", "256", "--max_input_len", "64", *extra]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One plugin engine, built for the tensorrt target (everything but the plan where TensorRT is missing)."""
    out = tmp_path_factory.mktemp("engines") / "stories-4-3-4"
    assert main(build_args(out, "--target", "tensorrt")) == 0
    return out


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def test_engine_dir_holds_graphs_weights_tokenizer_and_config(engine):
    names = {p.name for p in engine.iterdir()}
    assert {"config.json", "model.onnx", "weights.bin", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    config = json.loads((engine / "config.json").read_text())
    assert config[format.FORMAT_KEY] == format.FORMAT_VERSION
    assert config["model"]["num_layers"] == LAYERS and config["model"]["num_kv_heads"] == 4
    assert config["model"]["head_dim"] == 8 and config["model"]["vocab_size"] == 512
    assert (config["dtype"], config["max_seq_len"], config["max_input_len"]) == ("float32", 256, 64)
    assert config["lookahead"] == {"W": 4, "N": 3, "G": 4} and config["step_tokens"] == 16
    assert config["max_batch"] == format.DEFAULT_MAX_BATCH == 8 and config["graphs"] == {"model": "model.onnx"}
    assert config["cache_rows"] == 256 + 16 and config["attention"] == "plugin"
    assert config["plugin"]["op_type"] == "LookaheadAttention"
    assert config["plugin"]["plugin_namespace"] == "trt_lookahead"
    assert "tokenizer.json" in config["tokenizer_files"]
    for name, entry in config["files"].items():
        assert sha256_file(engine / name) == entry["sha256"], name
    smoke = config["targets"]["onnx"]["smoke_check"]
    assert smoke["ran"] and smoke["tokens_equal"] == smoke["tokens_compared"] > 10


def test_the_graph_hands_each_layers_step_kv_to_its_attention_node_without_a_copy(engine):
    """No scratch cache in the export: each LookaheadAttention node reads K and V straight from the layer's
    projection (through views), so the graph holds no ScatterND (it held one per layer for K and for V)."""
    model = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    assert not [n.name for n in model.graph.node if n.op_type in ("ScatterND", "ScatterElements")]
    assert len(onnx_op.attention_nodes(model)) == LAYERS


def dims(model, name: str) -> list:
    (value,) = [v for v in [*model.graph.input, *model.graph.output] if v.name == name]
    return [d.dim_value or d.dim_param for d in value.type.tensor_type.shape.dim]


def test_the_graph_has_batch_tokens_rows_and_cache_dims_and_one_plugin_node_per_layer(engine):
    onnx.checker.check_model(str(engine / "model.onnx"), full_check=True)
    model = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    assert {name: dims(model, name) for name in (*format.INPUTS, "key_cache_0", "value_cache_4", *format.OUTPUTS)} == {
        "input_ids": ["batch", "tokens"], "positions": ["batch", "tokens"], "cache_len": ["batch"],
        "step_config": ["batch", 3], "output_slots": ["batch", "rows"], "key_cache_0": ["batch", 4, "cache_rows", 8],
        "value_cache_4": ["batch", 4, "cache_rows", 8], "next_ids": ["batch", "rows"], "logits": ["batch", "rows", 512],
        "present_keys": [LAYERS, "batch", 4, "tokens", 8], "present_values": [LAYERS, "batch", 4, "tokens", 8],
    }
    nodes = onnx_op.attention_nodes(model)
    assert len(nodes) == LAYERS
    attrs = {a.name: helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["num_q_heads"] == 8 and attrs["num_kv_heads"] == 4 and attrs["head_dim"] == 8
    # build's default: the `auto` tree of 4/3/4's 8 verification slots, its ends over the graph's 64 tokens
    assert attrs["plugin_namespace"] == b"trt_lookahead" and attrs["aot"] == 1 and attrs["tree"] == 1
    assert list(nodes[0].input[3:]) == ["key_cache_0", "value_cache_0", "cache_len", "step_config", "tree_ends"]
    template = tree_template(8, TREE_DEPTH)
    assert json.loads((engine / "config.json").read_text())["tree"] == list(template.parents)
    (table,) = [numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "tree_ends"]
    assert table.dtype == np.int32 and table.tolist() == [*template.table.tolist(), *[0] * 2 * (64 - 8)]


def test_a_linear_build_carries_an_unread_dummy_table(tmp_path):
    assert main(build_args(tmp_path / "linear", "--tree", "off")) == 0
    model = onnx.load(str(tmp_path / "linear" / "model.onnx"), load_external_data=False)
    attrs = {a.name: helper.get_attribute_value(a) for a in onnx_op.attention_nodes(model)[0].attribute}
    (dummy,) = [numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "tree_ends"]
    assert attrs["tree"] == 0 and dummy.dtype == np.int32 and dummy.tolist() == [0]
    assert json.loads((tmp_path / "linear" / "config.json").read_text())["tree"] is None
    assert {(o.domain, o.version) for o in model.opset_import} == {("", 23), ("trt_lookahead", 1)}


def test_weights_are_stored_beside_the_graph(engine):
    model = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    external = {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer if t.external_data}
    assert external and {e["location"] for e in external.values()} == {"weights.bin"}
    assert all(int(e["offset"]) % 64 == 0 for e in external.values())
    model_bytes = (STORIES / "model.safetensors").stat().st_size
    assert 0.9 * model_bytes < (engine / "weights.bin").stat().st_size < 1.1 * model_bytes  # stored once


def test_tensorrt_target_writes_everything_else_and_says_what_remains(engine):
    config = json.loads((engine / "config.json").read_text())
    reason = tensorrt_unavailable_reason()
    if reason is None:
        target = config["targets"]["tensorrt"]  # the plan build's own entry, not overwritten by the build
        assert target["built"] and target["tensorrt"] and target["profiles"] and (engine / "engine.plan").is_file()
        return
    target = config["targets"]["tensorrt"]
    assert not target["built"] and target["reason"] == reason
    assert target["command"] == f"python -m trt_lookahead.engine.tensorrt_plan {engine}"
    assert not (engine / "engine.plan").exists()


def test_a_plan_built_afterwards_is_recorded_with_its_entry_and_checksum(engine, tmp_path):
    """`python -m trt_lookahead.engine.tensorrt_plan` records build_plan's entry as given (version,
    profiles) and the plan's checksum, and keeps every other field (the plan's bytes here are a stand-in:
    TensorRT cannot run on this machine)."""
    from trt_lookahead.engine.tensorrt_plan import record_plan

    copy = tmp_path / "copy"
    shutil.copytree(engine, copy)
    before = json.loads((copy / "config.json").read_text())
    (copy / "engine.plan").write_bytes(b"plan bytes")
    entry = {"built": True, "plan": "engine.plan", "tensorrt": "11.1.0", "profiles": [{"tokens": [16, 16, 16]}],
             "build_seconds": 1.5}
    record_plan(copy, entry)
    after = json.loads((copy / "config.json").read_text())
    assert after["targets"] == {**before["targets"], "tensorrt": entry}
    assert after["files"]["engine.plan"] == {"bytes": 10, "sha256": sha256_file(copy / "engine.plan")}
    changed = ("targets", "files", format.CONFIG_DIGEST)
    assert {k: v for k, v in after.items() if k not in changed} == {k: v for k, v in before.items() if k not in changed}
    assert format.load_engine_config(copy).path == copy  # verifies the new digest and every checksum


def test_tensorrt_remaining_step_is_printed(tmp_path, capsys):
    if tensorrt_unavailable_reason() is None:
        pytest.skip("TensorRT is available here: the plan gets built instead")
    out = tmp_path / "trt"
    assert main(build_args(out, "--target", "tensorrt", config="2,2,1")) == 0
    printed = capsys.readouterr().out
    assert f"python -m trt_lookahead.engine.tensorrt_plan {out}" in printed
    assert "engine.plan" in printed


def test_same_build_again_is_a_no_op_and_a_different_one_needs_force(engine, tmp_path, capsys):
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    assert main(build_args(copy, "--target", "tensorrt")) == 0
    assert "nothing to do" in capsys.readouterr().err
    before = (copy / "config.json").read_text()
    assert main(build_args(copy, "--attention", "native")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists" in err[0] and "--force" in err[0]
    assert (copy / "config.json").read_text() == before
    assert main(build_args(copy, "--attention", "native", "--force")) == 0
    config = json.loads((copy / "config.json").read_text())
    assert config["attention"] == "native" and config["targets"]["onnx"]["smoke_check"]["match_rate"] == 1.0
    model = onnx.load(str(copy / "model.onnx"), load_external_data=False)
    assert not onnx_op.attention_nodes(model)
    assert sum(n.op_type == "Attention" and n.domain == "" for n in model.graph.node) == LAYERS
    assert leftovers(tmp_path, "engine") == []


@pytest.mark.parametrize(
    "change,message",
    [
        ({"--dtype": "float64"}, "unknown dtype 'float64'"),
        ({"--max_seq_len": "32"}, "below the prompt limit max_input_len 64"),
        ({"--model": "/nonexistent/checkpoint"}, "neither an existing directory or .gguf file nor a known model"),
        ({"--max_seq_len": "4096", "--max_input_len": "64"}, "exceeds the model's context of 512"),
        ({"--lookahead_config": "4,1,4"}, "N=1 is impossible"),
        ({"--max-batch": "0"}, "max_batch 0 is impossible"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, change, message):
    argv = build_args(tmp_path / "out")
    for flag, value in change.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("weights", ["float", "int4"])
def test_a_checkpoint_holding_a_nan_is_refused_and_builds_nothing(tmp_path, capsys, weights):
    """A NaN weight makes every logit NaN, which the smoke check cannot tell from agreement: the float build would
    be "ready" and answer garbage. One line names the weight (an int4 build reads its projections after the export:
    the same line then) and no engine dir is left."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "ckpt"
    shutil.copytree(STORIES, model)
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.4.mlp.gate_proj.weight"][0, 0] = float("nan")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "engines" / "out"
    out.parent.mkdir()
    extra = [] if weights == "float" else ["--weights", weights]
    assert main(build_args(out, *extra, model=model)) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and "weight model.layers.4.mlp.gate_proj.weight in " in err[0]
    assert "holds 1 NaN or infinite value(s); the checkpoint is corrupt" in err[0]
    assert list(out.parent.iterdir()) == []


def test_output_that_is_not_an_engine_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(build_args(out)) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_interrupted_build_leaves_no_half_written_dir(tmp_path, monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "smoke_check", interrupt)
    assert main(build_args(tmp_path / "out")) == 130
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("version", [format.FORMAT_VERSION - 1, 0])  # tree_ends of subtree ends only, and older
def test_engine_from_another_format_version_is_refused(engine, tmp_path, capsys, version):
    copy = tmp_path / "old"
    shutil.copytree(engine, copy)
    config = json.loads((copy / "config.json").read_text())
    config[format.FORMAT_KEY] = version
    (copy / "config.json").write_text(json.dumps(config))
    reads = f"format version {version} but this trt-lookahead reads version {format.FORMAT_VERSION}"
    with pytest.raises(UserError, match=reads):
        format.load_engine_config(copy)
    code = main(["generate", "--engine", str(copy), "--prompt", "Once", "--max-new-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"format version {version}" in err[0] and "--force" in err[0]


def test_config_json_is_written_by_to_raw_and_read_back_by_from_raw(engine):
    """The build writes config.json through EngineConfig.to_raw: the file holds what the build was asked for,
    keys in the format's order, and from_raw(to_raw(c)) == c, also for a config with other typed fields."""
    config = format.load_engine_config(engine)
    written = json.loads((engine / format.CONFIG_FILE).read_text())
    assert written["lookahead"] == {"W": 4, "N": 3, "G": 4} and written["max_seq_len"] == 256  # build_args'
    assert written["max_input_len"] == 64
    order = [key for key in format.CONFIG_ORDER if key in written]
    assert list(written)[: len(order)] == order
    assert format.EngineConfig.from_raw(config.path, config.to_raw()) == config
    changed = dataclasses.replace(config, max_batch=3, max_seq_len=128, cache_rows=128 + 16, exact=True,
                                  tree=tree_template(8, 2))
    again = format.EngineConfig.from_raw(changed.path, changed.to_raw())
    assert again.to_raw() == changed.to_raw() and again.raw["max_batch"] == 3 and again.raw["tree"] == list(
        tree_template(8, 2).parents)
    assert (again.max_batch, again.max_seq_len, again.exact, again.tree) == (3, 128, True, tree_template(8, 2))
    assert again.raw["files"] == config.raw["files"]  # the fields it does not type are kept as recorded


def test_plan_profiles_give_prefill_one_row_and_each_step_bucket_its_own_fixed_shape(engine):
    config = format.load_engine_config(engine)
    assert format.batch_buckets(8) == [1, 2, 4, 8] and format.batch_buckets(6) == [1, 2, 4, 6]
    profiles = format.plan_profiles(config)
    assert profiles[0] == {"batch": (1, 1, 1), "tokens": (1, 64, 64), "rows": (1, 1, 1)}
    steps = [(p["batch"], p["tokens"], p["rows"]) for p in profiles[1:]]
    assert steps == [((b,) * 3, (t,) * 3, (t,) * 3) for b in (1, 2, 4, 8) for t in (1, 16)]
    assert format.step_buckets(config) == [(b, t) for b in (1, 2, 4, 8) for t in (1, 16)]


def test_bfloat16_engine_is_built_and_says_onnxruntime_cannot_check_it(tmp_path):
    out = tmp_path / "bf16"
    assert main(build_args(out, "--dtype", "bfloat16", config="2,2,1")) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    smoke = config["targets"]["onnx"]["smoke_check"]
    assert not smoke["ran"] and "bfloat16" in smoke["reason"]
    onnx.checker.check_model(str(out / "model.onnx"), full_check=True)
    weights = {t.data_type for t in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.initializer
               if t.external_data}
    assert weights == {onnx.TensorProto.BFLOAT16}
