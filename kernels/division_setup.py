"""The temperature's division as far as T alone decides it, worked out once per T on the host for the
cluster forward (`cluster_row_stats.cu` takes the result as three arguments): what `fixed_point.row_divisor`
and `row_reciprocal` decide in every Triton program, here with each fp32 operation rounded exactly as the
GPU rounds it (to nearest, ties to even), so the kernel's blocks spend no instruction and no latency on it.

T inside [2^-10, 2^100] (`row_reciprocal`'s range) gets the correctly rounded 1/T; for 16-bit logits
`row_divisor`'s pair hi + lo ~ 1/T is kept where fma(x, hi, fl(x lo)) is the IEEE x / T on every
significand of the logits' type (all checked here) and hi >= 2^-80, lo >= hi 2^-40. The kernel still
decides per row (the max's range) between these and div_rn; every choice gives the IEEE quotient.

Exactness: numpy's fp32 division and its fp64-to-fp32 conversion round correctly; products of an fp32
with a significand of at most 11 bits, and 1 - hi T (hi T within a factor 2 of 1), are exact in fp64;
the fma's sum is taken exactly as an fp64 sum and its error (Knuth's two-sum), which decides the fp32
rounding where the fp64 sum falls on a midpoint of two fp32 values.
"""

from __future__ import annotations

import functools

import numpy as np

T_IN_RANGE = 1  # `division`'s flags: T inside row_reciprocal's range (the reciprocal path may serve a row)
PAIR = 2  # the pair hi + lo serves where the reciprocal path does (16-bit logits)


def _fma_fp32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """fl32(a + b) for fp64 arrays whose exact sum is that of the fp32 fma (a exact, b an fp32 value)."""
    s = a + b
    shadow = s - a
    err = (a - (s - shadow)) + (b - shadow)  # a + b = s + err, exactly
    r = s.astype(np.float32)
    up, down = np.nextafter(r, np.float32(np.inf)), np.nextafter(r, np.float32(-np.inf))
    wide = r.astype(np.float64)
    r = np.where((err > 0) & (s == (wide + up.astype(np.float64)) / 2), up, r)  # a midpoint below the true sum
    return np.where((err < 0) & (s == (wide + down.astype(np.float64)) / 2), down, r)


@functools.lru_cache(maxsize=256)
def division(t: float, fraction_bits: int) -> tuple[float, float, int]:
    """(hi, lo, flags) for the cluster forward at temperature `t` (rounded to fp32, as the launch passes
    it) on logits with `fraction_bits` fraction bits (bf16 7, fp16 10, fp32 23): flags `T_IN_RANGE` |
    `PAIR`; hi the correctly rounded 1/T, or with `PAIR` the pair's hi and lo its lo; else 0.0 (div_rn for
    every row)."""
    t32 = np.float32(t)
    if not 2.0**-10 <= t32 <= 2.0**100:  # NaN, <= 0 and inf too
        return 0.0, 0.0, 0
    recip = np.float32(1.0) / t32
    if fraction_bits >= 23:
        return float(recip), 0.0, T_IN_RANGE
    hi = np.nextafter(recip, np.float32(0.0)) if float(recip) * float(t32) > 1.0 else recip
    lo = np.float32(1.0 - float(hi) * float(t32)) / t32
    lo = lo if lo > 0.0 else hi * np.float32(2.0**-30)
    sig32 = (1.0 + np.arange(1 << fraction_bits) / (1 << fraction_bits)).astype(np.float32)
    sig = sig32.astype(np.float64)
    got = _fma_fp32(sig * float(hi), (sig * float(lo)).astype(np.float32).astype(np.float64))
    if hi >= 2.0**-80 and lo >= float(hi) * 2.0**-40 and np.array_equal(got, sig32 / t32):
        return float(hi), float(lo), T_IN_RANGE | PAIR
    return float(recip), 0.0, T_IN_RANGE
