"""The backward kernel: the row-local gradient of logp and/or entropy, one read and one write.

With lp_j = (z_j - M) - L (the contract's log-probability of column j) and p_j = exp(lp_j), the kernel
writes, in the logits' dtype, exactly the operations of `rl_logp.contract.block_grad`:

    logp part     a_j = ((0 - p_j) + onehot_j) * (g_lp / T)        0 where the label is ignored
    entropy part  b_j = (p_j * (lp_j + H)) * -(g_h / T)            0 where p_j == 0
    dz_j = a_j, b_j, or a_j + b_j (both requested; one pass serves logp and entropy)

Rows whose logits are all -inf get +0. `DX` may be `X` itself (inplace backward). Per-row gradients are
read through their stride, so an expanded `grad_output` (from `.sum().backward()`) needs no copy.
Floating-point contraction is off at launch so `a + b` is never fused into an fma the torch path lacks.

A program writes one tile of BLOCK columns of one row. Most tiles take the lean path: a full tile of a
live row whose label (if any) is valid and lies in another tile, divided by the reciprocal (or with no
temperature, or `DIV_IEEE`): no mask, no label column, no ignored-row or dead-row selects, no `div_rn`
code. Every other tile (the row's last, partial tile, the label's tile, ignored or dead rows, rows that
divide by `div_rn`) takes the general path, the same operations in sub-tiles of SUB columns with every
mask and select, so that its `div_rn` holds few values in registers and does not set the lean path's
register count.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fixed_point import (
    DIV_RECIPROCAL,
    TEMP_NONE,
    exact_exp,
    row_reciprocal,
    row_temperature,
    scale_logits,
    uses_reciprocal,
)


@triton.jit
def grad_tile(X, DX, cols, n_cols, t, inv_t, row_max, log_sum, live, g, local_label, valid, ent, gh,
              TEMP_MODE: tl.constexpr, DIV: tl.constexpr, LOGP: tl.constexpr, ENTROPY: tl.constexpr,
              GENERAL: tl.constexpr):
    """Write dz of the columns `cols` of one row (X, DX: the row's first element). Not GENERAL: every
    column is in the row, the row is live, its label valid and not among `cols`, and its divisor is the
    reciprocal where it has a temperature."""
    if GENERAL:
        mask = cols < n_cols
        x = tl.load(X + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(X + cols, eviction_policy="evict_first")
    z = scale_logits(x, t, inv_t, TEMP_MODE, DIV)
    lp = (z - row_max) - log_sum
    p = exact_exp(lp)
    if LOGP:
        a = 0.0 - p
        if GENERAL:
            a = tl.where(cols == local_label, a + 1.0, a) * g
            a = tl.where(valid, a, 0.0)
        else:
            a = a * g
    if ENTROPY:
        b = (p * (lp + ent)) * -gh
        b = tl.where(p == 0.0, 0.0, b)
        if GENERAL:
            b = tl.where(live, b, 0.0)
    if LOGP and ENTROPY:
        d = a + b
    elif LOGP:
        d = a
    else:
        d = b
    if GENERAL:
        tl.store(DX + cols, d.to(DX.dtype.element_ty), mask=mask, cache_modifier=".cs")
    else:
        tl.store(DX + cols, d.to(DX.dtype.element_ty), cache_modifier=".cs")


@triton.jit
def grad_kernel(
    X, stride_x, DX, stride_dx, LABELS, label_offset, vocab_total, TEMP, t_scalar,
    ROW_MAX, LOG_SUM, ENT, G_LP, stride_g_lp, G_H, stride_g_h, n_cols,
    TEMP_MODE: tl.constexpr, DIV: tl.constexpr, LOGP: tl.constexpr, ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr, SUB: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    x_row = X + row * stride_x
    dx_row = DX + row * stride_dx
    t = row_temperature(TEMP, t_scalar, row, TEMP_MODE)
    row_max = tl.load(ROW_MAX + row)
    log_sum = tl.load(LOG_SUM + row)
    inv_t = row_reciprocal(t, row_max, TEMP_MODE, DIV)
    live = row_max != float("-inf")
    lean = live & (start + BLOCK <= n_cols)
    if TEMP_MODE != TEMP_NONE and DIV == DIV_RECIPROCAL:
        lean = lean & uses_reciprocal(inv_t, 0.0, False)
    g = 0.0
    local_label = 0
    valid = live
    if LOGP:
        g = tl.load(G_LP + row * stride_g_lp)
        if TEMP_MODE != TEMP_NONE:
            g = tl.math.div_rn(g, t)
        label = tl.load(LABELS + row)
        valid = (label >= 0) & (label < vocab_total) & live
        local_label = label - label_offset
        lean = lean & valid & ((local_label < start) | (local_label >= start + BLOCK))
    ent = 0.0
    gh = 0.0
    if ENTROPY:
        ent = tl.load(ENT + row)
        gh = tl.load(G_H + row * stride_g_h)
        if TEMP_MODE != TEMP_NONE:
            gh = tl.math.div_rn(gh, t)
    if lean:
        grad_tile(x_row, dx_row, start + tl.arange(0, BLOCK), n_cols, t, inv_t, row_max, log_sum, live, g,
                  local_label, valid, ent, gh, TEMP_MODE, DIV, LOGP, ENTROPY, False)
    else:
        for sub in range(start, tl.minimum(start + BLOCK, n_cols), SUB):
            grad_tile(x_row, dx_row, sub + tl.arange(0, SUB), n_cols, t, inv_t, row_max, log_sum, live, g,
                      local_label, valid, ent, gh, TEMP_MODE, DIV, LOGP, ENTROPY, True)
