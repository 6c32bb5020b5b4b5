"""The forward kernel's split plan: a few rows, each on several programs, one per column range.

With fewer rows than the GPU has SMs, one program per row leaves most SMs idle and a row's passes run at
one SM's bandwidth. Here program (row, r) takes columns [r span, (r + 1) span) of its row, in launches:
1. `PHASE_MAX`: the range's fp32 max (`row_stats.scan_max`) into the row's workspace; the row's arrival
   counter zeroed;
2. `PHASE_SUMS`: the row max M (the ranges' maxes reduced, then `row_stats.scaled_max`: the whole-row
   kernel's M), the range's exact S and E given M (`row_stats.fixed_sums`) into the workspace; the last
   program of the row to arrive (`arrival.last_to_arrive`) adds the ranges' S and E (integers: any order
   gives the same sum) and finishes the row (`row_stats.finalize_row`: logp of the labels, lse, entropy),
   and with full logprobs asked for, keeps M and L in the workspace;
3. `PHASE_WRITE` (full logprobs only): the range's (z - M) - L.
Every value is the whole-row kernel's, bit for bit. The workspace is one int32 allocation of `ROW_WORDS`
words a row (`row_words`); no program waits on another; no host sync: capturable in a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .arrival import last_to_arrive, published
from .fixed_point import Named, max_all, row_divisor, row_temperature
from .row_stats import finalize_row, fixed_sums, scaled_max, scan_max, write_logprobs

PHASE_MAX: tl.constexpr = Named(0)
PHASE_SUMS: tl.constexpr = Named(1)
PHASE_WRITE: tl.constexpr = Named(2)


def row_words(split: int) -> int:
    """int32 words of a row's workspace (its sections: `_row_workspace`), a multiple of 32 (128 bytes)."""
    return triton.cdiv(5 * split + 3, 32) * 32


@triton.jit
def _row_workspace(WS, row, SPLIT: tl.constexpr, ROW_WORDS: tl.constexpr):
    """Typed pointers to a row's sections of the int32 workspace WS: the ranges' S and E (int64 [SPLIT]
    each, first, so 8-byte aligned), the ranges' maxes (fp32 [SPLIT]), the row's M and L (fp32 [2]), the
    arrival counter (int32)."""
    tl.static_assert(ROW_WORDS >= 5 * SPLIT + 3)
    base = WS + row * ROW_WORDS
    sums = base.to(tl.pointer_type(tl.int64), bitcast=True)
    maxes = (base + 4 * SPLIT).to(tl.pointer_type(tl.float32), bitcast=True)
    return sums, sums + SPLIT, maxes, maxes + SPLIT, base + 5 * SPLIT + 2


@triton.jit
def row_stats_range_kernel(
    X, stride_x, LABELS, n_picks, TEMP, t_scalar, WS,
    OUT_MAX, OUT_LOGSUM, OUT_LSE, OUT_LOGP, OUT_ENT, OUT_FULL, stride_full,
    n_cols, span, q_scale, log_scale,
    PHASE: tl.constexpr, TEMP_MODE: tl.constexpr, DIV: tl.constexpr,
    ENTROPY: tl.constexpr, CHUNK: tl.constexpr, LANE: tl.constexpr, QUANT: tl.constexpr,
    HI_BIAS: tl.constexpr, LO_BIAS: tl.constexpr, LO_BITS: tl.constexpr, HI_PATTERN: tl.constexpr,
    LO_PATTERN: tl.constexpr, SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr, ROW_WORDS: tl.constexpr,
):
    """Program (row, r), columns [r span, min((r + 1) span, n_cols)) of the row (span a multiple of CHUNK,
    every range non-empty), launch PHASE."""
    tile = tl.arange(0, CHUNK // LANE)[:, None] * LANE + tl.arange(0, LANE)[None, :]
    row = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    x_row = X + row * stride_x
    lo = r * span
    width = tl.minimum(span, n_cols - lo)
    sums, ents, maxes, finish, arrivals = _row_workspace(WS, row, SPLIT, ROW_WORDS)
    s = tl.arange(0, SPLIT_PAD)
    t = row_temperature(TEMP, t_scalar, row, TEMP_MODE)
    if PHASE == PHASE_MAX:
        tl.store(maxes + r, scan_max(x_row + lo, tile, width, CHUNK))
        if r == 0:
            tl.store(arrivals, 0)
    elif PHASE == PHASE_SUMS:
        row_max = scaled_max(max_all(tl.load(maxes + s, mask=s < SPLIT, other=float("-inf"))), t, TEMP_MODE)
        fixed, entropy_fixed, _, _ = fixed_sums(x_row + lo, tile, width, t, row_max, q_scale, TEMP_MODE, DIV, ENTROPY,
                                                CHUNK, LANE, QUANT, HI_BIAS, LO_BIAS, LO_BITS, HI_PATTERN, LO_PATTERN)
        tl.store(sums + r, fixed)
        if ENTROPY:
            tl.store(ents + r, entropy_fixed)
        if last_to_arrive(arrivals, SPLIT - 1):
            fixed = tl.sum(published(sums + s, s < SPLIT, 0))
            if ENTROPY:
                entropy_fixed = tl.sum(published(ents + s, s < SPLIT, 0))
            log_sum32 = finalize_row(row, row_max, fixed, entropy_fixed, x_row, LABELS, n_picks, t, n_cols, log_scale,
                                     OUT_MAX, OUT_LOGSUM, OUT_LSE, OUT_LOGP, OUT_ENT, TEMP_MODE)
            if OUT_FULL is not None:
                tl.store(finish, row_max)
                tl.store(finish + 1, log_sum32)
    else:
        row_max = tl.load(finish)
        log_sum32 = tl.load(finish + 1)
        inv_t, inv_lo = row_divisor(t, row_max, TEMP_MODE, DIV, X.dtype.element_ty.fp_mantissa_width)
        write_logprobs(x_row + lo, OUT_FULL + row * stride_full + lo, tile, width, t, inv_t, inv_lo, row_max,
                       log_sum32, TEMP_MODE, DIV, CHUNK)
