"""Device functions of the top-k / top-p kept-set kernels (`kept_set`): one row's selection, without sorting it.

Per row of fp32 `z` (already divided by T), with M its exact max and q(z) = trunc(exp(z - M) 2^F) the
contract's fixed-point terms (the same libdevice `exp` as torch's CUDA `exp`, so the same integers):
- top-k: tau = the k-th largest z counting repeats; top-p (after top-k, over K = {z >= tau}): with
  S = sum_K q and P = max(ceil(p S), 1) in exact integers, q* = q of the last position (in descending
  order) whose preceding mass is below P; the row keeps {z >= tau, q(z) >= q*} = {z >= c}, c the value
  of the smallest key >= tau with q >= q* (q is monotone in z; found by a scalar bisection over keys), so
  the writing pass compares values and computes no exp.
- Selection works on order-preserving int32 keys of z (-0.0 counted as +0.0). `histogram` counts a
  column range's elements per bucket of d = M - z (width 1/rate, the last bucket holding every d past
  the range where q is 0) with `tl.histogram`, whose cost per element grows with the bucket count
  (a ballot per bit and a popcount per bucket a thread owns): few buckets keep it cheap. Counts are
  integers, so the counts of column ranges add up to the row's exactly. They locate the bucket of the
  k-th key exactly; for top-p, each bucket's mass lies between its count times q at its edges (with
  margins for exp's last bits), which brackets the bucket of the cut. The bracketed elements (at most
  BIG) are compacted into a scratch row, sorted in registers, and the cut found there with exact int64
  masses; the mass above the bracket is summed exactly in the same pass. A bracket holding more than
  BIG elements (e.g. top-k with k in the thousands) falls back to a bisection over the keys, PIVOTS keys
  per pass, exact counts or masses at each, until one key is left.
- Top-k in the fused plan first tries a pivot: `pivot_key` guesses a key with a few times k keys above it
  from a sample, `max_and_compact_above` compacts every key at or above it in the max pass, and where
  their count lies in [k, BIG] `pivot_cut` sorts them (they hold every key >= tau: the same sorted keys
  as a `full` bracket, the same bits). Otherwise, and in the split plan:
- A plan runs three steps after `first_counts`: `bracket` (from the row's summed counts), `compact_bracket`
  (on any column range, at the range's offset in the scratch row: the split plan's ranges compact in
  parallel) and `cut_value` (the sort and the cut over the compacted keys; a top-p after a top-k that did
  not resolve it counts and compacts again there, and a bracket over BIG is bisected there).
Under TRITON_INTERPRET=1 (the CPU) exp is numpy's, not torch's CPU exp.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .arrival import published
from .fixed_point import Named, exact_exp, exact_log, max_all, max_nan

KEY_NEG_INF: tl.constexpr = Named(-2139095041)  # the key of -inf (0xFF800000 ^ 0x7FFFFFFF)
KEY_NONE: tl.constexpr = Named(-2147483648)  # below every key of a non-NaN value: scratch padding
LOW31: tl.constexpr = Named((1 << 31) - 1)
BOUND_SLACK: tl.constexpr = Named(2.0**-20)  # relative margin on exp's last bits in the mass bounds
KEY_ABOVE_ALL: tl.constexpr = Named((1 << 31) - 1)  # above every key of a non-NaN value: no pivot
SAMPLE_GROUPS: tl.constexpr = Named(256)  # groups of the pivot's sample
PIVOT_RANK_MAX: tl.constexpr = Named(64)  # the pivot's rank among the groups' maxima, at most

@triton.jit
def _key(z):
    """Order-preserving int32 key of fp32 z (NaN aside)."""
    b = z.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _value(key):
    b = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _terms(z, row_max, q_scale):
    """q(z) = trunc(exp(z - M) 2^F) as int64, the operations of the pure-torch path."""
    return (exact_exp(z - row_max) * q_scale).to(tl.int64)


@triton.jit
def _bucket(z, row_max, rate, NB: tl.constexpr):
    """floor((M - z) rate), the last bucket for everything past it (-inf included); monotone in z."""
    return tl.minimum(tl.floor((row_max - z) * rate), NB - 1.0).to(tl.int32)


@triton.jit
def _ceil_times(p, s):
    """max(ceil(p s), 1) exactly for fp32 p < 1 and int64 s >= 0 (p <= 0: 1): p = m 2^-e, m s split
    at bit 31 so that no product passes 63 bits."""
    bits = p.to(tl.int32, bitcast=True)
    expo = (bits >> 23) & 0xFF
    mant = (bits & 0x7FFFFF).to(tl.int64)
    m = tl.where(expo == 0, mant, mant | 0x800000)
    e = tl.where(expo == 0, 149, 150 - expo).to(tl.int64)
    low = m * (s & LOW31)
    c = m * (s >> 31) + (low >> 31)
    r = low & LOW31
    one = tl.full([], 1, tl.int64)
    t = tl.minimum(tl.maximum(e - 31, 0), 62)
    wide = (c >> t) + (((c & ((one << t) - 1)) | r) != 0).to(tl.int64)
    u = tl.minimum(tl.maximum(31 - e, 0), 31)
    e_small = tl.minimum(e, 31)
    narrow = (c << u) + ((r + (one << e_small) - 1) >> e_small)
    ceil = tl.where(e >= 31, wide, narrow)
    return tl.where(bits <= 0, 1, tl.maximum(ceil, 1))


@triton.jit
def _load(row_ptr, cols, hi):
    """A tile of the row, -0.0 made +0.0 (columns from `hi` on read as -inf)."""
    return tl.load(row_ptr + cols, mask=cols < hi, other=float("-inf")) + 0.0


@triton.jit
def range_max(row_ptr, lo, hi, BLOCK: tl.constexpr):
    """The max of columns [lo, hi) (NaN if one is NaN; -inf for none), -0.0 made +0.0."""
    m = tl.full([], float("-inf"), tl.float32)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = max_nan(m, max_all(tl.load(row_ptr + cols, mask=cols < hi, other=float("-inf"))))
    return m + 0.0


@triton.jit
def histogram(row_ptr, lo, hi, row_max, floor, rate, q_scale, SUM: tl.constexpr, BLOCK: tl.constexpr,
              NB: tl.constexpr):
    """Counts per bucket of the elements of columns [lo, hi) whose key is >= floor, and (SUM) the exact
    sum of their q."""
    counts = tl.zeros([NB], tl.int32)
    total = tl.full([], 0, tl.int64)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = _load(row_ptr, cols, hi)
        ok = (cols < hi) & (_key(z) >= floor)
        counts += tl.histogram(_bucket(z, row_max, rate, NB), NB, mask=ok)
        if SUM:
            total += tl.sum(tl.where(ok, _terms(z, row_max, q_scale), 0))
    return counts, total


@triton.jit
def _compact(row_ptr, lo, hi, row_max, floor, first, last, scratch, rate, q_scale, MASS: tl.constexpr,
             BLOCK: tl.constexpr, NB: tl.constexpr):
    """Store the keys of the elements of columns [lo, hi) (key >= floor) in buckets [first, last] at
    scratch[0, n); return (MASS) the exact sum of q over those (key >= floor) in buckets before `first`,
    else 0. The barriers order this row's stores after the previous row's reads of the scratch row, and
    before this row's reads."""
    tl.debug_barrier()
    n = tl.full([], 0, tl.int32)
    above = tl.full([], 0, tl.int64)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = _load(row_ptr, cols, hi)
        key = _key(z)
        ok = (cols < hi) & (key >= floor)
        b = _bucket(z, row_max, rate, NB)
        pick = ok & (b >= first) & (b <= last)
        picked = pick.to(tl.int32)
        count = tl.sum(picked)
        if count > 0:  # most tiles hold none of a narrow bracket: no scan for them
            tl.store(scratch + n + tl.cumsum(picked, 0) - picked, key, mask=pick)
        n += count
        if MASS:
            above += tl.sum(tl.where(ok & (b < first), _terms(z, row_max, q_scale), 0))
    tl.debug_barrier()
    return above


