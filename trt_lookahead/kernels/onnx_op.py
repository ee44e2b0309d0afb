"""The ONNX form of LookaheadAttention, and its standard-op decomposition for onnxruntime.

Node contract (what TensorRT's ONNX parser maps to the plugin, see tensorrt_plugin.py):

    op_type  "LookaheadAttention"         domain "trt_lookahead" (opset_import trt_lookahead 1)
    inputs   query [B, T, Hq, D], key [B, T, Hkv, D], value [B, T, Hkv, D],
             key_cache [B, Hkv, S, D], value_cache [B, Hkv, S, D],   (float32 | float16 | bfloat16)
             cache_len [B] int32, step_config [B, 3] int32 = (W, N, G) per row, W = 0: causal,
             tree_ends [2E] int32: with tree = 1 the draft tree's table, each node's (preorder index, subtree
             end), padded to the graph's most tokens (`mask.tree_ends`, E >= every T the graph runs), else a
             [1] dummy never read; a graph initializer either way
    output   [B, T, Hq, D], the dtype of query
    attrs    num_q_heads, num_kv_heads, head_dim (INT), scale (FLOAT), tree (INT: 1 = tree_ends is a draft
             tree's table, 0 = G linear candidates), plugin_namespace = "trt_lookahead",
             plugin_version = "1" (STRING), aot = 1 (INT)

The parser looks a creator up by op_type, plugin_version and plugin_namespace, forwards the
attributes the plugin declares (num_q_heads, num_kv_heads, head_dim, scale, tree) and picks the AOT
implementation because of aot = 1; the node's domain does not matter to it.

onnxruntime has no kernel for the node, so `decompose` rewrites each one into standard ops, or with native=True
into one MaskedAttention node of onnxruntime_attention.c (float32) that takes the step mask below. Built once
per graph: each row's step mask, the closed form `mask.step_visible` of its (W, N, G) evaluated by ONNX
ops ([B, T, T]; `mask.tree_step_visible` over the node's tree_ends with tree = 1), and each row's
prefix mask (cache column c < cache_len[b]). Per layer the caches are
sliced to the batch's longest prefix, max(cache_len) rows (never the whole cache, and never copied
beyond that), so a shorter row's extra columns are masked; grouped query heads share their KV head
without repeating K/V. See docs/design.md section 6.4.

`decompose(exact=True)` (engines built with --exact) gives the row-invariant form instead: a token's
result depends only on its own query and the keys it sees at their positions (docs/design.md section
4.2). Row b's keys are cut into blocks of KEY_BLOCK positions, the same blocks for every row of the step:
block t is one score product and one value product over its KEY_BLOCK cached columns followed by the T step
columns, a step key in the block of its position (a ones column appended to V gives the softmax denominator).
Masked keys are exact zeros, the row maximum is exact, and the blocks are added in position order by one
product with a ones row (zeros neutral at any length). onnxruntime's MatMul reduces K <= 2 * KEY_BLOCK in
order with zeros neutral, so a block holding a chain's step keys after its cached columns gives a query the
bits of the same keys stored in the cache (scripts/onnxruntime_attention_ops.py). Hence at most EXACT_MAX_TOKENS
tokens per row, and no product of one row or one column (those take another path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from trt_lookahead.kernels.mask import step_visible, tree_ends, tree_step_visible
from trt_lookahead.kernels.reference import KEY_BLOCK, OP_DOMAIN, OP_NAME, OP_VERSION

PLUGIN_VERSION = "1"
EXACT_MAX_TOKENS = KEY_BLOCK  # tokens per row of an exact graph: its step keys span two key blocks
# the node onnxruntime_attention.c registers (its op name and domain there, written once more in C)
NATIVE_OP = "MaskedAttention"
NATIVE_DOMAIN = "trt_lookahead.cpu"


def node_attributes(num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float, tree: bool = False) -> dict:
    """Attributes of a LookaheadAttention node (what the plugin receives, plus the parser's routing)."""
    return {
        "num_q_heads": int(num_q_heads),
        "num_kv_heads": int(num_kv_heads),
        "head_dim": int(head_dim),
        "scale": float(scale),
        "tree": int(bool(tree)),
        "plugin_namespace": OP_DOMAIN,
        "plugin_version": PLUGIN_VERSION,
        "aot": 1,
    }


def make_node(inputs: list[str], output: str, name: str, **attributes) -> onnx.NodeProto:
    return helper.make_node(OP_NAME, inputs, [output], name=name, domain=OP_DOMAIN,
                            **node_attributes(**attributes))


def attention_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == OP_NAME and n.domain == OP_DOMAIN]


