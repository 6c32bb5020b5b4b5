"""The backward kernel: the row-local gradient of logp and/or entropy, one read and one write.

With lp_j = (z_j - M) - L (the contract's log-probability of column j) and p_j = exp(lp_j), the kernel
writes, in the logits' dtype, exactly the operations of `rl_logp.contract.block_grad`:

    logp part     a_j = ((0 - p_j) + onehot_j) * (g_lp / T)        0 where the label is ignored
    entropy part  b_j = (p_j * (lp_j + H)) * -(g_h / T)            0 where p_j == 0
    dz_j = a_j, b_j, or a_j + b_j (both requested; one pass serves logp and entropy)

Rows whose logits are all -inf get +0. `DX` may be `X` itself (inplace backward). Per-row gradients are
read through their stride, so an expanded `grad_output` (from `.sum().backward()`) needs no copy.
Floating-point contraction is off at launch so `a + b` is never fused into an fma the torch path lacks.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fixed_point import TEMP_NONE, exact_exp, row_reciprocal, row_temperature, scale_logits


@triton.jit
def grad_kernel(
    X, stride_x, DX, stride_dx, LABELS, label_offset, vocab_total, TEMP, t_scalar,
    ROW_MAX, LOG_SUM, ENT, G_LP, stride_g_lp, G_H, stride_g_h, n_cols,
    TEMP_MODE: tl.constexpr, DIV: tl.constexpr, LOGP: tl.constexpr, ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    t = row_temperature(TEMP, t_scalar, row, TEMP_MODE)
    row_max = tl.load(ROW_MAX + row)
    z = scale_logits(x, t, row_reciprocal(t, row_max, TEMP_MODE, DIV), TEMP_MODE, DIV)
    live = row_max != float("-inf")
    lp = (z - row_max) - tl.load(LOG_SUM + row)
    p = exact_exp(lp)
    if LOGP:
        g = tl.load(G_LP + row * stride_g_lp)
        if TEMP_MODE != TEMP_NONE:
            g = tl.math.div_rn(g, t)
        label = tl.load(LABELS + row)
        valid = (label >= 0) & (label < vocab_total) & live
        a = 0.0 - p
        a = tl.where(cols == label - label_offset, a + 1.0, a) * g
        a = tl.where(valid, a, 0.0)
    if ENTROPY:
        gh = tl.load(G_H + row * stride_g_h)
        if TEMP_MODE != TEMP_NONE:
            gh = tl.math.div_rn(gh, t)
        b = (p * (lp + tl.load(ENT + row))) * -gh
        b = tl.where(live, tl.where(p == 0.0, 0.0, b), 0.0)
    if LOGP and ENTROPY:
        d = a + b
    elif LOGP:
        d = a
    else:
        d = b
    tl.store(DX + row * stride_dx + cols, d.to(DX.dtype.element_ty), mask=mask, cache_modifier=".cs")

