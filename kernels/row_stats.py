"""The forward kernel: per-row statistics of the invariant-logp contract, whole rows per program.

A program takes rows `pid, pid + P, pid + 2P, ...` (P programs, persistent). For each row:
1. (`MAX_SCAN`) the exact max of x over the row, tile by tile in x's own type (`max_start`), divided
   once by T (correctly rounded division is monotonic), -0.0 made +0.0, NaN for a row whose temperature
   is not finite and > 0; or
   (`MAX_GIVEN`) the max read from `MAX_IN` (an earlier launch's, or the all-reduced max of a vocab shard);
2. unless only the max is asked for (`RESULT_MAX`): a second pass over the row (read again: from L2 when
   the row was just scanned) sums trunc(exp(z - M) 2^F) and, with ENTROPY, trunc(exp(z - M)(M - z) 2^F)
   in per-lane exact integers (see `kernels.fixed_point`; a lane adds LANE adjacent terms in registers
   first, so the accumulators take CHUNK / LANE registers), one reduction per row; a row divided with
   the reciprocal (`row_divisor`) and one divided by `div_rn` run separate loops (`row_sums`);
3. `RESULT_ROW`: the row's finish in the kernel (`finalize_row`: L = fp32(log(S 2^-F)) in fp64, the
   contract's lse, logp = (z[y] - M) - L for each of a row's `n_picks` labels and the entropy), each
   output stored where its pointer is given; with `OUT_FULL`, a third pass writes (z - M) - L for every
   column (a rollout's full-vocabulary logprobs); `RESULT_SUMS`: S and E as int64 (a vocab shard's part of the all-reduced sums);
   `RESULT_MAX`: M only (NaN kept; the vocab-parallel provider maps it for its all-reduce).
No atomics, no workspace, no host sync: one launch per call, capturable in a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fixed_point import (
    DIV_IEEE,
    TEMP_NONE,
    Named,
    accumulate,
    bad_temperature,
    exact_log,
    lane_total,
    max_all,
    max_nan,
    max_start,
    row_divisor,
    row_temperature,
    scale_logits,
    uses_reciprocal,
    zero_accumulators,
)

MAX_SCAN: tl.constexpr = Named(0)
MAX_GIVEN: tl.constexpr = Named(1)
RESULT_ROW: tl.constexpr = Named(0)
RESULT_SUMS: tl.constexpr = Named(1)
RESULT_MAX: tl.constexpr = Named(2)
PICKS: tl.constexpr = Named(16)  # labels of a row scored per step of the finish


@triton.jit
def finalize_row(row, row_max, fixed, entropy_fixed, x_row, LABELS, n_picks, t, n_cols, log_scale,
                 OUT_MAX, OUT_LOGSUM, OUT_LSE, OUT_LOGP, OUT_ENT, TEMP_MODE: tl.constexpr):
    """The contract's per-row finish (rl_logp/contract.py `finalize`), in the same operations; returns L.
    The row's `n_picks` labels (LABELS [n, n_picks], 1 for `logprobs`) each get (z[y] - M) - L, 0 for a
    label outside [0, n_cols) or a row whose max is -inf."""
    s = fixed.to(tl.float64)
    log_sum = exact_log(s * log_scale)
    bad = (row_max != row_max) | (row_max == float("inf"))
    log_sum32 = tl.where(bad, float("nan"), log_sum.to(tl.float32))
    if OUT_MAX is not None:
        tl.store(OUT_MAX + row, row_max)
    if OUT_LOGSUM is not None:
        tl.store(OUT_LOGSUM + row, log_sum32)
    if OUT_LSE is not None:
        tl.store(OUT_LSE + row, tl.where(bad, float("nan"), (row_max.to(tl.float64) + log_sum).to(tl.float32)))
    if OUT_LOGP is not None:
        for k in range(0, n_picks, PICKS):
            ks = k + tl.arange(0, PICKS)
            inside = ks < n_picks
            label = tl.load(LABELS + row * n_picks + ks, mask=inside, other=-1)
            owned = (label >= 0) & (label < n_cols)
            picked = tl.load(x_row + tl.where(owned, label, 0), mask=inside)
            target = scale_logits(picked, t, 0.0, TEMP_MODE, DIV_IEEE)
            logp = tl.where(row_max != float("-inf"), (target - row_max) - log_sum32, 0.0)
            tl.store(OUT_LOGP + row * n_picks + ks, tl.where(owned, logp, 0.0), mask=inside)
    if OUT_ENT is not None:
        h = log_sum - entropy_fixed.to(tl.float64) / s
        h32 = tl.where(fixed > 0, h, 0.0).to(tl.float32)
        tl.store(OUT_ENT + row, tl.where(bad, float("nan"), h32))
    return log_sum32


@triton.jit
def row_sums(x_row, tile, full, n_cols, t, inv_t, inv_lo, shift, q_scale, TEMP_MODE: tl.constexpr,
             DIV: tl.constexpr, PAIR: tl.constexpr, ENTROPY: tl.constexpr, CHUNK: tl.constexpr, QUANT: tl.constexpr,
             HI_BIAS: tl.constexpr, LO_BIAS: tl.constexpr):
    """One row's lane accumulators of the fixed-point sums (`accumulate`), tile by tile."""
    s_hi, s_lo, e_hi, e_lo = zero_accumulators(tile, QUANT)
    for c in range(0, full, CHUNK):
        xc = tl.load(x_row + c + tile, eviction_policy="evict_first")
        z = scale_logits(xc, t, inv_t, TEMP_MODE, DIV, inv_lo, PAIR)
        s_hi, s_lo, e_hi, e_lo = accumulate(s_hi, s_lo, e_hi, e_lo, z, shift, q_scale, ENTROPY, QUANT, HI_BIAS,
                                            LO_BIAS)
    if full < n_cols:
        xc = tl.load(x_row + full + tile, mask=full + tile < n_cols, other=float("-inf"),
                     eviction_policy="evict_first")
        z = scale_logits(xc, t, inv_t, TEMP_MODE, DIV, inv_lo, PAIR)
        s_hi, s_lo, e_hi, e_lo = accumulate(s_hi, s_lo, e_hi, e_lo, z, shift, q_scale, ENTROPY, QUANT, HI_BIAS,
                                            LO_BIAS)
    return s_hi, s_lo, e_hi, e_lo