def tree_ends_input(table: np.ndarray | None, tokens: int) -> np.ndarray:
    """The tree_ends input of a graph running up to `tokens` tokens per row: int32 [2 tokens] of a template's
    table (TreeTemplate.table), or the [1] dummy of G linear candidates (table None)."""
    return np.zeros(1, np.int32) if table is None else tree_ends(table, tokens).astype(np.int32)


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


class Graph:
    """Appends standard ONNX nodes and int64 constants with fresh names under `prefix` (the decompositions here and
    onnx_stack's rewrite); `Sym` values let `visible` run on them."""

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

    def __init__(self, graph: Graph, name: str, is_bool: bool = False) -> None:
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
    def __getitem__(self, index): return Sym(self.g, self.g.op("Gather", self.name, self._operand(index, True)))

    __hash__ = None  # type: ignore[assignment]  # __eq__ builds a node


def _bias(g: Graph, visible: str, axes: list[int]) -> str:
    """0 where visible, -inf elsewhere (float32), with `axes` inserted."""
    bias = g.op("Where", visible, g.const(0.0, np.float32), g.const(-np.inf, np.float32))
    return g.op("Unsqueeze", bias, g.const(axes)) if axes else bias


class _Masks:
    """The per-graph values every layer's decomposition shares: the rows' step and prefix masks as additive
    biases in the attention's dtype, T and the longest prefix. Built once, on the first layer's first use (and cast
    once, not per layer); tiled per query-head group."""

    def __init__(self, g: Graph, node: onnx.NodeProto, dtype: int) -> None:
        query, cache_len, step_config, ends = (node.input[k] for k in (0, 5, 6, 7))
        self.g, self.dtype = g, dtype
        self.tokens = g.op("Shape", query, start=1, end=2)  # [1] int64
        idx = g.op("Range", g.const(0), g.op("Squeeze", self.tokens), g.const(1))
        rows = Sym(g, g.op("Unsqueeze", idx, g.const([0, 2])))  # [1, T, 1]
        cols = Sym(g, g.op("Unsqueeze", idx, g.const([0, 1])))  # [1, 1, T]
        cfg = g.op("Cast", step_config, to=TensorProto.INT64)
        window, ngram, verify = (Sym(g, g.op("Unsqueeze", g.op("Gather", cfg, g.const(k), axis=1), g.const([1, 2])))
                                 for k in range(3))  # [B, 1, 1] each
        if _attributes(node)["tree"]:  # the draft tree's table, read per query and key slot (docs/design.md 2.7)
            table = Sym(g, g.op("Cast", ends, to=TensorProto.INT64))
            step = tree_step_visible(rows, cols, window, ngram, verify, table)  # [B, T, T]
        else:
            step = step_visible(rows, cols, window, ngram, verify)
        self.visible = step.name
        self.cache_len = cache_len
        self._tiled: dict[int, str] = {}

    @cached_property
    def step_bias(self) -> str:
        """[B, 1, T, T] the step mask as a bias."""
        return self.cast(_bias(self.g, self.visible, [1]))

    @cached_property
    def length(self) -> str:
        """[B] int64 cache_len."""
        return self.g.op("Cast", self.cache_len, to=TensorProto.INT64)

    @cached_property
    def longest(self) -> str:
        """[1] the batch's longest prefix."""
        return self.g.op("ReduceMax", self.length, keepdims=1)

    @cached_property
    def prefix_bias(self) -> str:
        """[B, 1, 1, P]: 0 at a row's cached columns, -inf past them."""
        g = self.g
        prefix_idx = g.op("Range", g.const(0), g.op("Squeeze", self.longest), g.const(1))
        prefix = g.op("Less", g.op("Unsqueeze", prefix_idx, g.const([0])), g.op("Unsqueeze", self.length, g.const([1])))
        return self.cast(_bias(g, prefix, [1, 2]))

    @cached_property
    def keys(self) -> str:
        """[1] T + P: the step and cache columns of a layer's scores (the fast decomposition's)."""
        return self.g.op("Add", self.tokens, self.longest)

    def cast(self, name: str) -> str:
        """A float32 value in the attention's dtype (no node where that is float32)."""
        return name if self.dtype == TensorProto.FLOAT else self.g.op("Cast", name, to=self.dtype)

    def bias_for(self, group: int) -> str:
        """[B, 1, group*T, T + P]: the step bias repeated for the query heads of one KV head (rows g-major), then
        the prefix bias: the bias of a layer's [step ; cache] scores, built once for every layer."""
        if group not in self._tiled:
            g = self.g
            step = g.op("Tile", self.step_bias, g.const([1, 1, group, 1]))  # [B, 1, gT, T]
            rows = g.op("Concat", g.const([1, 1]), g.op("Mul", self.tokens, g.const([group])), g.const([1]), axis=0)
            self._tiled[group] = g.op("Concat", step, g.op("Expand", self.prefix_bias, rows), axis=3)
        return self._tiled[group]


