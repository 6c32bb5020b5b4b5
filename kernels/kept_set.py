"""The top-k / top-p kept set of `rl_logp.sampling_mask` in one Triton kernel, without sorting a row.

Per row of fp32 `z` (already divided by T), with M its exact max and q(z) = trunc(exp(z - M) 2^F) the
contract's fixed-point terms (the same libdevice `exp` as torch's CUDA `exp`, so the same integers):
- top-k: tau = the k-th largest z counting repeats; top-p (after top-k, over K = {z >= tau}): with
  S = sum_K q and P = max(ceil(p S), 1) in exact integers, q* = q of the last position (in descending
  order) whose preceding mass is below P; the row keeps {z >= tau, q(z) >= q*}. Rows whose max is not
  finite, and rows with k outside (0, V) and p >= 1 or NaN, are left alone.
- Selection works on order-preserving int32 keys of z (-0.0 counted as +0.0). A pass over the row counts
  its elements per bucket of d = M - z (width 1/rate, the last bucket holding every d past the range
  where q is 0) with `tl.histogram`. Counts locate the bucket of the k-th key exactly; for top-p, each
  bucket's mass lies between its count times q at its edges (with margins for exp's last bits), which
  brackets the bucket of the cut. The bracketed elements (at most BIG) are compacted into a per-program
  scratch row, sorted in registers, and the cut found there with exact int64 masses; the mass above the
  bracket is summed exactly in the same pass. A bracket holding more than BIG elements (e.g. top-k with
  k in the thousands) falls back to a bisection over the keys, PIVOTS keys per pass, exact counts or
  masses at each, until one key is left.
- A last pass writes -inf outside the set (`write`) and stores each row's smallest kept value (the
  threshold `z >= threshold` that `rl_logp.sampling_mask` masks with; -inf for a row left alone).
With top-k 50 the common case is four passes over the row (max, histogram, compaction, write) and one
sort of at most SMALL keys. No host synchronisation, no allocation in the kernel: capturable in a CUDA
graph. Launched without fp contraction and with libdevice's non-flushing exp, as the row-statistics
kernel is. Under TRITON_INTERPRET=1 (the CPU) exp is numpy's, not torch's CPU exp.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .fixed_point import INTERPRET, exact_exp, max_all, max_nan

KEY_NEG_INF: tl.constexpr = tl.constexpr(-2139095041)  # the key of -inf (0xFF800000 ^ 0x7FFFFFFF)
KEY_NONE: tl.constexpr = tl.constexpr(-2147483648)  # below every key of a non-NaN value: scratch padding
LOW31: tl.constexpr = tl.constexpr((1 << 31) - 1)
BOUND_SLACK: tl.constexpr = tl.constexpr(2.0**-20)  # relative margin on exp's last bits in the mass bounds

BUCKETS = 1024
SMALL = 256
BIG = 4096
PIVOTS = 16


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
def _load(row_ptr, cols, vocab):
    """A tile of the row, -0.0 made +0.0 (columns past the row read as -inf)."""
    return tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")) + 0.0


@triton.jit
def _row_max(row_ptr, vocab, BLOCK: tl.constexpr):
    m = tl.full([], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = max_nan(m, max_all(tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))))
    return m + 0.0


@triton.jit
def _histogram(row_ptr, vocab, row_max, floor, rate, q_scale, SUM: tl.constexpr, BLOCK: tl.constexpr,
               NB: tl.constexpr):
    """Counts per bucket of the elements whose key is >= floor, and (SUM) the exact sum of their q."""
    counts = tl.zeros([NB], tl.int32)
    total = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = _load(row_ptr, cols, vocab)
        ok = (cols < vocab) & (_key(z) >= floor)
        counts += tl.histogram(_bucket(z, row_max, rate, NB), NB, mask=ok)
        if SUM:
            total += tl.sum(tl.where(ok, _terms(z, row_max, q_scale), 0))
    return counts, total


@triton.jit
def _compact(row_ptr, vocab, row_max, floor, first, last, scratch, rate, q_scale, BLOCK: tl.constexpr,
             NB: tl.constexpr):
    """Store the keys of the elements (key >= floor) in buckets [first, last] at scratch[0, n); return
    the exact sum of q over those (key >= floor) in buckets before `first`. The barriers order this
    row's stores after the previous row's reads of the scratch row, and before this row's reads."""
    tl.debug_barrier()
    n = tl.full([], 0, tl.int32)
    above = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = _load(row_ptr, cols, vocab)
        key = _key(z)
        ok = (cols < vocab) & (key >= floor)
        b = _bucket(z, row_max, rate, NB)
        pick = ok & (b >= first) & (b <= last)
        picked = pick.to(tl.int32)
        tl.store(scratch + n + tl.cumsum(picked, 0) - picked, key, mask=pick)
        n += tl.sum(picked)
        above += tl.sum(tl.where(ok & (b < first), _terms(z, row_max, q_scale), 0))
    tl.debug_barrier()
    return above


