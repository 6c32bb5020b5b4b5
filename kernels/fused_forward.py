"""The `fused` forward: per-row statistics of the invariant-logp contract in one Triton kernel.

A row of V logits is cut into `n_seg = cdiv(V, SEG)` segments; one work item is one (row, segment).
Programs take work items from an atomic ticket counter, so the items of a row are taken by programs
that are already running (whatever the scheduler does, the rows whose tickets are all taken complete;
a row only ever waits on programs that hold its other tickets, and the kernel needs room for just
`n_seg` programs at once to make progress).

Per item, with `PHASE == 3` (the GPU default: one launch, one HBM read of the logits):
1. load the segment into registers (`CHUNK == SEG`; with `CHUNK < SEG` the segment is streamed and
   re-read in pass 2, which then comes from L2), take its exact max, publish it and arrive on the row's
   counter;
2. wait until every segment of the row has arrived, take the row max M over the published maxima;
3. from the registers, sum trunc(exp(z - M) 2^F) (and, with ENTROPY, trunc(exp(z - M)(z - M) 2^F)) as
   exact integers and add them atomically into the row's int64 accumulators (integer addition is
   associative: the order in which segments arrive cannot change a bit);
4. the last segment to arrive finishes the row (`FINALIZE`): L = fp32(log(S 2^-F)) in fp64, the
   contract's lse, logp = (z[y] - M) - L and the entropy, all written from the kernel.

`PHASE == 1` (segment maxima, and with `FINALIZE` the row max of a vocabulary shard) and `PHASE == 2`
(sums given the maxima of a previous phase-1 launch or an all-reduced `MAX_IN`) split the same work
over two launches: the vocab-parallel provider needs the global max between them, and Triton's
interpreter (CPU CI), which runs programs one after another, cannot wait on a later program.

Fixed point: `QUANT == QUANT_SPLIT` forms trunc(t 2^F) = hi 2^(F-K) + lo from two round-toward-zero
adds (each an exact IEEE operation, see `split_terms`) and sums their bit patterns as wrapping uint32,
which avoids a float-to-int64 conversion per element (those share the special-function unit with `exp`);
`QUANT_CAST` is the plain conversion. Both give the same integers (the split needs F <= 40).
Temperature: z = x / T correctly rounded, T a scalar or one value per row: `DIV_IEEE` is `div_rn` per
element, `DIV_RECIPROCAL` multiplies by the correctly rounded 1/T of the row and corrects with one fma
where that gives the same output bits (see `row_reciprocal`). The row max is taken on x and divided once (correctly rounded division is
monotonic). A row whose temperature is not finite and > 0 gets M = NaN: every statistic of it is NaN.
Exponentials and logarithms are libdevice's (the functions torch's CUDA `exp`/`log` use), so the
`chunked` torch path and this kernel agree bit for bit on a GPU.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
QUANT_CAST = 0
QUANT_SPLIT = 1
DIV_IEEE = 0
DIV_RECIPROCAL = 1
TEMP_NONE, TEMP_SCALAR, TEMP_ROWS = 0, 1, 2
ACC_WORDS = 4  # int64 words per row in the workspace: S, E, arrivals, spare
ROW_WORDS: tl.constexpr = tl.constexpr(ACC_WORDS)
SPLIT_HI_BITS = 20  # the split quantisation's high part: trunc(t 2^20)

if INTERPRET:

    @triton.jit
    def exact_exp(x):
        return tl.exp(x)

    @triton.jit
    def exact_log(x):
        return tl.log(x)

    @triton.jit
    def biased_trunc(x, bias, spacing):
        return tl.floor(x * (1.0 / spacing)) * spacing + bias

    @triton.jit
    def max_all(x):
        # tl.max drops NaN here; a custom combine would run element by element in Python.
        return tl.where(tl.max((x != x).to(tl.int32)) > 0, float("nan"), tl.max(x))

else:
    from triton.language.extra import libdevice

    @triton.jit
    def exact_exp(x):
        return libdevice.exp(x)

    @triton.jit
    def exact_log(x):
        return libdevice.log(x)

    @triton.jit
    def biased_trunc(x, bias, spacing):
        # For 0 <= x < bias (a power of two), x + bias rounded toward zero is bias + x truncated to a
        # multiple of the fp32 spacing at bias: one exact IEEE operation.
        return libdevice.add_rz(x, bias)

    @triton.jit
    def max_all(x):
        """Max over every element, NaN if any element is NaN."""
        return tl.reduce(x, None, max_nan)


@triton.jit
def max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def row_temperature(TEMP, t_scalar, row, TEMP_MODE: tl.constexpr):
    if TEMP_MODE == 2:
        t = tl.load(TEMP + row)
    else:
        t = t_scalar
    return t


@triton.jit
def row_reciprocal(t, row_max, TEMP_MODE: tl.constexpr, DIV: tl.constexpr):
    """The correctly rounded 1/T when `DIV_RECIPROCAL` gives this row the IEEE bits, else 0.0 (div_rn).

    q = x (1/T), r = fma(-q, T, x), z = fma(r, 1/T, q) is the correctly rounded x / T (Markstein) unless
    x / T under- or overflows. With 2^-60 <= |M| <= 2^100 and 2^-10 <= T <= 2^100 the exceptions cannot
    change a bit of the outputs: a logit above 2^100 T would make |M| larger; a quotient that
    underflows (|x| < 2^-100) is below half an ulp of M, so z - M = -M whatever its last bits (and
    exp(z - M) of a -inf or huge negative z is 0 either way). Other rows take div_rn.
    """
    inv_t = tl.full([], 0.0, tl.float32)
    if DIV == 1 and TEMP_MODE != 0:
        m = tl.abs(row_max)
        ok = (t >= 9.765625e-04) & (t <= 1.2676506002282294e30) & (m >= 8.673617379884035e-19) & (m <= 1.2676506002282294e30)
        inv_t = tl.where(ok, tl.math.div_rn(1.0, t), 0.0)
    return inv_t


@triton.jit
def scale_logits(x, t, inv_t, TEMP_MODE: tl.constexpr, DIV: tl.constexpr):
    """z = fp32(x) / T, or fp32(x) without a temperature: `div_rn`, or with DIV_RECIPROCAL and a row
    for which `row_reciprocal` gave 1/T, the reciprocal and one fma correction (NaN only where x is
    +-inf or NaN, where the product q itself is the quotient)."""
    z = x.to(tl.float32)
    if TEMP_MODE != 0:
        if DIV == 1:
            if inv_t > 0.0:
                q = z * inv_t
                corrected = tl.fma(tl.fma(-q, t, z), inv_t, q)
                z = tl.where(corrected != corrected, q, corrected)
            else:
                z = tl.math.div_rn(z, t)
        else:
            z = tl.math.div_rn(z, t)
    return z


@triton.jit
def bad_temperature(t, TEMP_MODE: tl.constexpr):
    if TEMP_MODE == 2:
        bad = (t != t) | (t <= 0.0) | (t == float("inf"))
    else:
        bad = False
    return bad


@triton.jit
def split_terms(t, HI_BIAS: tl.constexpr, LO_BIAS: tl.constexpr):
    """Bit patterns of bias + trunc(t 2^K) and bias' + trunc((t - hi 2^-K) 2^F), t in [0, 1].

    Two round-toward-zero adds of the biases 2^(23-K) and 2^(23-F), whose fp32 spacings are 2^-K and
    2^-F (each an exact IEEE operation); trunc(t 2^F) = hi 2^(F-K) + lo. A biased value's bit pattern is
    the bias's plus the integer, so the patterns add as uint32 (wrapping: the order is free).
    """
    hi_biased = biased_trunc(t, HI_BIAS, HI_BIAS * 1.1920928955078125e-07)
    rest = t - (hi_biased - HI_BIAS)
    lo_biased = biased_trunc(rest, LO_BIAS, LO_BIAS * 1.1920928955078125e-07)
    return hi_biased.to(tl.uint32, bitcast=True), lo_biased.to(tl.uint32, bitcast=True)


@triton.jit
def zero_accumulators(like, QUANT: tl.constexpr):
    """Per-lane accumulators shaped like a tile: uint32 bit-pattern sums (split) or int64 terms (cast)."""
    if QUANT == 1:
        zero = tl.zeros(like.shape, tl.uint32)
    else:
        zero = tl.zeros(like.shape, tl.int64)
    return zero, zero, zero, zero


@triton.jit
def accumulate(s_hi, s_lo, e_hi, e_lo, z, shift, q_scale, ENTROPY: tl.constexpr, QUANT: tl.constexpr,
               HI_BIAS: tl.constexpr, LO_BIAS: tl.constexpr):
    """Add one tile's terms q(exp(d)) (and q(exp(d) (-d)) for the entropy), d = z - shift, lane by lane."""
    d = z - shift
    e = exact_exp(d)
    if ENTROPY:
        # trunc(e d 2^F) = -trunc(e (-d) 2^F); d < -200 has e == 0 exactly, and clamping it keeps
        # 0 * -inf (a masked column) out of the product.
        u = e * (0.0 - tl.maximum(d, -200.0))
    if QUANT == 1:
        hi, lo = split_terms(e, HI_BIAS, LO_BIAS)
        s_hi += hi
        s_lo += lo
        if ENTROPY:
            hi, lo = split_terms(u, HI_BIAS, LO_BIAS)
            e_hi += hi
            e_lo += lo
    else:
        s_hi += (e * q_scale).to(tl.int64)
        if ENTROPY:
            e_hi += (u * q_scale).to(tl.int64)
    return s_hi, s_lo, e_hi, e_lo


