"""The step mask in closed form, written once over array-likes (docs/design.md section 2.6).

`step_visible(i, j, W, N, G)` says whether step slot i sees step slot j for step_config (W, N, G), with
CAUSAL = (0, 0, 0) meaning a causal prefill chunk (j <= i). It uses only +, -, *, //, %, comparisons and
&, |, ~ on booleans, so numpy (`step_mask`), torch (the export's native-attention mask), the Triton
kernel (in registers) and the ONNX decomposition (`onnx_op.Sym` values) all evaluate this same code.
For (W, N, G) it equals `StepLayout(LookaheadConfig(W, N, G), padded_tokens=T).mask`. With a tree template
(lookahead/tree.py) the verification slots see their ancestors through one table, each node's preorder
index and subtree end (`tree_step_visible`; equal to `StepLayout(config, padded_tokens=T, tree=template).mask`),
read through `read`, which the Triton kernel replaces by a load from its device tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np

CAUSAL = (0, 0, 0)  # the step_config of a prefill chunk


def visible(i, j, window, ngram, verify):  # no annotations: the Triton compiler resolves them as globals
    """Slot i sees slot j in a lookahead step (W >= 1, N >= 2) with G linear candidates, for integer i, j.

    Level-major slots: B_l[c] at l*W + c (l < N-1), then candidate k's m-th token at
    (N-1)*W + k*(N-1) + m; slots from (W+G)(N-1) on are pads that see only themselves.
    """
    return branch_visible(i, j, window, ngram, verify, i, j, chain_end(j, window, ngram))


def chain_end(j, window, ngram):  # (no annotations, as `visible`)
    """The slot after the last token of candidate slot j's chain: nwin + (k + 1)(N - 1)."""
    levels = ngram - 1
    nwin = levels * window
    return nwin + ((j - nwin) // levels + 1) * levels


def branch_visible(i, j, window, ngram, verify, pre_i, pre_j, end_j):  # (no annotations, as `visible`)
    """Slot i sees slot j, the verification slots being a tree: slot s holds the node of preorder index pre_s,
    and node j's subtree ends (in preorder) at end_j (chains: pre_s = s).

    A verification slot sees x_t (slot 0) and its ancestors: the slots j with pre_j <= pre_i < end_j. A // or %
    result is only used where its left operand is >= 0 (C-style and floor division agree there).
    """
    levels = ngram - 1
    nwin = levels * window
    real = (window + verify) * levels
    li = i // window
    ci = i % window
    lj = j // window
    cj = j % window
    win_vis = (j < nwin) & (((lj == 0) & (cj <= ci)) | ((lj >= 1) & (cj == ci) & (lj <= li)))
    tree_vis = (j == 0) | ((j >= nwin) & (pre_j <= pre_i) & (pre_i < end_j))
    in_window = i < nwin
    is_pad = i >= real
    return (in_window & win_vis) | (~in_window & ~is_pad & tree_vis) | (is_pad & (j == i))


def tree_node(j, window, ngram, table, field):  # (no annotations, as `visible`)
    """Slot j's node's preorder index (field 0) or subtree end (field 1), counted from the first verification
    slot nwin: nwin + table[2 (j - nwin) + field] (table: [2T], TreeTemplate.table padded; window slots unused)."""
    nwin = (ngram - 1) * window
    return nwin + read(table, 2 * ((j - nwin) * (j >= nwin)) + field)


def read(table, index):  # (no annotations, as `visible`)
    """table[index] for an index array in [0, 2T): the closed form's only memory access (the Triton kernel loads)."""
    return table[index]


def step_visible(i, j, window, ngram, verify):  # (no annotations, as `visible`)
    """Slot i sees slot j under step_config (window, ngram, verify): `visible`, or j <= i for CAUSAL (W = 0)."""
    causal = window == 0
    lookahead = visible(i, j, window + causal, ngram + 2 * causal, verify)  # W, N made valid where causal
    return (causal & (j <= i)) | (~causal & lookahead)


def tree_step_visible(i, j, window, ngram, verify, table):  # (no annotations, as `visible`)
    """`step_visible` with the verification slots laid out as a tree template (`table` [2T]: `tree_ends`)."""
    causal = window == 0
    w, n = window + causal, ngram + 2 * causal  # W, N made valid where causal
    pre_i, pre_j = tree_node(i, w, n, table, 0), tree_node(j, w, n, table, 0)
    lookahead = branch_visible(i, j, w, n, verify, pre_i, pre_j, tree_node(j, w, n, table, 1))
    return (causal & (j <= i)) | (~causal & lookahead)


def tree_ends(table: np.ndarray, tokens: int) -> np.ndarray:
    """[2 tokens] int64: a template's table (TreeTemplate.table: each node's preorder index and subtree end)
    padded to a step's slots with zeros (a pad node is nobody's ancestor), the table `tree_node` reads."""
    padded = np.zeros(2 * tokens, np.int64)
    padded[: min(len(table), 2 * tokens)] = np.asarray(table, np.int64)[: 2 * tokens]
    return padded


def step_mask(tokens: int, step_config: Any = CAUSAL, tree: np.ndarray | None = None) -> np.ndarray:
    """[tokens, tokens] bool: what the kernel computes in registers, as an array.

    `tree`: a tree template's table (TreeTemplate.table); None = G linear candidates.
    """
    window, ngram, verify = np.asarray(step_config, np.int64).reshape(3)
    if window != 0 and (window < 1 or ngram < 2 or verify < 0 or (window + verify) * (ngram - 1) > tokens):
        raise ValueError(f"step_config {window}/{ngram}/{verify} does not describe a step of {tokens} slots")
    i = np.arange(tokens)[:, None]
    j = np.arange(tokens)[None, :]
    if tree is None:
        return np.asarray(step_visible(i, j, window, ngram, verify), bool)
    if window != 0 and len(tree) < 2 * verify * (ngram - 1):
        raise ValueError(
            f"a {len(tree) // 2}-node tree template cannot fill the {verify * (ngram - 1)} verification slots of "
            f"{window}/{ngram}/{verify}"
        )
    return np.asarray(tree_step_visible(i, j, window, ngram, verify, tree_ends(tree, tokens)), bool)
