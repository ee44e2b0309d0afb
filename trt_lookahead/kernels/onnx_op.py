"""The ONNX form of LookaheadAttention, and its standard-op decomposition for onnxruntime.

Node contract (what TensorRT's ONNX parser maps to the plugin, see tensorrt_plugin.py):

    op_type  "LookaheadAttention"         domain "trt_lookahead" (opset_import trt_lookahead 1)
    inputs   query [B, T, Hq, D], key [B, T, Hkv, D], value [B, T, Hkv, D],
             key_cache [B, Hkv, S, D], value_cache [B, Hkv, S, D],   (float32 | float16 | bfloat16)
             cache_len [B] int32, step_config [B, 3] int32 = (W, N, G) per row, W = 0: causal
    output   [B, T, Hq, D], the dtype of query
    attrs    num_q_heads, num_kv_heads, head_dim (INT), scale (FLOAT),
             plugin_namespace = "trt_lookahead", plugin_version = "1" (STRING), aot = 1 (INT)

The parser looks a creator up by op_type, plugin_version and plugin_namespace, forwards the
attributes the plugin declares (num_q_heads, num_kv_heads, head_dim, scale) and picks the AOT
implementation because of aot = 1; the node's domain does not matter to it.

onnxruntime has no kernel for the node, so `decompose` rewrites each one into standard ops. Built once
per graph: each row's step mask, the closed form `mask.step_visible` of its (W, N, G) evaluated by ONNX
ops ([B, T, T]), and each row's prefix mask (cache column c < cache_len[b]). Per layer the caches are
sliced to the batch's longest prefix, max(cache_len) rows (never the whole cache, and never copied
beyond that), so a shorter row's extra columns are masked; grouped query heads share their KV head
without repeating K/V. See docs/design.md section 6.4.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from trt_lookahead.kernels.mask import step_visible
from trt_lookahead.kernels.reference import OP_DOMAIN, OP_NAME, OP_VERSION

PLUGIN_VERSION = "1"


def node_attributes(num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> dict:
    """Attributes of a LookaheadAttention node (what the plugin receives, plus the parser's routing)."""
    return {
        "num_q_heads": int(num_q_heads),
        "num_kv_heads": int(num_kv_heads),
        "head_dim": int(head_dim),
        "scale": float(scale),
        "plugin_namespace": OP_DOMAIN,
        "plugin_version": PLUGIN_VERSION,
        "aot": 1,
    }


def make_node(inputs: list[str], output: str, name: str, **attributes) -> onnx.NodeProto:
    return helper.make_node(OP_NAME, inputs, [output], name=name, domain=OP_DOMAIN,
                            **node_attributes(**attributes))


def attention_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == OP_NAME and n.domain == OP_DOMAIN]