@triton.jit
def lane_total(hi, lo, n_tiles, QUANT: tl.constexpr, LO_BITS: tl.constexpr, HI_PATTERN: tl.constexpr,
               LO_PATTERN: tl.constexpr):
    """The exact int64 sum of accumulated terms after `n_tiles` tiles.

    Split: each lane added n_tiles biased patterns, each hi <= 2^K and lo < 2^(F-K) above its bias, so
    a lane's sum minus n_tiles biases fits in 32 bits while n_tiles < 2^(32-K) (V < 2^12 tiles).
    """
    if QUANT == 1:
        n = n_tiles.to(tl.uint32)
        hi64 = (hi - n * HI_PATTERN).to(tl.int64)
        lo64 = (lo - n * LO_PATTERN).to(tl.int64)
        total = (tl.sum(hi64) << LO_BITS) + tl.sum(lo64)
    else:
        total = tl.sum(hi)
    return total


@triton.jit
def tile_sums(z, shift, q_scale, ENTROPY: tl.constexpr, QUANT: tl.constexpr, HI_BIAS: tl.constexpr,
              LO_BIAS: tl.constexpr, LO_BITS: tl.constexpr, HI_PATTERN: tl.constexpr, LO_PATTERN: tl.constexpr):
    """(sum q(exp(d)), sum q(exp(d) d)) of one tile, d = z - shift, q(t) = trunc(t 2^F), as int64."""
    s_hi, s_lo, e_hi, e_lo = zero_accumulators(z, QUANT)
    s_hi, s_lo, e_hi, e_lo = accumulate(s_hi, s_lo, e_hi, e_lo, z, shift, q_scale, ENTROPY, QUANT, HI_BIAS, LO_BIAS)
    one = tl.full([], 1, tl.int32)
    s = lane_total(s_hi, s_lo, one, QUANT, LO_BITS, HI_PATTERN, LO_PATTERN)
    h = s * 0
    if ENTROPY:
        h = 0 - lane_total(e_hi, e_lo, one, QUANT, LO_BITS, HI_PATTERN, LO_PATTERN)
    return s, h