@triton.jit
def _resolve(scratch, n_in, k_rank, tau, p, above, total, row_max, q_scale, FIND_K: tl.constexpr,
             FIND_P: tl.constexpr, SUM_HERE: tl.constexpr, SHARED: tl.constexpr, CAP: tl.constexpr):
    """Sort the n_in compacted keys; the k_rank-th largest is tau (FIND_K); q* from the masses of the
    keys >= tau, preceded by `above`, against P = ceil(p S) with S = `total` or (SUM_HERE) their sum.
    SHARED: the keys were stored by the row's other programs (`published`)."""
    i = tl.arange(0, CAP)
    if SHARED:
        stored = published(scratch + i, i < n_in, KEY_NONE)
    else:
        stored = tl.load(scratch + i, mask=i < n_in, other=KEY_NONE)
    keys = tl.sort(stored, descending=True)
    if FIND_K:
        tau = tl.max(tl.where(i == k_rank, keys, KEY_NONE))
    q_star = tl.full([], 0, tl.int64)
    if FIND_P:
        in_k = (i < n_in) & (keys >= tau)
        q = tl.where(in_k, _terms(_value(tl.where(in_k, keys, tau)), row_max, q_scale), 0)
        if SUM_HERE:
            total = tl.sum(q)
        target = _ceil_times(p, total)
        before = tl.cumsum(q, 0) - q + above
        last = tl.max(tl.where(in_k & (before < target), i, -1))
        q_star = tl.sum(tl.where(i == last, q, 0))
    return tau, q_star