@triton.jit
def scan_max(x_row, tile, n_cols, CHUNK: tl.constexpr):
    """The fp32 max of n_cols logits from x_row (NaN if one is NaN), scanned in the logits' own type."""
    full = n_cols // CHUNK * CHUNK
    lane_max = max_start(tile.shape, x_row.dtype.element_ty)
    for c in range(0, full, CHUNK):
        xc = tl.load(x_row + c + tile, eviction_policy="evict_last")
        lane_max = max_nan(lane_max, xc).to(lane_max.dtype)
    if full < n_cols:
        xc = tl.load(x_row + full + tile, mask=full + tile < n_cols, other=float("-inf"), eviction_policy="evict_last")
        lane_max = max_nan(lane_max, xc).to(lane_max.dtype)
    return max_all(lane_max.to(tl.float32))


@triton.jit
def scaled_max(m, t, TEMP_MODE: tl.constexpr):
    """The row's M from the max m of its logits: m / T (correctly rounded division is monotonic), -0.0
    made +0.0, NaN for a row whose temperature is not finite and > 0."""
    if TEMP_MODE != TEMP_NONE:
        m = tl.math.div_rn(m, t)
    return tl.where(bad_temperature(t, TEMP_MODE), float("nan"), m + 0.0)


@triton.jit
def fixed_sums(x_row, tile, n_cols, t, row_max, q_scale, TEMP_MODE: tl.constexpr, DIV: tl.constexpr,
               ENTROPY: tl.constexpr, CHUNK: tl.constexpr, LANE: tl.constexpr, QUANT: tl.constexpr,
               HI_BIAS: tl.constexpr, LO_BIAS: tl.constexpr, LO_BITS: tl.constexpr, HI_PATTERN: tl.constexpr,
               LO_PATTERN: tl.constexpr):
    """S and E (int64; E <= 0 is returned negated, as the contract's E) of n_cols logits from x_row given
    the row max, and the row's divisor (`row_divisor`'s inv_t, inv_lo)."""
    full = n_cols // CHUNK * CHUNK
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    pair: tl.constexpr = x_row.dtype.element_ty.fp_mantissa_width < 23
    inv_t, inv_lo = row_divisor(t, row_max, TEMP_MODE, DIV, x_row.dtype.element_ty.fp_mantissa_width)
    # Two loops rather than a branch per tile (a quarter of an instruction per logit).
    if uses_reciprocal(inv_t, inv_lo, pair):
        s_hi, s_lo, e_hi, e_lo = row_sums(x_row, tile, full, n_cols, t, inv_t, inv_lo, shift, q_scale, TEMP_MODE,
                                          DIV, pair, ENTROPY, CHUNK, QUANT, HI_BIAS, LO_BIAS)
    else:
        s_hi, s_lo, e_hi, e_lo = row_sums(x_row, tile, full, n_cols, t, inv_t, inv_lo, shift, q_scale, TEMP_MODE,
                                          DIV_IEEE, pair, ENTROPY, CHUNK, QUANT, HI_BIAS, LO_BIAS)
    n_tiles = tl.cdiv(n_cols, CHUNK)
    fixed = lane_total(s_hi, s_lo, n_tiles * LANE, QUANT, LO_BITS, HI_PATTERN, LO_PATTERN)
    entropy_fixed = fixed * 0
    if ENTROPY:
        entropy_fixed = 0 - lane_total(e_hi, e_lo, n_tiles * LANE, QUANT, LO_BITS, HI_PATTERN, LO_PATTERN)
    return fixed, entropy_fixed, inv_t, inv_lo