@triton.jit
def _row_stats_kernel(
    X, stride_x, LABELS, TEMP, t_scalar,
    WS, PART_MAX, MAX_IN,
    OUT_MAX, OUT_LOGSUM, OUT_LSE, OUT_LOGP, OUT_ENT,
    n_rows, n_cols, n_seg, ticket_slot,
    q_scale, log_scale,
    TEMP_MODE: tl.constexpr, DIV: tl.constexpr, PHASE: tl.constexpr, FINALIZE: tl.constexpr,
    LOGP: tl.constexpr, ENTROPY: tl.constexpr, MAX_FROM_INPUT: tl.constexpr,
    SEG: tl.constexpr, CHUNK: tl.constexpr, WIDTH: tl.constexpr, NSEG_POW2: tl.constexpr,
    QUANT: tl.constexpr, HI_BIAS: tl.constexpr, LO_BIAS: tl.constexpr, LO_BITS: tl.constexpr,
    HI_PATTERN: tl.constexpr, LO_PATTERN: tl.constexpr,
):
    ROWS_PER_CHUNK: tl.constexpr = CHUNK // WIDTH
    tile = tl.arange(0, ROWS_PER_CHUNK)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    segs = tl.arange(0, NSEG_POW2)
    total = n_rows * n_seg
    ticket = WS + ROW_WORDS * n_rows + ticket_slot
    item = tl.atomic_add(ticket, 1)
    while item < total:
        row = item // n_seg
        seg = item - row * n_seg
        base = X + row * stride_x + seg * SEG
        acc = WS + ROW_WORDS * row
        t = row_temperature(TEMP, t_scalar, row, TEMP_MODE)
        if PHASE != 2:
            # Pass 1: the segment's exact max (of x; divided once by T below).
            if CHUNK == SEG:
                x = tl.load(base + tile, mask=seg * SEG + tile < n_cols, other=float("-inf"))
                m = max_all(x.to(tl.float32))
            else:
                lane_max = tl.full(tile.shape, float("-inf"), tl.float32)
                for c in range(0, SEG, CHUNK):
                    xc = tl.load(base + c + tile, mask=seg * SEG + c + tile < n_cols, other=float("-inf"),
                                 eviction_policy="evict_last")
                    lane_max = max_nan(lane_max, xc.to(tl.float32))
                m = max_all(lane_max)
            if TEMP_MODE != 0:
                m = tl.math.div_rn(m, t)
            m = tl.where(bad_temperature(t, TEMP_MODE), float("nan"), m + 0.0)  # -0.0 becomes +0.0
            tl.store(PART_MAX + row * n_seg + seg, m)
            tl.debug_barrier()
            arrived = tl.atomic_add(acc + 2, 1, sem="acq_rel")
            if PHASE == 1:
                if FINALIZE:
                    if arrived == n_seg - 1:
                        parts = tl.load(PART_MAX + row * n_seg + segs, mask=segs < n_seg, other=float("-inf"),
                                        volatile=True)
                        row_max = max_all(parts)
                        # NaN becomes +inf, which an all-reduce MAX carries reliably; both mean "NaN row".
                        tl.store(OUT_MAX + row, tl.where(row_max != row_max, float("inf"), row_max))
            else:
                while arrived < n_seg:
                    arrived = tl.atomic_add(acc + 2, 0, sem="acquire")
        if PHASE != 1:
            if MAX_FROM_INPUT:
                row_max = tl.load(MAX_IN + row)
            else:
                parts = tl.load(PART_MAX + row * n_seg + segs, mask=segs < n_seg, other=float("-inf"),
                                volatile=True)
                row_max = max_all(parts)
            shift = tl.where(row_max == float("-inf"), 0.0, row_max)
            inv_t = row_reciprocal(t, row_max, TEMP_MODE, DIV)
            if CHUNK == SEG and PHASE == 3:
                s, h = tile_sums(scale_logits(x, t, inv_t, TEMP_MODE, DIV), shift, q_scale, ENTROPY, QUANT,
                                 HI_BIAS, LO_BIAS, LO_BITS, HI_PATTERN, LO_PATTERN)
            else:
                s_hi, s_lo, e_hi, e_lo = zero_accumulators(tile, QUANT)
                n_tiles = tl.zeros([], tl.int32)
                for c in range(0, SEG, CHUNK):
                    xc = tl.load(base + c + tile, mask=seg * SEG + c + tile < n_cols, other=float("-inf"),
                                 eviction_policy="evict_first")
                    s_hi, s_lo, e_hi, e_lo = accumulate(s_hi, s_lo, e_hi, e_lo, scale_logits(xc, t, inv_t, TEMP_MODE, DIV),
                                                        shift, q_scale, ENTROPY, QUANT, HI_BIAS, LO_BIAS)
                    n_tiles += 1
                s = lane_total(s_hi, s_lo, n_tiles, QUANT, LO_BITS, HI_PATTERN, LO_PATTERN)
                h = s * 0
                if ENTROPY:
                    h = 0 - lane_total(e_hi, e_lo, n_tiles, QUANT, LO_BITS, HI_PATTERN, LO_PATTERN)
            tl.atomic_add(acc, s, sem="relaxed")
            if ENTROPY:
                tl.atomic_add(acc + 1, h, sem="relaxed")
            if FINALIZE:
                tl.debug_barrier()
                arrived = tl.atomic_add(acc + 2, 1, sem="acq_rel")
                if arrived == 2 * n_seg - 1:
                    fixed = tl.atomic_add(acc, 0, sem="acquire")
                    entropy_fixed = tl.atomic_add(acc + 1, 0, sem="acquire")
                    finalize_row(row, row_max, fixed, entropy_fixed, X, stride_x, LABELS, t, n_cols, log_scale,
                                 OUT_MAX, OUT_LOGSUM, OUT_LSE, OUT_LOGP, OUT_ENT, TEMP_MODE, LOGP, ENTROPY)
        item = tl.atomic_add(ticket, 1)