@dataclass(frozen=True)
class _Heads:
    """A LookaheadAttention node's grouped inputs: queries scaled, query heads grouped by KV head."""

    hq: int
    hkv: int
    group: int
    d: int
    qg: str  # [B, Hkv, g*T, D] (rows ordered g-major, then T)
    k_new: str  # [B, Hkv, D, T]
    v_new: str  # [B, Hkv, T, D]


def _heads(g: Graph, node: onnx.NodeProto, masks: _Masks) -> _Heads:
    attrs = _attributes(node)
    hq, hkv, d, scale = attrs["num_q_heads"], attrs["num_kv_heads"], attrs["head_dim"], attrs["scale"]
    group = hq // hkv
    q, k, v = node.input[:3]
    # query heads grouped by KV head: [B, T, Hq, D] -> [B, Hkv, g*T, D] (rows ordered g-major, then T)
    qs = g.op("Mul", q, masks.cast(g.const(scale, np.float32)))
    q5 = g.op("Transpose", g.op("Reshape", qs, g.const([0, 0, hkv, group, d])), perm=[0, 2, 3, 1, 4])
    qg = g.op("Reshape", q5, g.const([0, hkv, -1, d]))
    k_new = g.op("Transpose", k, perm=[0, 2, 3, 1])  # [B, Hkv, D, T]
    v_new = g.op("Transpose", v, perm=[0, 2, 1, 3])  # [B, Hkv, T, D]
    return _Heads(hq, hkv, group, d, qg, k_new, v_new)


def _write_output(g: Graph, node: onnx.NodeProto, heads: _Heads, o: str, into: tuple[str, str] | None) -> None:
    """o [B, Hkv, g*T, D] -> the node's output [B, T, Hq, D], or straight into `into` = (shape, output): the one
    Reshape that reads the node's output (`_reshape_after`), in place of it."""
    h = heads
    o = g.op("Transpose", g.op("Reshape", o, g.const([0, h.hkv, h.group, -1, h.d])), perm=[0, 3, 1, 2, 4])
    shape, output = into or (g.const([0, 0, h.hq, h.d]), node.output[0])
    g.nodes.append(helper.make_node("Reshape", [o, shape], [output], name=g.fresh()))