@triton.jit
def _resolve_sized(scratch, n_in, k_rank, tau, p, above, total, row_max, q_scale, FIND_K: tl.constexpr,
                   FIND_P: tl.constexpr, SUM_HERE: tl.constexpr, SHARED: tl.constexpr, SMALL_: tl.constexpr,
                   BIG_: tl.constexpr):
    """`_resolve` sorting SMALL_ keys where n_in fits them, else BIG_."""
    if n_in <= SMALL_:
        tau, q_star = _resolve(scratch, n_in, k_rank, tau, p, above, total, row_max, q_scale, FIND_K, FIND_P,
                               SUM_HERE, SHARED, SMALL_)
    else:
        tau, q_star = _resolve(scratch, n_in, k_rank, tau, p, above, total, row_max, q_scale, FIND_K, FIND_P,
                               SUM_HERE, SHARED, BIG_)
    return tau, q_star


@triton.jit
def _top_k_sorted(scratch, n_in, rank, p, chained, row_max, q_scale, SHARED: tl.constexpr, SMALL_: tl.constexpr,
                  BIG_: tl.constexpr):
    """(tau, q*) from n_in compacted keys holding the row's k-th key at `rank`: tau that key; with `chained`
    (every key >= tau among them) q* of top-p over them, else 0."""
    zero = tl.full([], 0, tl.int64)
    tau = tl.full([], KEY_NEG_INF, tl.int32)
    q_star = zero
    if chained:
        tau, q_star = _resolve_sized(scratch, n_in, rank, tau, p, zero, zero, row_max, q_scale, True, True, True,
                                     SHARED, SMALL_, BIG_)
    else:
        tau, _ = _resolve_sized(scratch, n_in, rank, tau, p, zero, zero, row_max, q_scale, True, False, False, SHARED,
                                SMALL_, BIG_)
    return tau, q_star