@triton.jit
def _row_pipeline_kernel(
    X, stride_x, LABELS, TEMP, t_scalar,
    OUT_MAX, OUT_LOGSUM, OUT_LSE, OUT_LOGP, OUT_ENT,
    n_rows, n_cols, q_scale, log_scale,
    TEMP_MODE: tl.constexpr, DIV: tl.constexpr, LOGP: tl.constexpr, ENTROPY: tl.constexpr,
    CHUNK: tl.constexpr, WIDTH: tl.constexpr, STAGES: tl.constexpr,
    QUANT: tl.constexpr, HI_BIAS: tl.constexpr, LO_BIAS: tl.constexpr, LO_BITS: tl.constexpr,
    HI_PATTERN: tl.constexpr, LO_PATTERN: tl.constexpr,
):
    """Whole rows per program, two rows in flight: one loop over the columns reads row r + P from HBM
    (its max) and re-reads row r, loaded one row earlier, from L2 (its sums given its max), so the
    logits cross HBM once when P rows fit in L2. No atomics, no waiting on other programs."""
    ROWS_PER_CHUNK: tl.constexpr = CHUNK // WIDTH
    tile = tl.arange(0, ROWS_PER_CHUNK)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    n_programs = tl.num_programs(0)
    row = tl.program_id(0).to(tl.int64)
    lane_max = tl.full(tile.shape, float("-inf"), tl.float32)
    for c in tl.range(0, n_cols, CHUNK, num_stages=STAGES):
        xa = tl.load(X + row * stride_x + c + tile, mask=c + tile < n_cols, other=float("-inf"),
                     eviction_policy="evict_last")
        lane_max = max_nan(lane_max, xa.to(tl.float32))
    m_next = max_all(lane_max)
    while row < n_rows:
        nxt = row + n_programs
        more = nxt < n_rows
        t = row_temperature(TEMP, t_scalar, row, TEMP_MODE)
        row_max = m_next
        if TEMP_MODE != 0:
            row_max = tl.math.div_rn(row_max, t)
        row_max = tl.where(bad_temperature(t, TEMP_MODE), float("nan"), row_max + 0.0)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)
        inv_t = row_reciprocal(t, row_max, TEMP_MODE, DIV)
        lane_max = tl.full(tile.shape, float("-inf"), tl.float32)
        s_hi, s_lo, e_hi, e_lo = zero_accumulators(tile, QUANT)
        n_tiles = tl.zeros([], tl.int32)
        for c in tl.range(0, n_cols, CHUNK, num_stages=STAGES):
            cols = c + tile
            xa = tl.load(X + nxt * stride_x + cols, mask=more & (cols < n_cols), other=float("-inf"),
                         eviction_policy="evict_last")
            xb = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"),
                         eviction_policy="evict_first")
            lane_max = max_nan(lane_max, xa.to(tl.float32))
            s_hi, s_lo, e_hi, e_lo = accumulate(s_hi, s_lo, e_hi, e_lo, scale_logits(xb, t, inv_t, TEMP_MODE, DIV),
                                                shift, q_scale, ENTROPY, QUANT, HI_BIAS, LO_BIAS)
            n_tiles += 1
        m_next = max_all(lane_max)
        s = lane_total(s_hi, s_lo, n_tiles, QUANT, LO_BITS, HI_PATTERN, LO_PATTERN)
        h = s * 0
        if ENTROPY:
            h = 0 - lane_total(e_hi, e_lo, n_tiles, QUANT, LO_BITS, HI_PATTERN, LO_PATTERN)
        finalize_row(row, row_max, s, h, X, stride_x, LABELS, t, n_cols, log_scale,
                     OUT_MAX, OUT_LOGSUM, OUT_LSE, OUT_LOGP, OUT_ENT, TEMP_MODE, LOGP, ENTROPY)
        row = nxt


