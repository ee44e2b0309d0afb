"""ONNX export of an engine's graphs: the shared `Llama` against read-only per-layer caches.

The caches are read-only inputs: a step attends over rows 0..cache_len-1 plus its own T tokens and
returns their K/V; the executor commits the accepted rows (no in-graph copy of the whole cache).
Attention is the LookaheadAttention node (--attention plugin, kernels/onnx_op.py) or the standard
ONNX Attention-23 op (--attention native) over keys [cache rows ; step rows] with a boolean [T, S+T]
mask computed in the graph from cache_len and step_config. The native form passes no past_key /
past_value: onnxruntime 1.31's CPU kernel refuses past_key without a present_key output, and the
present (a copy of the whole cache) is not wanted; the concatenation costs the same copy.
See docs/design.md sections 6.3 and 6.4.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import warnings
from pathlib import Path
from typing import Any

from trt_lookahead.engine.format import INPUTS, OUTPUTS, WEIGHTS_FILE, cache_names
from trt_lookahead.kernels import mask, onnx_op, reference

OPSET = 23
_INLINE_BYTES = 1024  # initializers smaller than this stay inside the graph files


def plugin_contract() -> dict[str, Any]:
    """What config.json records of the LookaheadAttention node (and TensorRT looks the plugin up by)."""
    return {"op_type": reference.OP_NAME, "domain": reference.OP_DOMAIN, "version": reference.OP_VERSION,
            "plugin_namespace": reference.OP_DOMAIN, "plugin_version": onnx_op.PLUGIN_VERSION, "aot": 1}


def _graph_module(model, attention: str):
    """The export wrapper: one forward of the shared `Llama` against read-only per-layer caches.

    It drives the model through its public forward and attention seam: the model writes each layer's
    step K/V into a [T]-row scratch cache (cache_len 0), so the seam hands the attention function the
    step's own K/V, and the function pairs them with that layer's real cache (graph inputs).
    """
    import torch

    cfg = model.cfg
    layers, kv_heads, head_dim = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    scale = reference.default_scale(head_dim)
    attrs = onnx_op.node_attributes(cfg.num_heads, kv_heads, head_dim, scale)

    def step_mask(tokens, step_config):
        idx = torch.arange(tokens)
        return mask.step_visible(idx[:, None], idx[None, :], *step_config.long().unbind(0))

    class StepGraph(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, positions, cache_len, step_config, output_slots, caches):
            tokens = input_ids.shape[0]
            key_caches, value_caches = caches[:layers], caches[layers:]
            scratch_k = torch.zeros(layers, tokens, kv_heads, head_dim, dtype=model.dtype)
            scratch_v = torch.zeros_like(scratch_k)
            if attention == "native":
                prefix = torch.arange(key_caches[0].shape[1])[None, :] < cache_len.long()
                full_mask = torch.cat([prefix.expand(tokens, -1), step_mask(tokens, step_config)], 1)
            presents: list[tuple[torch.Tensor, torch.Tensor]] = []

            def attend(q, k_new, v_new, _zero, _mask):
                layer = len(presents)
                presents.append((k_new, v_new))
                kc, vc = key_caches[layer], value_caches[layer]
                if attention == "native":  # keys = [cache rows ; step rows], no past/present (see docstring)
                    keys = torch.cat([kc, k_new.transpose(0, 1)], 1)[None]
                    values = torch.cat([vc, v_new.transpose(0, 1)], 1)[None]
                    y = torch.onnx.ops.attention(q.transpose(0, 1)[None], keys, values, full_mask, scale=scale)[0]
                    return y[0].transpose(0, 1)
                if torch.onnx.is_in_onnx_export():
                    return torch.onnx.ops.symbolic(
                        f"{reference.OP_DOMAIN}::{reference.OP_NAME}",
                        [q, k_new, v_new, kc, vc, cache_len, step_config], attrs,
                        dtype=q.dtype, shape=q.shape, version=reference.OP_VERSION,
                    )
                return reference.lookahead_attention(q, k_new, v_new, kc, vc, cache_len, step_config, scale=scale)

            zero = torch.zeros((), dtype=torch.long)
            placeholder = torch.ones(1, 1, dtype=torch.bool)
            logits = model(input_ids, positions, scratch_k, scratch_v, zero, placeholder, output_slots.long(),
                           attention=attend)
            keys = torch.stack([k for k, _ in presents]).transpose(1, 2)  # [L, Hkv, T, D]
            values = torch.stack([v for _, v in presents]).transpose(1, 2)
            return logits.argmax(-1).to(torch.int32), logits.float(), keys, values

    return StepGraph().eval()


def example_inputs(model, tokens: int, cache_rows: int) -> tuple:
    """Arguments of the graph module: `tokens` step tokens against an empty cache of `cache_rows` rows."""
    import torch

    cfg = model.cfg
    cache = [torch.zeros(cfg.num_kv_heads, cache_rows, cfg.head_dim, dtype=model.dtype)
             for _ in range(2 * cfg.num_layers)]
    return (torch.zeros(tokens, dtype=torch.int32), torch.arange(tokens, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
            torch.arange(tokens, dtype=torch.int32), cache)


def export_graph(model, attention: str, cache_rows: int, max_tokens: int):
    """Export the network with a dynamic token count 1..max_tokens (the prefill graph). -> onnx.ModelProto.

    Dimension names: `tokens` (input_ids, positions, the present K/V) and `rows` (output_slots and the
    outputs read from them).
    """
    import torch

    module = _graph_module(model, attention)
    args = example_inputs(model, min(8, max(2, max_tokens)), cache_rows)
    names = [*INPUTS, *cache_names(model.cfg.num_layers)]
    tokens = torch.export.Dim("tokens", min=1, max=max_tokens)
    rows = torch.export.Dim("rows", min=1, max=max_tokens)
    dynamic = ({0: tokens}, {0: tokens}, None, None, {0: rows}, [None] * (2 * model.cfg.num_layers))
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, args, input_names=names, output_names=list(OUTPUTS), dynamo=True, opset_version=OPSET,
            dynamic_shapes=dynamic, optimize=True, verbose=False,
        )
    assert program is not None  # dynamo=True always returns the program
    proto = program.model_proto
    _strip_metadata(proto)
    graph = proto.graph
    inputs = {i.name: i for i in graph.input}
    _rename_dims(proto, {_dim(inputs["input_ids"], 0).dim_param: "tokens",
                         _dim(inputs["output_slots"], 0).dim_param: "rows"})
    if attention == "plugin":
        del proto.opset_import[:]
        proto.opset_import.extend(onnx_op.opset_imports(OPSET))
    return proto


def fix_tokens(proto, tokens: int):
    """A copy of the dynamic graph with the token count pinned to `tokens` (the step graph)."""
    import onnx

    fixed = onnx.ModelProto()
    fixed.CopyFrom(proto)
    for value in [*fixed.graph.input, *fixed.graph.output, *fixed.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == "tokens":
                dim.dim_value = tokens
    return fixed


def _dim(value, index: int):
    return value.type.tensor_type.shape.dim[index]


def _rename_dims(proto, names: dict[str, str]) -> None:
    for value in [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in names:
                dim.dim_param = names[dim.dim_param]


def _strip_metadata(proto) -> None:
    """Drop the exporter's per-node stack traces and class paths (they name this machine's files)."""
    for node in proto.graph.node:
        del node.metadata_props[:]
    del proto.metadata_props[:]


def save_graphs(graphs: dict[str, Any], out_dir: Path, weights_file: str = WEIGHTS_FILE) -> None:
    """Save each named graph beside one shared external-data file (equal initializers stored once)."""
    import onnx
    from onnx.external_data_helper import set_external_data

    stored: dict[tuple[str, bytes], tuple[int, int]] = {}
    with open(out_dir / weights_file, "wb") as data:
        for filename, proto in graphs.items():
            for tensor in proto.graph.initializer:
                raw = tensor.raw_data or onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor)).raw_data
                if len(raw) < _INLINE_BYTES:
                    continue
                key = (tensor.name, hashlib.sha256(raw).digest())
                if key not in stored:
                    offset = data.tell()
                    data.write(raw)
                    data.write(b"\0" * (-data.tell() % 64))  # keep every tensor 64-byte aligned
                    stored[key] = (offset, len(raw))
                offset, length = stored[key]
                set_external_data(tensor, location=weights_file, offset=offset, length=length)
                tensor.ClearField("raw_data")
                for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                    tensor.ClearField(field)
                tensor.data_location = onnx.TensorProto.EXTERNAL
            onnx.save_model(proto, str(out_dir / filename))