@triton.jit
def _bisect(row_ptr, vocab, row_max, floor, target, q_scale, MASS: tl.constexpr, BLOCK: tl.constexpr,
            PIVOTS_: tl.constexpr):
    """The largest key t with F(t) >= target, F(t) the count (or MASS: the sum of q) of the elements
    whose key is >= max(t, floor); F(floor) >= target. Each pass tries PIVOTS_ keys of (lo, hi]."""
    lo = floor.to(tl.int64)
    hi = _key(row_max).to(tl.int64)
    j = tl.arange(0, PIVOTS_).to(tl.int64)
    while lo < hi:
        pivots = lo + 1 + ((hi - lo - 1) * j) // (PIVOTS_ - 1)
        acc = tl.zeros([PIVOTS_], tl.int64)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = _load(row_ptr, cols, vocab)
            key = _key(z).to(tl.int64)
            ok = (cols < vocab) & (key >= floor)
            if MASS:
                w = tl.where(ok, _terms(z, row_max, q_scale), 0)
            else:
                w = ok.to(tl.int64)
            acc += tl.sum(tl.where(key[:, None] >= pivots[None, :], w[:, None], 0), axis=0)
        good = acc >= target
        lo = tl.maximum(lo, tl.max(tl.where(good, pivots, lo)))
        hi = tl.minimum(hi, tl.min(tl.where(good, hi, pivots - 1)))
    return lo.to(tl.int32)


@triton.jit
def _k_bracket(counts, k, chain, NB: tl.constexpr, BIG_: tl.constexpr):
    """From the row's bucket counts: the bucket b_k of the k-th key; whether the whole top of the row
    (buckets [0, b_k]) is compacted, to resolve top-p on the same sorted keys (`chain`: top-p on too, and
    they fit the scratch row); the keys compacted and the k-th key's rank among them."""
    idx = tl.arange(0, NB)
    through = tl.cumsum(counts, 0)
    b_k = tl.min(tl.where(through >= k, idx, NB - 1))
    upto = tl.sum(tl.where(idx == b_k, through, 0))
    inside = tl.sum(tl.where(idx == b_k, counts, 0))
    full = chain & (upto <= BIG_)
    n_in = tl.where(full, upto, inside)
    rank = (k - 1 - tl.where(full, 0, upto - inside)).to(tl.int32)
    return b_k, full, n_in, rank


@triton.jit
def _mass_bounds(counts, rate, q_scale, NB: tl.constexpr):
    """Per bucket, lower and upper bounds of its elements' summed q (the last bucket's q are all 0)."""
    b = tl.arange(0, NB).to(tl.float64)  # rate and 2^F are powers of two: exact in fp64
    q_hi = tl.floor(exact_exp(-b / rate) * (1.0 + BOUND_SLACK) * q_scale) + 1.0
    q_lo = tl.maximum(tl.floor(exact_exp(-(b + 1.0) / rate) * (1.0 - BOUND_SLACK) * q_scale) - 1.0, 0.0)
    last = tl.arange(0, NB) == NB - 1
    q_hi = tl.where(last, 0.0, tl.minimum(q_hi, q_scale))
    q_lo = tl.where(last, 0.0, q_lo)
    c = counts.to(tl.int64)
    return c * q_lo.to(tl.int64), c * q_hi.to(tl.int64)


@triton.jit
def _p_bracket(counts, total, p, rate, q_scale, NB: tl.constexpr):
    """From the bucket counts and exact total mass of the keys >= tau: the buckets [first, last] that hold
    the top-p cut (each bucket's mass bounded by its count times q at its edges), and their count."""
    target = _ceil_times(p, total)
    mass_lo, mass_hi = _mass_bounds(counts, rate, q_scale, NB)
    cum_lo = tl.cumsum(mass_lo, 0)
    cum_hi = tl.cumsum(mass_hi, 0)
    surely = tl.maximum(cum_lo, total - (tl.sum(mass_hi) - cum_hi))  # mass of the buckets up to b, at least
    at_most = tl.minimum(cum_hi, total - (tl.sum(mass_lo) - cum_lo))
    idx = tl.arange(0, NB)
    first = tl.min(tl.where(at_most >= target, idx, NB - 1))
    last = tl.min(tl.where(surely >= target, idx, NB - 1))
    n_in = tl.sum(tl.where((idx >= first) & (idx <= last), counts, 0))
    return first, last, n_in