@triton.jit
def finalize_row(row, row_max, fixed, entropy_fixed, X, stride_x, LABELS, t, n_cols, log_scale,
                 OUT_MAX, OUT_LOGSUM, OUT_LSE, OUT_LOGP, OUT_ENT,
                 TEMP_MODE: tl.constexpr, LOGP: tl.constexpr, ENTROPY: tl.constexpr):
    """The contract's per-row finish (rl_logp/contract.py `finalize`), in the same operations."""
    s = fixed.to(tl.float64)
    log_sum = exact_log(s * log_scale)
    bad = (row_max != row_max) | (row_max == float("inf"))
    log_sum32 = tl.where(bad, float("nan"), log_sum.to(tl.float32))
    lse = tl.where(bad, float("nan"), (row_max.to(tl.float64) + log_sum).to(tl.float32))
    tl.store(OUT_MAX + row, row_max)
    tl.store(OUT_LOGSUM + row, log_sum32)
    tl.store(OUT_LSE + row, lse)
    if LOGP:
        label = tl.load(LABELS + row)
        owned = (label >= 0) & (label < n_cols)
        picked = tl.load(X + row * stride_x + tl.where(owned, label, 0))
        target = scale_logits(picked, t, 0.0, TEMP_MODE, 0)
        logp = (target - row_max) - log_sum32
        tl.store(OUT_LOGP + row, tl.where(owned & (row_max != float("-inf")), logp, 0.0))
    if ENTROPY:
        h = log_sum - entropy_fixed.to(tl.float64) / s
        h32 = tl.where(fixed > 0, h, 0.0).to(tl.float32)
        tl.store(OUT_ENT + row, tl.where(bad, float("nan"), h32))