@triton.jit
def _resolve(scratch, n_in, k_rank, tau, p, above, total, row_max, q_scale, FIND_K: tl.constexpr,
             FIND_P: tl.constexpr, SUM_HERE: tl.constexpr, CAP: tl.constexpr):
    """Sort the n_in compacted keys; the k_rank-th largest is tau (FIND_K); q* from the masses of the
    keys >= tau, preceded by `above`, against P = ceil(p S) with S = `total` or (SUM_HERE) their sum."""
    i = tl.arange(0, CAP)
    keys = tl.sort(tl.load(scratch + i, mask=i < n_in, other=KEY_NONE), descending=True)
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
def _top_k(row_ptr, vocab, row_max, k, p, chain, scratch, rate, q_scale, BLOCK: tl.constexpr,
           NB: tl.constexpr, SMALL_: tl.constexpr, BIG_: tl.constexpr, PIVOTS_: tl.constexpr):
    """(tau, q*, whether q* was found): with `chain` (top-p on too) and the whole top of the row fitting
    the scratch row, top-p is resolved on the same sorted keys."""
    counts, _ = _histogram(row_ptr, vocab, row_max, KEY_NEG_INF, rate, q_scale, False, BLOCK, NB)
    idx = tl.arange(0, NB)
    through = tl.cumsum(counts, 0)
    b_k = tl.min(tl.where(through >= k, idx, NB - 1))
    upto = tl.sum(tl.where(idx == b_k, through, 0))
    inside = tl.sum(tl.where(idx == b_k, counts, 0))
    full = chain & (upto <= BIG_)
    n_in = tl.where(full, upto, inside)
    rank = (k - 1 - tl.where(full, 0, upto - inside)).to(tl.int32)
    tau = tl.full([], KEY_NEG_INF, tl.int32)
    q_star = tl.full([], 0, tl.int64)
    if n_in <= BIG_:
        _compact(row_ptr, vocab, row_max, KEY_NEG_INF, tl.where(full, 0, b_k), b_k, scratch, rate, q_scale,
                 BLOCK, NB)
        zero = tl.full([], 0, tl.int64)
        if full:
            if n_in <= SMALL_:
                tau, q_star = _resolve(scratch, n_in, rank, tau, p, zero, zero, row_max, q_scale, True, True, True,
                                       SMALL_)
            else:
                tau, q_star = _resolve(scratch, n_in, rank, tau, p, zero, zero, row_max, q_scale, True, True, True,
                                       BIG_)
        else:
            if n_in <= SMALL_:
                tau, _ = _resolve(scratch, n_in, rank, tau, p, zero, zero, row_max, q_scale, True, False, False,
                                  SMALL_)
            else:
                tau, _ = _resolve(scratch, n_in, rank, tau, p, zero, zero, row_max, q_scale, True, False, False,
                                  BIG_)
    else:
        tau = _bisect(row_ptr, vocab, row_max, tl.full([], KEY_NEG_INF, tl.int32), k, q_scale, False, BLOCK // 8,
                      PIVOTS_)
    return tau, q_star, (full & (n_in <= BIG_)).to(tl.int32)


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
def _top_p(row_ptr, vocab, row_max, tau, p, scratch, rate, q_scale, BLOCK: tl.constexpr, NB: tl.constexpr,
           SMALL_: tl.constexpr, BIG_: tl.constexpr, PIVOTS_: tl.constexpr):
    """q* of the top-p cut over the keys >= tau."""
    counts, total = _histogram(row_ptr, vocab, row_max, tau, rate, q_scale, True, BLOCK, NB)
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
    q_star = tl.full([], 0, tl.int64)
    if n_in <= BIG_:
        above = _compact(row_ptr, vocab, row_max, tau, first, last, scratch, rate, q_scale, BLOCK, NB)
        if n_in <= SMALL_:
            _, q_star = _resolve(scratch, n_in, 0, tau, p, above, total, row_max, q_scale, False, True, False, SMALL_)
        else:
            _, q_star = _resolve(scratch, n_in, 0, tau, p, above, total, row_max, q_scale, False, True, False, BIG_)
    else:
        cut = _bisect(row_ptr, vocab, row_max, tau, target, q_scale, True, BLOCK // 8, PIVOTS_)
        q_star = _terms(_value(cut), row_max, q_scale)
    return q_star


@triton.jit
def kept_set_kernel(Z, stride, TOP_K, TOP_P, THRESHOLD, SCRATCH, n_rows, vocab, rate, q_scale,
                    HAS_K: tl.constexpr, HAS_P: tl.constexpr, WRITE: tl.constexpr, BLOCK: tl.constexpr,
                    NB: tl.constexpr, SMALL_: tl.constexpr, BIG_: tl.constexpr, PIVOTS_: tl.constexpr):
    pid = tl.program_id(0)
    scratch = SCRATCH + pid.to(tl.int64) * BIG_
    row = pid.to(tl.int64)
    while row < n_rows:
        row_ptr = Z + row * stride
        k = tl.full([], 0, tl.int64)
        p = tl.full([], 1.0, tl.float32)
        if HAS_K:
            k = tl.load(TOP_K + row).to(tl.int64)
        if HAS_P:
            p = tl.load(TOP_P + row).to(tl.float32)
        k_on = (k > 0) & (k < vocab)
        p_on = p < 1.0
        row_max = _row_max(row_ptr, vocab, BLOCK)
        active = (row_max == row_max) & (tl.abs(row_max) != float("inf")) & (k_on | p_on)
        threshold = tl.full([], float("-inf"), tl.float32)
        if active:
            tau = tl.full([], KEY_NEG_INF, tl.int32)
            q_star = tl.full([], 0, tl.int64)
            p_done = tl.full([], 0, tl.int32)
            if HAS_K:
                if k_on:
                    tau, q_star, p_done = _top_k(row_ptr, vocab, row_max, k, p, p_on, scratch, rate, q_scale, BLOCK,
                                                 NB, SMALL_, BIG_, PIVOTS_)
            if HAS_P:
                if p_on & (p_done == 0):
                    q_star = _top_p(row_ptr, vocab, row_max, tau, p, scratch, rate, q_scale, BLOCK, NB, SMALL_,
                                    BIG_, PIVOTS_)
            tau_value = _value(tau)
            threshold = tl.full([], float("inf"), tl.float32)
            for start in range(0, vocab, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                inside = cols < vocab
                z = _load(row_ptr, cols, vocab)
                keep = z >= tau_value
                if HAS_P:
                    keep = keep & (_terms(z, row_max, q_scale) >= q_star)
                threshold = tl.minimum(threshold, tl.min(tl.where(keep & inside, z, float("inf"))))
                if WRITE:
                    tl.store(row_ptr + cols, tl.full([BLOCK], float("-inf"), tl.float32), mask=inside & ~keep)
        tl.store(THRESHOLD + row, threshold)
        row += tl.num_programs(0)


@functools.lru_cache(maxsize=64)
def bucket_rate(bits: int) -> float:
    """Buckets per unit of d = M - z: the largest power of two with which the last bucket starts past
    d = F ln 2 + 1, where q(z) = 0."""
    return 2.0 ** math.floor(math.log2((BUCKETS - 1) / (bits * math.log(2.0) + 1.0)))


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def kept_set(z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, bits: int,
             threshold: torch.Tensor, *, write: bool, block: int = 4096, warps: int = 8, max_registers: int = 128,
             programs_per_sm: int = 2, small: int = SMALL, big: int = BIG) -> None:
    """Fill `threshold` (fp32 [n]) with each row's smallest kept value of the [n, V] fp32 `z` (last
    dimension contiguous), and with `write` set z to -inf outside the kept set, in place.

    `top_k`: int32/int64 [n] or None; `top_p`: fp32 [n] or None (contiguous); `bits`: the fixed-point F
    (<= 62). Launch parameters (every choice gives the same bits): `block` elements per tile (a power of
    two), `warps`, `max_registers` per thread, `programs_per_sm` persistent programs; `small` and `big`
    the two sizes of the sorted scratch row (powers of two; a bracket above `big` is bisected).
    """
    n, vocab = z.shape
    if top_k is None and top_p is None:
        threshold.fill_(float("-inf"))
        return
    if n == 0:
        return
    slots = n if INTERPRET or not z.is_cuda else programs_per_sm * _sm_count(z.device.index)
    programs = max(1, min(n, slots))
    scratch = torch.empty((programs, big), dtype=torch.int32, device=z.device)
    kept_set_kernel[(programs,)](
        z, z.stride(0), top_k, top_p, threshold, scratch, n, vocab, bucket_rate(bits), float(2.0**bits),
        HAS_K=top_k is not None, HAS_P=top_p is not None, WRITE=write, BLOCK=block, NB=BUCKETS, SMALL_=small,
        BIG_=big, PIVOTS_=PIVOTS, num_warps=warps, enable_fp_fusion=False, enable_reflect_ftz=False,
        **({} if INTERPRET else {"maxnreg": max_registers}),
    )