@triton.jit
def _top_p(row_ptr, vocab, row_max, tau, p, counts, total, above, scratch, rate, q_scale, COMPACT: tl.constexpr,
           SHARED: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, SMALL_: tl.constexpr, BIG_: tl.constexpr,
           PIVOTS_: tl.constexpr):
    """q* of the top-p cut over the keys >= tau, given their bucket counts and exact total mass; the
    bracket's keys compacted here (COMPACT) or already (`compact_bracket`, with the mass `above` it)."""
    first, last, n_in = _p_bracket(counts, total, p, rate, q_scale, NB)
    q_star = tl.full([], 0, tl.int64)
    if n_in <= BIG_:
        if COMPACT:
            above = _compact(row_ptr, 0, vocab, row_max, tau, first, last, scratch, rate, q_scale, True, BLOCK, NB)
        _, q_star = _resolve_sized(scratch, n_in, 0, tau, p, above, total, row_max, q_scale, False, True, False,
                                   SHARED, SMALL_, BIG_)
    else:
        cut = _bisect(row_ptr, vocab, row_max, tau, _ceil_times(p, total), q_scale, True, BLOCK // 8, PIVOTS_)
        q_star = _terms(_value(cut), row_max, q_scale)
    return q_star


@triton.jit
def _smallest_key(tau, q_star, row_max, q_scale):
    """The smallest key >= tau whose value v has q(v) >= q* (q is monotone in v and q(M) = 2^F >= q*):
    a bisection over int32 keys, one scalar exp per step."""
    lo = tau.to(tl.int64)
    hi = tl.where(q_star > 0, _key(row_max).to(tl.int64), lo)
    while lo < hi:
        mid = lo + (hi - lo) // 2
        good = _terms(_value(mid.to(tl.int32)), row_max, q_scale) >= q_star
        hi = tl.where(good, mid, hi)
        lo = tl.where(good, lo, mid + 1)
    return lo.to(tl.int32)


@triton.jit
def first_counts(row_ptr, lo, hi, row_max, k_on, rate, q_scale, HAS_P: tl.constexpr, BLOCK: tl.constexpr,
                 NB: tl.constexpr):
    """The counts of columns [lo, hi) over every key, and their exact mass where the row's top-p cut will
    be taken over the whole row (no top-k for it; else 0)."""
    if k_on:
        counts, total = histogram(row_ptr, lo, hi, row_max, KEY_NEG_INF, rate, q_scale, False, BLOCK, NB)
    else:
        counts, total = histogram(row_ptr, lo, hi, row_max, KEY_NEG_INF, rate, q_scale, HAS_P, BLOCK, NB)
    return counts, total


@triton.jit
def pivot_key(row_ptr, vocab, k, k_on, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, BIG_: tl.constexpr):
    """A guess of a key with between k and BIG_ of the row's keys at or above it, for top-k to compact them
    in the pass that finds the max (`max_and_compact_above`): a sample of SAMPLE_GROUPS groups of CHUNK *
    CHUNKS adjacent columns spread over the whole row (group g from column g * spread, spread = vocab //
    SAMPLE_GROUPS or the group's width if larger; a vocabulary's order, e.g. frequent tokens first, then
    weighs on no part of it), the r-th largest of the groups' max keys with r = ceil((2 k + 64) sampled /
    vocab), so that about 2 k + 64 keys of a row like its sample are at or above it. KEY_ABOVE_ALL (no
    pivot) where k is off, 2 k + 64 passes BIG_ / 2 or r passes PIVOT_RANK_MAX (the groups' maxima then
    stand too far from the sample's own order). Only a guess: the keys at or above it are counted
    exactly, and a count outside [k, BIG_] takes the bucket path."""
    target = 2 * k + 64
    sampled = tl.minimum(vocab, SAMPLE_GROUPS * CHUNK * CHUNKS).to(tl.int64)
    rank = (target * sampled + vocab - 1) // vocab
    pivot = tl.full([], KEY_ABOVE_ALL, tl.int32)
    if k_on & (target <= BIG_ // 2) & (rank <= PIVOT_RANK_MAX):
        g = tl.arange(0, SAMPLE_GROUPS)
        spread = tl.maximum(vocab // SAMPLE_GROUPS, CHUNK * CHUNKS)
        best = tl.full([SAMPLE_GROUPS], KEY_NONE, tl.int32)
        for c in tl.static_range(CHUNKS):
            cols = g[:, None] * spread + c * CHUNK + tl.arange(0, CHUNK)[None, :]
            best = tl.maximum(best, tl.max(_key(_load(row_ptr, cols, vocab)), axis=1))
        keys = tl.sort(best, descending=True)
        pivot = tl.max(tl.where(g == rank - 1, keys, KEY_NONE))
    return pivot


@triton.jit
def max_and_compact_above(row_ptr, vocab, pivot, scratch, BLOCK: tl.constexpr, BIG_: tl.constexpr):
    """One pass over the row: its max (as `range_max`) and the count of its keys >= pivot, the first BIG_ of
    them stored at scratch (in column order). The barriers order the stores as `_compact`'s."""
    tl.debug_barrier()
    m = tl.full([], float("-inf"), tl.float32)
    n = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = _load(row_ptr, cols, vocab)
        m = max_nan(m, max_all(z))
        pick = (cols < vocab) & (_key(z) >= pivot)
        picked = pick.to(tl.int32)
        count = tl.sum(picked)
        if count > 0:
            at = n + tl.cumsum(picked, 0) - picked
            tl.store(scratch + at, _key(z), mask=pick & (at < BIG_))
        n += count
    tl.debug_barrier()
    return m, n


@triton.jit
def pivot_cut(scratch, n_in, k, p, p_on, row_max, q_scale, HAS_P: tl.constexpr, SMALL_: tl.constexpr,
              BIG_: tl.constexpr):
    """The value c of an active row with top-k from its n_in (k <= n_in <= BIG_) keys at or above a pivot,
    compacted by `max_and_compact_above`: they hold every key >= tau, so top-p chained on top-k is resolved
    on the same sorted keys."""
    chained = False  # a constant where top-p cannot be on
    if HAS_P:
        chained = p_on
    tau, q_star = _top_k_sorted(scratch, n_in, (k - 1).to(tl.int32), p, chained, row_max, q_scale, False, SMALL_,
                                BIG_)
    return _value(_smallest_key(tau, q_star, row_max, q_scale))


@triton.jit
def bracket(k, p, k_on, p_on, counts, total, rate, q_scale, HAS_K: tl.constexpr, HAS_P: tl.constexpr,
            NB: tl.constexpr, BIG_: tl.constexpr):
    """The buckets [first, last] whose keys an active row's cut is found among, given `first_counts` summed
    over the row (no floor on the keys: every key counted): top-k's bucket (from the top with top-p
    chained on it) or, top-p alone, the bucket range of its cut; first > last where none is compacted (a
    bracket over BIG_ keys is bisected instead)."""
    first = tl.full([], 1, tl.int32)
    last = tl.full([], 0, tl.int32)
    n_in = tl.full([], BIG_ + 1, tl.int32)
    if HAS_K:
        if k_on:
            b_k, full, n_in, _ = _k_bracket(counts, k, p_on, NB, BIG_)
            first = tl.where(full, 0, b_k)
            last = b_k
    if HAS_P:
        if p_on & ~k_on:
            first, last, n_in = _p_bracket(counts, total, p, rate, q_scale, NB)
    keep = n_in <= BIG_
    return tl.where(keep, first, 1), tl.where(keep, last, 0)


@triton.jit
def compact_bracket(row_ptr, lo, hi, row_max, first, last, scratch, k_on, rate, q_scale, HAS_P: tl.constexpr,
                    BLOCK: tl.constexpr, NB: tl.constexpr):
    """The keys of columns [lo, hi) in the row's `bracket` stored at scratch (in column order), and the
    exact mass of the keys before it where top-p alone needs it (else 0)."""
    p_alone = False  # a constant where top-p cannot be on: no exp pass compiled for it
    if HAS_P:
        p_alone = ~k_on
    above = tl.full([], 0, tl.int64)
    if first <= last:
        if p_alone:
            above = _compact(row_ptr, lo, hi, row_max, KEY_NEG_INF, first, last, scratch, rate, q_scale, True, BLOCK,
                             NB)
        else:
            _compact(row_ptr, lo, hi, row_max, KEY_NEG_INF, first, last, scratch, rate, q_scale, False, BLOCK, NB)
    return above


@triton.jit
def cut_value(row_ptr, vocab, row_max, k, p, k_on, p_on, counts, total, above, scratch, rate, q_scale,
              HAS_K: tl.constexpr, HAS_P: tl.constexpr, SHARED: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
              SMALL_: tl.constexpr, BIG_: tl.constexpr, PIVOTS_: tl.constexpr):
    """The value c with kept set {z >= c} of an active row, given `first_counts` summed over the row and
    its `bracket` compacted into scratch (`compact_bracket`; SHARED: by the row's other programs too,
    `above` the mass they found before it)."""
    tau = tl.full([], KEY_NEG_INF, tl.int32)
    q_star = tl.full([], 0, tl.int64)
    p_done = tl.full([], 0, tl.int32)
    zero = tl.full([], 0, tl.int64)
    if HAS_K:
        if k_on:
            _b_k, full, n_in, rank = _k_bracket(counts, k, p_on, NB, BIG_)
            if n_in <= BIG_:
                tau, q_star = _top_k_sorted(scratch, n_in, rank, p, full, row_max, q_scale, SHARED, SMALL_, BIG_)
                p_done = full.to(tl.int32)
            else:
                tau = _bisect(row_ptr, vocab, row_max, tl.full([], KEY_NEG_INF, tl.int32), k, q_scale, False,
                              BLOCK // 8, PIVOTS_)
    if HAS_P:
        if p_on & (p_done == 0):
            if k_on:  # top-p over the keys >= tau: counted and compacted again here, by this program
                counts, total = histogram(row_ptr, 0, vocab, row_max, tau, rate, q_scale, True, BLOCK, NB)
                q_star = _top_p(row_ptr, vocab, row_max, tau, p, counts, total, zero, scratch, rate, q_scale, True,
                                False, BLOCK, NB, SMALL_, BIG_, PIVOTS_)
            else:
                q_star = _top_p(row_ptr, vocab, row_max, tau, p, counts, total, above, scratch, rate, q_scale,
                                False, SHARED, BLOCK, NB, SMALL_, BIG_, PIVOTS_)
    return _value(_smallest_key(tau, q_star, row_max, q_scale))


@triton.jit
def finish_range(row_ptr, NOISE, noise_start, lo, hi, cut, WRITE: tl.constexpr, DRAW: tl.constexpr,
                 BLOCK: tl.constexpr):
    """The last pass over columns [lo, hi) of a row whose kept set is {z >= cut}: (the smallest kept value,
    +inf if none; with DRAW the largest key z - log(q) of a kept column, q the row's exponential noise from
    `NOISE + noise_start`, and the first column holding it, (-inf, 0) if none is finite), and with WRITE -inf written
    outside the set. The draw is vLLM's native argmax(probs / q) in Gumbel-max form; `log` is the
    contract's `exact_log` (torch's CUDA `log`)."""
    smallest = tl.full([], float("inf"), tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    best_col = tl.full([], 0, tl.int32)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < hi
        z = _load(row_ptr, cols, hi)
        keep = z >= cut
        smallest = tl.minimum(smallest, tl.min(tl.where(keep & inside, z, float("inf"))))
        if WRITE:
            tl.store(row_ptr + cols, tl.full([BLOCK], float("-inf"), tl.float32), mask=inside & ~keep)
        if DRAW:
            q = tl.load(NOISE + noise_start + cols, mask=inside, other=1.0)
            key = tl.where(keep, z - exact_log(q), float("-inf"))
            top = tl.max(key)
            if top > best:  # strict: an earlier tile keeps a tie
                best = top
                best_col = tl.min(tl.where(key == top, cols, hi))
    return smallest, best, best_col
