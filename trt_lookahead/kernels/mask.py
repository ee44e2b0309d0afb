"""The step mask in closed form, written once over array-likes (docs/design.md section 2.6).

`step_visible(i, j, W, N, G)` says whether step slot i sees step slot j for step_config (W, N, G), with
CAUSAL = (0, 0, 0) meaning a causal prefill chunk (j <= i). It uses only +, -, *, //, %, comparisons and
&, |, ~ on booleans, so numpy (`step_mask`), torch (the export's native-attention mask), the Triton
kernel (in registers) and the ONNX decomposition (`onnx_op.Sym` values) all evaluate this same code.
For (W, N, G) it equals `StepLayout(LookaheadConfig(W, N, G), padded_tokens=T).mask`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

CAUSAL = (0, 0, 0)  # the step_config of a prefill chunk


def visible(i, j, window, ngram, verify):  # no annotations: the Triton compiler resolves them as globals
    """Slot i sees slot j in a lookahead step (W >= 1, N >= 2), for integer i (rows) and j (columns).

    Level-major slots: B_l[c] at l*W + c (l < N-1), then candidate k's m-th token at
    (N-1)*W + k*(N-1) + m; slots from (W+G)(N-1) on are pads that see only themselves. A // or %
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
    ki = (i - nwin) // levels
    mi = (i - nwin) % levels
    kj = (j - nwin) // levels
    mj = (j - nwin) % levels
    cand_vis = (j == 0) | ((j >= nwin) & (j < real) & (kj == ki) & (mj <= mi))
    in_window = i < nwin
    is_pad = i >= real
    return (in_window & win_vis) | (~in_window & ~is_pad & cand_vis) | (is_pad & (j == i))


def step_visible(i, j, window, ngram, verify):  # (no annotations, as `visible`)
    """Slot i sees slot j under step_config (window, ngram, verify): `visible`, or j <= i for CAUSAL (W = 0)."""
    causal = window == 0
    lookahead = visible(i, j, window + causal, ngram + 2 * causal, verify)  # W, N made valid where causal
    return (causal & (j <= i)) | (~causal & lookahead)


def step_mask(tokens: int, step_config: Any = CAUSAL) -> np.ndarray:
    """[tokens, tokens] bool: what the kernel computes in registers, as an array."""
    window, ngram, verify = np.asarray(step_config, np.int64).reshape(3)
    if window != 0 and (window < 1 or ngram < 2 or verify < 0 or (window + verify) * (ngram - 1) > tokens):
        raise ValueError(f"step_config {window}/{ngram}/{verify} does not describe a step of {tokens} slots")
    i = np.arange(tokens)[:, None]
    j = np.arange(tokens)[None, :]
    return np.asarray(step_visible(i, j, window, ngram, verify), bool)