@triton.jit
def write_logprobs(x_row, out_row, tile, n_cols, t, inv_t, inv_lo, row_max, log_sum32, TEMP_MODE: tl.constexpr,
                   DIV: tl.constexpr, CHUNK: tl.constexpr):
    """(z - M) - L of n_cols logits from x_row, stored from out_row (a rollout's full-vocabulary logprobs)."""
    pair: tl.constexpr = x_row.dtype.element_ty.fp_mantissa_width < 23
    for c in range(0, n_cols, CHUNK):
        inside = c + tile < n_cols
        xc = tl.load(x_row + c + tile, mask=inside, eviction_policy="evict_first")
        z = scale_logits(xc, t, inv_t, TEMP_MODE, DIV, inv_lo, pair)
        tl.store(out_row + c + tile, (z - row_max) - log_sum32, mask=inside)


@triton.jit
def row_stats_kernel(
    X, stride_x, LABELS, n_picks, TEMP, t_scalar, MAX_IN,
    OUT_MAX, OUT_LOGSUM, OUT_LSE, OUT_LOGP, OUT_ENT, OUT_S, OUT_E, OUT_FULL, stride_full,
    n_rows, n_cols, q_scale, log_scale,
    MAX_FROM: tl.constexpr, RESULT: tl.constexpr, TEMP_MODE: tl.constexpr, DIV: tl.constexpr,
    ENTROPY: tl.constexpr, CHUNK: tl.constexpr, LANE: tl.constexpr, QUANT: tl.constexpr,
    HI_BIAS: tl.constexpr, LO_BIAS: tl.constexpr, LO_BITS: tl.constexpr, HI_PATTERN: tl.constexpr,
    LO_PATTERN: tl.constexpr,
):
    # A tile is CHUNK logits as [CHUNK // LANE, LANE]: each lane's LANE adjacent logits are summed in
    # registers before its accumulator; full tiles load without a mask, the last partial one with it.
    tile = tl.arange(0, CHUNK // LANE)[:, None] * LANE + tl.arange(0, LANE)[None, :]
    row = tl.program_id(0).to(tl.int64)
    while row < n_rows:
        x_row = X + row * stride_x
        t = row_temperature(TEMP, t_scalar, row, TEMP_MODE)
        if MAX_FROM == MAX_SCAN:
            row_max = scaled_max(scan_max(x_row, tile, n_cols, CHUNK), t, TEMP_MODE)
        else:
            row_max = tl.load(MAX_IN + row)
        if RESULT == RESULT_MAX:
            tl.store(OUT_MAX + row, row_max)
        else:
            fixed, entropy_fixed, inv_t, inv_lo = fixed_sums(x_row, tile, n_cols, t, row_max, q_scale, TEMP_MODE, DIV,
                                                             ENTROPY, CHUNK, LANE, QUANT, HI_BIAS, LO_BIAS, LO_BITS,
                                                             HI_PATTERN, LO_PATTERN)
            if RESULT == RESULT_SUMS:
                tl.store(OUT_S + row, fixed)
                if ENTROPY:
                    tl.store(OUT_E + row, entropy_fixed)
            else:
                log_sum32 = finalize_row(row, row_max, fixed, entropy_fixed, x_row, LABELS, n_picks, t, n_cols,
                                         log_scale, OUT_MAX, OUT_LOGSUM, OUT_LSE, OUT_LOGP, OUT_ENT, TEMP_MODE)
                if OUT_FULL is not None:
                    write_logprobs(x_row, OUT_FULL + row * stride_full, tile, n_cols, t, inv_t, inv_lo, row_max,
                                   log_sum32, TEMP_MODE, DIV, CHUNK)
        row += tl.num_programs(0)
