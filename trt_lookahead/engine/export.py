"""ONNX export of an engine's graph: the shared `Llama` over a batch of rows against read-only per-layer caches.

One graph with a dynamic batch B and token count T serves every step, every mix of rows (lookahead, greedy,
causal) and every prefill chunk. The model itself is single-sequence: the wrapper flattens the [B, T] rows
into B*T tokens (embedding, RoPE at each token's own position, linear layers and norms are per token), and
only attention, through the model's seam, sees the rows again. The caches are read-only inputs: row b
attends over its rows 0..cache_len[b]-1 plus its own T tokens and the graph returns the step's K/V; the
executor commits the accepted rows (no in-graph copy of the whole cache). Attention is the
LookaheadAttention node (--attention plugin, kernels/onnx_op.py) or the standard ONNX Attention-23 op
(--attention native) over keys [cache rows ; step rows] with a boolean [B, 1, T, S+T] mask computed in the
graph from cache_len and step_config. The native form passes no past_key / past_value: onnxruntime's CPU
kernel refuses past_key without a present_key output, and the present (a copy of the whole cache) is not
wanted; the concatenation costs the same copy. See docs/design.md sections 6.3 and 6.4.

The graph's weights are not copied into it: `export_graph` returns the graph with every larger initializer
held (engine/initializers.py) and `Weights`, those initializers' arrays, views of the model's own tensors, which
`save_graph` writes to the weights file one at a time: a build holds the model once, not twice. A model whose
projections are not read yet (model/checkpoint.py `load_llama_deferred`: fake tensors, no data) exports the same
graph, their `Weights` entries the functions that read them.

    proto, weights = export_graph(model, "plugin", cache_rows=1040, max_tokens=64)
    save_graph(proto, Path("engine/model.onnx"), weights)
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, cast

from trt_lookahead.engine.format import INPUTS, OUTPUTS, cache_names
from trt_lookahead.engine.initializers import HELD, INLINE_BYTES, Weights
from trt_lookahead.kernels import mask, onnx_op, reference
from trt_lookahead.lookahead.tree import TreeTemplate

OPSET = 23
GRAPH_REVISION = 2  # in the build key, so cached engines are rebuilt: 2 = no scratch-cache ScatterND per layer


def plugin_contract() -> dict[str, Any]:
    """What config.json records of the LookaheadAttention node (and TensorRT looks the plugin up by)."""
    return {"op_type": reference.OP_NAME, "domain": reference.OP_DOMAIN, "version": reference.OP_VERSION,
            "plugin_namespace": reference.OP_DOMAIN, "plugin_version": onnx_op.PLUGIN_VERSION, "aot": 1}


def _graph_module(model, attention: str, tree: TreeTemplate | None = None, max_tokens: int = 1):
    """The export wrapper: one forward of the shared `Llama` over B*T flattened tokens, attention per row.

    It drives the model through its public forward and attention seam without a cache of the model's own
    (k_cache = v_cache = None): the seam hands the attention function the step's own K/V [B*T, Hkv, D], and
    the function pairs them, row by row, with that layer's real cache (graph inputs). (A scratch cache
    written there would export as a ScatterND of every step row per layer, K and V.)
    `tree`: the verification slots' draft tree, its table (over max_tokens) the nodes' tree_ends input.
    """
    import torch

    cfg = model.cfg
    layers, heads, kv_heads, head_dim = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    scale = reference.default_scale(head_dim)
    attrs = onnx_op.node_attributes(heads, kv_heads, head_dim, scale, tree=tree is not None)
    tree_ends = None if tree is None else tree.table

    def native_mask(tokens, cache_rows, cache_len, step_config):
        """[B, 1, T, S+T] bool: row b sees its cache rows < cache_len[b] and its step rows by its config."""
        idx = torch.arange(tokens)
        window, ngram, verify = step_config.long()[:, :, None, None].unbind(1)  # [B, 1, 1] each
        step = mask.step_visible(idx[None, :, None], idx[None, None, :], window, ngram, verify)  # [B, T, T]
        prefix = torch.arange(cache_rows)[None, :] < cache_len.long()[:, None]  # [B, S]
        return torch.cat([prefix[:, None, :].expand(-1, tokens, -1), step], 2)[:, None]

    class StepGraph(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            # the nodes' tree_ends input (a linear graph's is a dummy): a buffer, so one initializer
            self.register_buffer("tree_ends", torch.from_numpy(onnx_op.tree_ends_input(tree_ends, max_tokens)))

        def forward(self, input_ids, positions, cache_len, step_config, output_slots, caches):
            batch, tokens = input_ids.shape
            key_caches, value_caches = caches[:layers], caches[layers:]
            if attention == "native":
                full_mask = native_mask(tokens, key_caches[0].shape[2], cache_len, step_config)
            presents: list[tuple[torch.Tensor, torch.Tensor]] = []

            def attend(q, k_new, v_new, _zero, _mask):
                layer = len(presents)
                q = q.reshape(batch, tokens, heads, head_dim)
                k_new = k_new.reshape(batch, tokens, kv_heads, head_dim)
                v_new = v_new.reshape(batch, tokens, kv_heads, head_dim)
                presents.append((k_new, v_new))
                kc, vc = key_caches[layer], value_caches[layer]
                if attention == "native":  # keys = [cache rows ; step rows], no past/present (see docstring)
                    keys = torch.cat([kc, k_new.transpose(1, 2)], 2)
                    values = torch.cat([vc, v_new.transpose(1, 2)], 2)
                    y = torch.onnx.ops.attention(q.transpose(1, 2), keys, values, full_mask, scale=scale)[0]
                    y = y.transpose(1, 2)
                elif torch.onnx.is_in_onnx_export():
                    y = torch.onnx.ops.symbolic(
                        f"{reference.OP_DOMAIN}::{reference.OP_NAME}",
                        [q, k_new, v_new, kc, vc, cache_len, step_config, cast(torch.Tensor, self.tree_ends)], attrs,
                        dtype=q.dtype, shape=q.shape, version=reference.OP_VERSION,
                    )
                else:
                    y = reference.lookahead_attention(q, k_new, v_new, kc, vc, cache_len, step_config, scale=scale,
                                                      tree_ends=tree_ends)
                return y.reshape(batch * tokens, heads, head_dim)

            zero = torch.zeros((), dtype=torch.long)
            placeholder = torch.ones(1, 1, dtype=torch.bool)
            flat_slots = (torch.arange(batch)[:, None] * tokens + output_slots.long()).reshape(-1)  # [B*K]
            logits = model(input_ids.reshape(-1).long(), positions.reshape(-1).long(), None, None, zero,
                           placeholder, flat_slots, attention=attend)
            logits = logits.reshape(batch, output_slots.shape[1], -1)  # [B, K, V]
            keys = torch.stack([k for k, _ in presents]).permute(0, 1, 3, 2, 4)  # [L, B, Hkv, T, D]
            values = torch.stack([v for _, v in presents]).permute(0, 1, 3, 2, 4)
            return logits.argmax(-1).to(torch.int32), logits.float(), keys, values

    return StepGraph().eval()


def example_inputs(model, batch: int, tokens: int, cache_rows: int) -> tuple:
    """Arguments of the graph module: `batch` rows of `tokens` step tokens against empty caches of `cache_rows`."""
    import torch

    cfg = model.cfg
    cache = [torch.zeros(batch, cfg.num_kv_heads, cache_rows, cfg.head_dim, dtype=model.dtype)
             for _ in range(2 * cfg.num_layers)]
    return (torch.zeros(batch, tokens, dtype=torch.int32), torch.arange(tokens, dtype=torch.int32).repeat(batch, 1),
            torch.zeros(batch, dtype=torch.int32), torch.zeros(batch, 3, dtype=torch.int32),
            torch.arange(tokens, dtype=torch.int32).repeat(batch, 1), cache)


def export_graph(model, attention: str, cache_rows: int, max_tokens: int, tree: TreeTemplate | None = None,
                 deferred: Mapping[str, Callable[[], Any]] | None = None) -> tuple[Any, Weights]:
    """Export the network with a dynamic batch, token count 1..max_tokens and cache length.
    -> (onnx.ModelProto, the data of its held initializers: views of the model's tensors, see the module docstring).

    `deferred`: {a parameter's name: the function reading its float32 tensor} for the model's fake (unread) weights
    (`load_llama_deferred`'s); each one's held data is that function.

    `tree`: the verification slots' draft tree (--attention plugin only): its table over max_tokens (each
    node's preorder index and subtree end) is the LookaheadAttention nodes' tree_ends initializer, and the
    nodes say tree = 1.

    Dimension names: `batch` (every row-indexed input and output), `tokens` (input_ids, positions, the
    present K/V), `rows` (output_slots and the outputs read from them) and `cache_rows` (the caches' S, at
    most `cache_rows`: an executor opened for a shorter max_seq_len keeps shorter caches).
    """
    import onnx_ir as ir
    import torch

    module = _graph_module(model, attention, tree, max_tokens)
    args = example_inputs(model, 2, min(8, max(2, max_tokens)), cache_rows)
    names = [*INPUTS, *cache_names(model.cfg.num_layers)]
    batch = torch.export.Dim("batch", min=1)
    tokens = torch.export.Dim("tokens", min=1, max=max(2, max_tokens))
    rows = torch.export.Dim("rows", min=1, max=max(2, max_tokens))
    cache = torch.export.Dim("cache_rows", min=2, max=max(3, cache_rows))
    dynamic = ({0: batch, 1: tokens}, {0: batch, 1: tokens}, {0: batch}, {0: batch}, {0: batch, 1: rows},
               [{0: batch, 2: cache}] * (2 * model.cfg.num_layers))
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, args, input_names=names, output_names=list(OUTPUTS), dynamo=True, opset_version=OPSET,
            dynamic_shapes=dynamic, optimize=True, verbose=False,
        )
    assert program is not None  # dynamo=True always returns the program
    weights: Weights = {}
    for name, value in program.model.graph.initializers.items():  # the larger ones held, not serialized
        tensor = value.const_value
        read = (deferred or {}).get(name.removeprefix("model."))  # the graph module holds the model as `model`
        if read is not None:
            weights[name] = partial(_numpy, read)
        elif tensor is not None and tensor.nbytes >= INLINE_BYTES:
            weights[name] = tensor.numpy()  # a view of the model's parameter
        else:
            continue
        assert tensor is not None  # a parameter's initializer has its value
        shape = ir.Shape(tensor.shape.numpy())
        value.const_value = ir.ExternalTensor(HELD, None, None, tensor.dtype, shape=shape, name=name)
    proto = ir.serde.serialize_model(program.model)
    _strip_metadata(proto)
    inputs = {i.name: i for i in proto.graph.input}
    _rename_dims(proto, {_dim(inputs["input_ids"], 0).dim_param: "batch",
                         _dim(inputs["input_ids"], 1).dim_param: "tokens",
                         _dim(inputs["output_slots"], 1).dim_param: "rows",
                         _dim(inputs[cache_names(1)[0]], 2).dim_param: "cache_rows"})
    if attention == "plugin":
        del proto.opset_import[:]
        proto.opset_import.extend(onnx_op.opset_imports(OPSET))
    return proto, weights


def _numpy(read: Callable[[], Any]) -> Any:
    return read().numpy()


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
