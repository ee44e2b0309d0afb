"""The ONNX form of LookaheadAttention, and its standard-op decomposition for onnxruntime.

Node contract (what TensorRT's ONNX parser maps to the plugin, see tensorrt_plugin.py):

    op_type  "LookaheadAttention"         domain "trt_lookahead" (opset_import trt_lookahead 1)
    inputs   query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, D],
             key_cache [Hkv, S, D], value_cache [Hkv, S, D],      (float32 | float16 | bfloat16)
             cache_len [1] int32, step_config [3] int32 = (W, N, G), W = 0: causal
    output   [T, Hq, D], the dtype of query
    attrs    num_q_heads, num_kv_heads, head_dim (INT), scale (FLOAT),
             plugin_namespace = "trt_lookahead", plugin_version = "1" (STRING), aot = 1 (INT)

The parser looks a creator up by op_type, plugin_version and plugin_namespace, forwards the
attributes the plugin declares (num_q_heads, num_kv_heads, head_dim, scale) and picks the AOT
implementation because of aot = 1; the node's domain does not matter to it.

onnxruntime has no kernel for the node, so `decompose` rewrites each one into standard ops: the
cached prefix is sliced to cache_len rows (no work on the empty rest of the cache), the step mask is
the closed form `mask.step_visible` evaluated by ONNX ops (built once per graph), and grouped query
heads share their KV head without repeating K/V. See docs/design.md section 6.4.
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


def _step_bias(g: _Graph, query: str, cache_len: str, step_config: str) -> tuple[str, str, str]:
    """(bias [T, T] float32 with 0 / -inf, T as [1] int64, cache_len as [1] int64), built once per graph."""
    tokens = g.op("Shape", query, start=0, end=1)
    n = g.op("Squeeze", tokens)
    idx = g.op("Range", g.const(0), n, g.const(1))
    rows = Sym(g, g.op("Unsqueeze", idx, g.const([1])))
    cols = Sym(g, g.op("Unsqueeze", idx, g.const([0])))
    cfg = g.op("Cast", step_config, to=TensorProto.INT64)
    window, ngram, verify = (Sym(g, g.op("Gather", cfg, g.const(k))) for k in range(3))
    mask = step_visible(rows, cols, window, ngram, verify)
    bias = g.op("Where", mask.name, g.const(0.0, np.float32), g.const(-np.inf, np.float32))
    length = g.op("Cast", cache_len, to=TensorProto.INT64)
    return bias, tokens, length


def _decompose_node(g: _Graph, node: onnx.NodeProto, bias: str, tokens: str, length: str) -> None:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    hq, hkv, d, scale = attrs["num_q_heads"], attrs["num_kv_heads"], attrs["head_dim"], attrs["scale"]
    group = hq // hkv
    q, k, v, kc, vc = node.input[:5]
    # query heads grouped by KV head: [T, Hq, D] -> [Hkv, g*T, D] (rows ordered g-major, then T)
    qs = g.op("Mul", q, g.op("CastLike", g.const(scale, np.float32), q))
    q4 = g.op("Transpose", g.op("Reshape", qs, g.const([0, hkv, group, d])), perm=[1, 2, 0, 3])
    qg = g.op("Reshape", q4, g.const([hkv, -1, d]))
    k_new = g.op("Transpose", k, perm=[1, 2, 0])  # [Hkv, D, T]
    v_new = g.op("Transpose", v, perm=[1, 0, 2])  # [Hkv, T, D]
    zero, axis1 = g.const([0]), g.const([1])
    k_old = g.op("Transpose", g.op("Slice", kc, zero, length, axis1), perm=[0, 2, 1])  # [Hkv, D, P]
    v_old = g.op("Slice", vc, zero, length, axis1)  # [Hkv, P, D]
    s_old = g.op("MatMul", qg, k_old)  # [Hkv, gT, P]
    step_bias = g.op("CastLike", g.op("Tile", bias, g.const([group, 1])), q)  # [gT, T]
    s_new = g.op("Add", g.op("MatMul", qg, k_new), step_bias)  # [Hkv, gT, T]
    probs = g.op("Softmax", g.op("Concat", s_old, s_new, axis=2), axis=2)
    p_old = g.op("Slice", probs, zero, length, g.const([2]))
    p_new = g.op("Slice", probs, length, g.op("Add", length, tokens), g.const([2]))
    o = g.op("Add", g.op("MatMul", p_old, v_old), g.op("MatMul", p_new, v_new))  # [Hkv, gT, D]
    o = g.op("Transpose", g.op("Reshape", o, g.const([hkv, group, -1, d])), perm=[2, 0, 1, 3])
    g.nodes.append(helper.make_node("Reshape", [o, g.const([0, hq, d])], [node.output[0]], name=g.fresh()))


def decompose(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose LookaheadAttention nodes are standard ops (for onnxruntime)."""
    nodes = attention_nodes(model)
    if not nodes:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = _Graph("lookahead_attention")
    first = nodes[0]
    bias, tokens, length = _step_bias(g, first.input[0], first.input[5], first.input[6])
    rewritten: list[onnx.NodeProto] = []
    for node in out.graph.node:
        if node.op_type == OP_NAME and node.domain == OP_DOMAIN:
            if node.input[5:7] != first.input[5:7]:
                raise ValueError("LookaheadAttention nodes of one graph must share cache_len and step_config")
            _decompose_node(g, node, bias, tokens, length)
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