def _reshape_after(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """{attention output: the Reshape that alone reads it} where that Reshape's shape is a constant without zeros
    (so its result depends on the element count alone): the decomposition, or the C kernel, writes that shape
    directly, one node per layer fewer (onnxruntime does not merge consecutive Reshapes)."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    shapes = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer  # shapes are inline int64 tensors
              if t.data_type == TensorProto.INT64 and t.data_location != TensorProto.EXTERNAL}
    outputs = {o.name for o in model.graph.output}
    found = {}
    for node in attention_nodes(model):
        after = readers.get(node.output[0], [])
        if (len(after) == 1 and after[0].op_type == "Reshape" and after[0].input[0] == node.output[0]
                and after[0].input[1] in shapes and 0 not in shapes[after[0].input[1]].tolist()
                and node.output[0] not in outputs):
            found[node.output[0]] = after[0]
    return found


def _decompose_node(g: Graph, node: onnx.NodeProto, masks: _Masks, into: tuple[str, str] | None) -> None:
    h = _heads(g, node, masks)
    kc, vc = node.input[3:5]
    tokens, longest = masks.tokens, masks.longest
    zero, axis2, axis3 = g.const([0]), g.const([2]), g.const([3])
    k_old = g.op("Transpose", g.op("Slice", kc, zero, longest, axis2), perm=[0, 1, 3, 2])  # [B, Hkv, D, P]
    v_old = g.op("Slice", vc, zero, longest, axis2)  # [B, Hkv, P, D]
    scores = g.op("Concat", g.op("MatMul", h.qg, h.k_new), g.op("MatMul", h.qg, k_old), axis=3)  # [B, Hkv, gT, T + P]
    # Step columns first: a row's real scores sit at the same columns whatever the batch's longest prefix,
    # and the masked columns of a shorter prefix trail (exp = 0), so onnxruntime's softmax and MatMul give
    # a row the same bits alone or batched (tests/backends check it on real engines).
    probs = g.op("Softmax", g.op("Add", scores, masks.bias_for(h.group)), axis=3)
    p_new = g.op("Slice", probs, zero, tokens, axis3)
    p_old = g.op("Slice", probs, tokens, masks.keys, axis3)
    o = g.op("Add", g.op("MatMul", p_new, h.v_new), g.op("MatMul", p_old, v_old))  # [B, Hkv, gT, D]
    _write_output(g, node, h, o, into)


class _ExactPlan:
    """The per-graph indices and masks of the exact decomposition (module docstring), built once.

    Row b's keys are cut into blocks of KEY_BLOCK positions, nb = max cache_len // KEY_BLOCK + 2 of them for the
    batch. Block t is one product over its KEY_BLOCK cached columns (positions t*KEY_BLOCK + c below cache_len)
    followed by the T step columns whose keys sit in block t: a step token at position cache_len + rel (rel =
    the step tokens it sees - 1) is in block (cache_len + rel) // KEY_BLOCK, one of the two from
    cache_len // KEY_BLOCK on; so a row holds at most EXACT_MAX_TOKENS tokens.
    """

    def __init__(self, g: Graph, masks: _Masks, key_cache: str, group: int) -> None:
        BK = KEY_BLOCK
        blocks = g.op("Add", g.op("Div", masks.longest, g.const(BK)), g.const([2]))  # [1] nb
        last = g.op("Sub", g.op("Shape", key_cache, start=2, end=3), g.const([1]))  # [1] the last cache row
        # positions 0 .. nb*BK - 1, clamped to the cache (rows past a row's cache are masked)
        positions = g.op("Range", g.const(0), g.op("Squeeze", g.op("Mul", blocks, g.const([BK]))), g.const(1))
        self.cache_index = g.op("Min", positions, last)  # [nb*BK]
        length = g.op("Unsqueeze", masks.length, g.const([1, 2]))  # [B, 1, 1]
        cached = g.op("Less", g.op("Reshape", positions, g.const([1, -1, BK])), length)  # [B, nb, BK]
        self.cache_bias = _bias(g, cached, [1, 3])  # [B, 1, nb, 1, BK]
        visible = g.op("Cast", masks.visible, to=TensorProto.INT64)  # [B, T, T]
        rel = g.op("Sub", g.op("ReduceSum", visible, g.const([2]), keepdims=0), g.const(1))  # [B, T]
        block = g.op("Div", g.op("Add", g.op("Squeeze", length, g.const([2])), rel), g.const(BK))  # [B, T] per key
        t = g.op("Reshape", g.op("Range", g.const(0), g.op("Squeeze", blocks), g.const(1)), g.const([1, -1, 1, 1]))
        in_block = g.op("Equal", g.op("Unsqueeze", block, g.const([1, 2])), t)  # [B, nb, 1, T]
        step = g.op("And", g.op("Unsqueeze", masks.visible, g.const([1])), in_block)  # [B, nb, T, T]
        self.step_bias = g.op("Tile", _bias(g, step, [1]), g.const([1, 1, 1, group, 1]))  # [B, 1, nb, gT, T]
        self.per_block = g.op("Concat", g.const([1, 1]), blocks, g.const([1, 1]), axis=0)  # [1, 1, nb, 1, 1]
        self.ones = g.op("Expand", g.const(np.ones((2, 1)), np.float32),
                         g.op("Concat", g.const([2]), blocks, axis=0))  # [2, nb]: the block sum's rows


def _with_ones(g: Graph, values: str, rank: int) -> str:
    """values [..., D] -> [..., D + 1]: a ones column, so a block's product also sums its probabilities."""
    pads = g.const([0] * (2 * rank - 1) + [1])
    return g.op("Pad", values, pads, g.const(1.0, np.float32))


def _decompose_exact_node(g: Graph, node: onnx.NodeProto, masks: _Masks, plan: _ExactPlan,
                          into: tuple[str, str] | None) -> None:
    """The row-invariant form: fixed-position key blocks, each block one product, the blocks added in order."""
    h = _heads(g, node, masks)
    kc, vc = node.input[3:5]
    BK, d, W = KEY_BLOCK, h.d, h.d + 1
    k_blocks = g.op("Transpose", g.op("Reshape", g.op("Gather", kc, plan.cache_index, axis=2),
                                      g.const([0, 0, -1, BK, d])), perm=[0, 1, 2, 4, 3])  # [B, Hkv, nb, D, BK]
    q5 = g.op("Unsqueeze", h.qg, g.const([2]))  # [B, Hkv, 1, gT, D]
    s_cache = g.op("Add", g.op("MatMul", q5, k_blocks), plan.cache_bias)  # [B, Hkv, nb, gT, BK]
    # a zero key column: a 1-column product (T = 1) would round another way
    k_step = g.op("Pad", h.k_new, g.const([0, 0, 0, 0, 0, 0, 0, 1]))  # [B, Hkv, D, T + 1]
    s_step = g.op("Slice", g.op("MatMul", h.qg, k_step), g.const([0]), masks.tokens, g.const([3]))  # [B, Hkv, gT, T]
    s_step = g.op("Add", g.op("Unsqueeze", s_step, g.const([2])), plan.step_bias)  # [B, Hkv, nb, gT, T]
    scores = g.op("Concat", s_cache, s_step, axis=4)  # [B, Hkv, nb, gT, BK + T]
    top = g.op("ReduceMax", scores, g.const([2, 4]), keepdims=1)  # [B, Hkv, 1, gT, 1]: exact in any order
    v_blocks = g.op("Reshape", g.op("Gather", vc, plan.cache_index, axis=2), g.const([0, 0, -1, BK, d]))
    v_step = g.op("Expand", g.op("Unsqueeze", h.v_new, g.const([2])), plan.per_block)  # [B, Hkv, nb, T, D]
    values = _with_ones(g, g.op("Concat", v_blocks, v_step, axis=3), 5)  # [B, Hkv, nb, BK + T, W]
    o = g.op("MatMul", g.op("Exp", g.op("Sub", scores, top)), values)  # [B, Hkv, nb, gT, W]
    # Blocks summed in position order, one MatMul chain per element (K = nb); the blocks past a row's keys are
    # exact zeros, and zeros are neutral, so a row's sum does not depend on the batch's longest prefix.
    flat = g.op("Reshape", o, g.const([0, 0, 0, -1]))  # [B, Hkv, nb, gT*W]
    o = g.op("Reshape", g.op("MatMul", plan.ones, flat), g.const([0, 0, 2, -1, W]))  # [B, Hkv, 2, gT, W]: both the sum
    out = g.op("Div", g.op("Slice", o, g.const([0, 0]), g.const([1, d]), g.const([2, 4])),
               g.op("Slice", o, g.const([0, d]), g.const([1, W]), g.const([2, 4])))  # [B, Hkv, 1, gT, D]
    _write_output(g, node, h, out, into)


def _native_node(g: Graph, node: onnx.NodeProto, masks: _Masks, into: tuple[str, str] | None) -> None:
    """The node as onnxruntime_attention.c's MaskedAttention: the graph's step mask in place of its (W, N, G); with
    `into` = (shape, output) of the Reshape after it (`_reshape_after`), the kernel writes that Reshape's output."""
    attrs = {key: _attributes(node)[key] for key in ("num_q_heads", "num_kv_heads", "head_dim", "scale")}
    shape, output = ([into[0]], into[1]) if into else ([], node.output[0])
    g.nodes.append(helper.make_node(NATIVE_OP, [*node.input[:6], masks.visible, *shape], [output], name=g.fresh(),
                                    domain=NATIVE_DOMAIN, **attrs))


class NodeLookup:
    """Lookups over a graph for the rewrites that put this library's C kernels in place of standard nodes
    (onnx_rotary, onnx_swiglu): who makes and who reads each value, and its small int64 constants."""

    def __init__(self, model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> None:
        self.maker = {name: node for node in nodes for name in node.output}
        self.readers: dict[str, int] = {}
        for node in nodes:
            for name in node.input:
                self.readers[name] = self.readers.get(name, 0) + 1
        self.outputs = {value.name for value in model.graph.output}
        self.ints = {t.name: numpy_helper.to_array(t).reshape(-1).tolist() for t in model.graph.initializer
                     if t.data_type == TensorProto.INT64 and t.data_location != TensorProto.EXTERNAL}

    def made(self, name: str, op_type: str, reads: int | None = 1) -> onnx.NodeProto | None:
        """The node of `op_type` that makes `name`, where `name` is no graph output and (unless `reads` is None)
        exactly `reads` node inputs read it, so that the node may go; else None."""
        node = self.maker.get(name)
        if node is None or node.op_type != op_type or node.domain or name in self.outputs:
            return None
        return node if reads is None or self.readers.get(name, 0) == reads else None

    def sliced(self, node: onnx.NodeProto | None, axes: tuple[int, ...], start: int, end: int,
               open_end: bool = False) -> str | None:
        """The input `node` slices along one of `axes` from `start` to `end` (open_end: to `end` or past it, where
        the data ends), step 1; else None."""
        if node is None or node.op_type != "Slice" or len(node.input) < 4:
            return None
        starts, ends, axis = (self.ints.get(name) for name in node.input[1:4])
        steps = self.ints.get(node.input[4]) if len(node.input) > 4 and node.input[4] else [1]
        if starts != [start] or axis is None or len(axis) != 1 or axis[0] not in axes or steps != [1]:
            return None
        if ends is None or len(ends) != 1 or not (ends[0] >= end if open_end else ends[0] == end):
            return None
        return node.input[0]


def elem_type(model: onnx.ModelProto, name: str) -> int:
    """The element type of graph input `name` (a key cache: the attention's dtype); float32 if not declared."""
    for value in model.graph.input:
        if value.name == name:
            return value.type.tensor_type.elem_type
    return TensorProto.FLOAT


def replace_nodes(model: onnx.ModelProto, nodes: list[onnx.NodeProto], replaced: dict[int, list[onnx.NodeProto]],
                  dropped: set[int]) -> None:
    """`model`'s nodes, listed once as `nodes` (positions name them: protobuf wrappers have no stable identity),
    with node i as the nodes replaced[i] where given and without the nodes at `dropped`; the NATIVE_DOMAIN opset
    imported once a node of it went in. The graph rewrites at session creation (onnx_rotary.native_rotary,
    onnx_swiglu.native_swiglu, onnx_stack.concat_stacks, engine/quantize.native_products) end here."""
    kept = [new for i, node in enumerate(nodes) if i not in dropped for new in replaced.get(i, [node])]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    native = any(node.domain == NATIVE_DOMAIN for new in replaced.values() for node in new)
    if native and not any(op.domain == NATIVE_DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(NATIVE_DOMAIN, 1))


# what a pattern of fuse_nodes finds at a node: (the nodes a fused node replaces, the fused node), or None
Match = Callable[[NodeLookup, onnx.NodeProto], tuple[list[onnx.NodeProto], onnx.NodeProto] | None]


def fuse_nodes(model: onnx.ModelProto, match: Match) -> tuple[onnx.ModelProto, int]:
    """(`model` with each pattern `match` finds as one node of this library's C kernels, how many), in place:
    match(lookup, node) gives, for a node that anchors its pattern, (the nodes a fused node replaces, the fused
    node), else None. A fused node takes its last replaced node's place, unless a node ahead of it reads one of
    its outputs (the graph's order would break) or another match took one of its nodes: then the nodes stay. A
    float32 graph only (its attention's dtype): the kernels' dtype."""
    nodes = attention_nodes(model)
    if not nodes or elem_type(model, nodes[0].input[3]) != TensorProto.FLOAT:
        return model, 0
    listed = list(model.graph.node)  # one list of the nodes throughout: positions name them
    lookup = NodeLookup(model, listed)
    position = {id(node): i for i, node in enumerate(listed)}
    gone: set[int] = set()
    at: dict[int, list[onnx.NodeProto]] = {}  # fused nodes by position: their last replaced node's
    for node in listed:
        found = match(lookup, node)
        if found is None:
            continue
        replaced, fused = found
        spots = {position[id(old)] for old in replaced}
        last = max(spots)
        if spots & gone or any(set(old.input) & set(fused.output) for old in listed[:last]):
            continue
        gone |= spots
        at[last] = [fused]
    replace_nodes(model, listed, at, gone - set(at))
    return model, len(at)


def decompose(model: onnx.ModelProto, exact: bool = False, native: bool = False) -> onnx.ModelProto:
    """A copy of `model` whose LookaheadAttention nodes are standard ops (for onnxruntime); a node with
    tree = 1 masks by its tree_ends table, and a linear graph's unread dummy table is dropped.

    exact: the row-invariant form (module docstring), for rows of at most EXACT_MAX_TOKENS tokens; float32, and
    query heads sharing a KV head (ValueError otherwise).
    native: each node becomes one MaskedAttention node (domain NATIVE_DOMAIN) of onnxruntime_attention.c, the
    graph's step mask built once by standard ops; row-invariant by construction, float32 (ValueError otherwise).
    """
    nodes = attention_nodes(model)
    if not nodes:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = Graph("lookahead_attention")
    first = nodes[0]
    dtype = elem_type(model, first.input[3])
    masks = _Masks(g, first, dtype)
    plan = None
    if native and dtype != TensorProto.FLOAT:
        raise ValueError("onnxruntime_attention.c runs float32 attention only")
    if exact and not native:
        attrs = _attributes(first)
        group = attrs["num_q_heads"] // attrs["num_kv_heads"]
        if group < 2:  # a 1-row product (T = 1) would round another way
            raise ValueError("the exact decomposition needs grouped-query attention (query heads > KV heads)")
        plan = _ExactPlan(g, masks, first.input[3], group)
    rewritten: list[onnx.NodeProto] = []
    reshapes = _reshape_after(out)
    merged = [id(reshape) for reshape in reshapes.values()]
    for node in out.graph.node:
        if id(node) in merged:  # written by its attention node's decomposition
            continue
        if node.op_type == OP_NAME and node.domain == OP_DOMAIN:
            after = reshapes.get(node.output[0])
            into = None if after is None else (after.input[1], after.output[0])
            if (node.input[5:8] != first.input[5:8] or _attributes(node)["tree"] != _attributes(first)["tree"]
                    or (plan and node.attribute != first.attribute)):
                raise ValueError("LookaheadAttention nodes of one graph must share cache_len, step_config, "
                                 "tree_ends and tree (and, exact, their heads)")
            if native:
                _native_node(g, node, masks, into)
            elif plan is None:
                _decompose_node(g, node, masks, into)
            else:
                _decompose_exact_node(g, node, masks, plan, into)
            rewritten.extend(g.nodes)  # the shared mask nodes come first, ahead of the first layer
            g.nodes = []
        else:
            rewritten.append(node)
    del out.graph.node[:]
    out.graph.node.extend(rewritten)
    out.graph.initializer.extend(g.initializers)
    read = {name for node in out.graph.node for name in node.input}
    unread = [t for t in out.graph.initializer if t.name == first.input[7] and t.name not in read]
    for table in unread:  # onnxruntime warns about an initializer no node reads
        out.graph.initializer.remove(table)
    keep = [o for o in out.opset_import if o.domain != OP_DOMAIN]
    if native:
        keep.append(helper.make_opsetid(NATIVE_DOMAIN, 1))
    del out.opset_import[:]
    out.opset_import.extend(keep)
    return out


def opset_imports(default_opset: int) -> list[onnx.OperatorSetIdProto]:
    return [helper.make_opsetid("", default_opset), helper.make_opsetid(OP_DOMAIN, OP_VERSION)]