class _Graph:
    """Appends standard ONNX nodes with fresh names; `Sym` values let `visible` run on them."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def fresh(self) -> str:
        self._count += 1
        return f"{self.prefix}/{self._count}"

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        out = self.fresh()
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def const(self, value, dtype=np.int64) -> str:
        name = self.fresh()
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name


class Sym:
    """An int64 or bool ONNX value with numpy-style operators (enough for `mask.step_visible`).

    Arithmetic casts bool operands to int64, as numpy does; comparisons and &, |, ~ give bool values.
    """

    def __init__(self, graph: _Graph, name: str, is_bool: bool = False) -> None:
        self.g, self.name, self.is_bool = graph, name, is_bool

    def _operand(self, value, numeric: bool) -> str:
        if not isinstance(value, Sym):
            return self.g.const(value)
        if numeric and value.is_bool:
            return self.g.op("Cast", value.name, to=TensorProto.INT64)
        return value.name

    def _bin(self, op: str, other, swap: bool = False, numeric: bool = True, is_bool: bool = False) -> Sym:
        a, b = self._operand(self, numeric), self._operand(other, numeric)
        return Sym(self.g, self.g.op(op, *((b, a) if swap else (a, b))), is_bool)

    def _cmp(self, op: str, other) -> Sym:
        return self._bin(op, other, is_bool=True)

    def _logic(self, op: str, other) -> Sym:
        return self._bin(op, other, numeric=False, is_bool=True)

    def __add__(self, o): return self._bin("Add", o)
    def __radd__(self, o): return self._bin("Add", o, swap=True)
    def __sub__(self, o): return self._bin("Sub", o)
    def __rsub__(self, o): return self._bin("Sub", o, swap=True)
    def __mul__(self, o): return self._bin("Mul", o)
    def __rmul__(self, o): return self._bin("Mul", o, swap=True)
    def __floordiv__(self, o): return self._bin("Div", o)  # truncates; `visible` only divides values >= 0
    def __mod__(self, o): return self._bin("Mod", o)
    def __lt__(self, o): return self._cmp("Less", o)
    def __le__(self, o): return self._cmp("LessOrEqual", o)
    def __ge__(self, o): return self._cmp("GreaterOrEqual", o)
    def __eq__(self, o): return self._cmp("Equal", o)
    def __and__(self, o): return self._logic("And", o)
    def __or__(self, o): return self._logic("Or", o)
    def __invert__(self): return Sym(self.g, self.g.op("Not", self.name), is_bool=True)

    __hash__ = None  # type: ignore[assignment]  # __eq__ builds a node


class _Masks:
    """The per-graph values every layer's decomposition shares: the rows' step and prefix masks as additive
    biases, T and the longest prefix. Built once, ahead of the first layer; tiled per query-head group."""

    def __init__(self, g: _Graph, query: str, cache_len: str, step_config: str) -> None:
        self.g = g
        self.tokens = g.op("Shape", query, start=1, end=2)  # [1] int64
        idx = g.op("Range", g.const(0), g.op("Squeeze", self.tokens), g.const(1))
        rows = Sym(g, g.op("Unsqueeze", idx, g.const([0, 2])))  # [1, T, 1]
        cols = Sym(g, g.op("Unsqueeze", idx, g.const([0, 1])))  # [1, 1, T]
        cfg = g.op("Cast", step_config, to=TensorProto.INT64)
        window, ngram, verify = (Sym(g, g.op("Unsqueeze", g.op("Gather", cfg, g.const(k), axis=1), g.const([1, 2])))
                                 for k in range(3))  # [B, 1, 1] each
        step = step_visible(rows, cols, window, ngram, verify)  # [B, T, T]
        self.step_bias = self._bias(step.name, [1])  # [B, 1, T, T]
        length = g.op("Cast", cache_len, to=TensorProto.INT64)  # [B]
        self.longest = g.op("ReduceMax", length, keepdims=1)  # [1]
        prefix_idx = g.op("Range", g.const(0), g.op("Squeeze", self.longest), g.const(1))
        prefix = g.op("Less", g.op("Unsqueeze", prefix_idx, g.const([0])), g.op("Unsqueeze", length, g.const([1])))
        self.prefix_bias = self._bias(prefix, [1, 2])  # [B, 1, 1, P]
        self._tiled: dict[int, str] = {}

    def _bias(self, visible: str, axes: list[int]) -> str:
        """0 where visible, -inf elsewhere (float32), with `axes` inserted."""
        g = self.g
        bias = g.op("Where", visible, g.const(0.0, np.float32), g.const(-np.inf, np.float32))
        return g.op("Unsqueeze", bias, g.const(axes))

    def step_bias_for(self, group: int) -> str:
        """[B, 1, group*T, T]: the step bias repeated for the query heads of one KV head (rows g-major)."""
        if group not in self._tiled:
            self._tiled[group] = self.g.op("Tile", self.step_bias, self.g.const([1, 1, group, 1]))
        return self._tiled[group]


def _decompose_node(g: _Graph, node: onnx.NodeProto, masks: _Masks) -> None:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    hq, hkv, d, scale = attrs["num_q_heads"], attrs["num_kv_heads"], attrs["head_dim"], attrs["scale"]
    group = hq // hkv
    q, k, v, kc, vc = node.input[:5]
    tokens, longest = masks.tokens, masks.longest
    # query heads grouped by KV head: [B, T, Hq, D] -> [B, Hkv, g*T, D] (rows ordered g-major, then T)
    qs = g.op("Mul", q, g.op("CastLike", g.const(scale, np.float32), q))
    q5 = g.op("Transpose", g.op("Reshape", qs, g.const([0, 0, hkv, group, d])), perm=[0, 2, 3, 1, 4])
    qg = g.op("Reshape", q5, g.const([0, hkv, -1, d]))
    k_new = g.op("Transpose", k, perm=[0, 2, 3, 1])  # [B, Hkv, D, T]
    v_new = g.op("Transpose", v, perm=[0, 2, 1, 3])  # [B, Hkv, T, D]
    zero, axis2, axis3 = g.const([0]), g.const([2]), g.const([3])
    k_old = g.op("Transpose", g.op("Slice", kc, zero, longest, axis2), perm=[0, 1, 3, 2])  # [B, Hkv, D, P]
    v_old = g.op("Slice", vc, zero, longest, axis2)  # [B, Hkv, P, D]
    s_new = g.op("Add", g.op("MatMul", qg, k_new), g.op("CastLike", masks.step_bias_for(group), q))  # [B, Hkv, gT, T]
    s_old = g.op("Add", g.op("MatMul", qg, k_old), g.op("CastLike", masks.prefix_bias, q))  # [B, Hkv, gT, P]
    # Step columns first: a row's real scores sit at the same columns whatever the batch's longest prefix,
    # and the masked columns of a shorter prefix trail (exp = 0), so onnxruntime's softmax and MatMul give
    # a row the same bits alone or batched (tests/backends check it on real engines).
    probs = g.op("Softmax", g.op("Concat", s_new, s_old, axis=3), axis=3)
    p_new = g.op("Slice", probs, zero, tokens, axis3)
    p_old = g.op("Slice", probs, tokens, g.op("Add", tokens, longest), axis3)
    o = g.op("Add", g.op("MatMul", p_new, v_new), g.op("MatMul", p_old, v_old))  # [B, Hkv, gT, D]
    o = g.op("Transpose", g.op("Reshape", o, g.const([0, hkv, group, -1, d])), perm=[0, 3, 1, 2, 4])
    g.nodes.append(helper.make_node("Reshape", [o, g.const([0, 0, hq, d])], [node.output[0]], name=g.fresh()))


def decompose(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose LookaheadAttention nodes are standard ops (for onnxruntime)."""
    nodes = attention_nodes(model)
    if not nodes:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = _Graph("lookahead_attention")
    first = nodes[0]
    masks = _Masks(g, first.input[0], first.input[5], first.input[6])
    rewritten: list[onnx.NodeProto] = []
    for node in out.graph.node:
        if node.op_type == OP_NAME and node.domain == OP_DOMAIN:
            if node.input[5:7] != first.input[5:7]:
                raise ValueError("LookaheadAttention nodes of one graph must share cache_len and step_config")
            _decompose_node(g, node, masks)
            rewritten.extend(g.nodes)  # the shared mask nodes come first, ahead of the first layer
            g.nodes = []
        else:
            rewritten.append(node)
    del out.graph.node[:]
    out.graph.node.extend(rewritten)
    out.graph.initializer.extend(g.initializers)
    keep = [o for o in out.opset_import if o.domain != OP_DOMAIN]
    del out.opset_import[:]
    out.opset_import.extend(keep)
    return out


def opset_imports(default_opset: int) -> list[onnx.OperatorSetIdProto]:
    return [helper.make_opsetid("", default_opset), helper.make_opsetid(OP_DOMAIN, OP_VERSION)]
