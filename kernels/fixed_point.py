"""The contract's arithmetic in Triton, shared by the forward and backward kernels.

- `exact_exp` / `exact_log`: libdevice's accurate `expf`/`log` (the functions torch's CUDA `exp`/`log`
  use), so the kernels and the pure-torch `chunked` path give the same bits on a GPU. Under Triton's
  interpreter (`TRITON_INTERPRET=1`, the CPU) they are numpy's, whose `exp` is not torch's CPU `exp`.
- `scale_logits`: z = fp32(x) / T, the IEEE quotient: `div_rn` per element, or (`DIV_RECIPROCAL`) the
  correctly rounded 1/T of the row and one fma correction where that gives the same bits
  (`row_reciprocal`).
- `split_terms` / `accumulate` / `lane_total`: the fixed-point terms q(t) = trunc(t 2^F) summed exactly.
  `QUANT_SPLIT` forms q(t) = hi 2^(F-K) + lo from two round-toward-zero adds (each an exact IEEE
  operation) and sums their bit patterns as wrapping uint32 lanes, avoiding a float-to-int64 conversion
  per element (that conversion shares the special-function unit with `exp`); `QUANT_CAST` is the plain
  conversion. Both give the same integers (the split needs F <= 40).

Modes are named `tl.constexpr` values; launchers pass their `.value`.
"""

from __future__ import annotations

import functools
import os
import struct

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

class Named(tl.constexpr):
    """A module-level constant of the kernels (a mode or a size), used in them as any `tl.constexpr`.

    At every launch Triton 3.6 compares each global a kernel used with the value it was compiled with
    (`current != compiled`), and `tl.constexpr` answers a comparison with a new constexpr (about a
    microsecond each on the host, for each of a kernel's named constants, at each launch). A `Named`
    answers a comparison with a constant or a Python number with one of two prebuilt constexprs; anything
    else (a tensor) gets tl.constexpr's own comparison.
    """

    def __eq__(self, other):
        if isinstance(other, (tl.constexpr, int, float)):
            return _TRUE if self.value == getattr(other, "value", other) else _FALSE
        return super().__eq__(other)

    def __ne__(self, other):
        if isinstance(other, (tl.constexpr, int, float)):
            return _FALSE if self.value == getattr(other, "value", other) else _TRUE
        return super().__ne__(other)

    __hash__ = tl.constexpr.__hash__


_TRUE, _FALSE = tl.constexpr(True), tl.constexpr(False)

TEMP_NONE: tl.constexpr = Named(0)  # no temperature: z = fp32(x)
TEMP_SCALAR: tl.constexpr = Named(1)  # one float for every row (`t_scalar`)
TEMP_ROWS: tl.constexpr = Named(2)  # one fp32 value per row (`TEMP[row]`)
DIV_IEEE: tl.constexpr = Named(0)  # div_rn per element
DIV_RECIPROCAL: tl.constexpr = Named(1)  # x (1/T) + one fma correction, same bits (see row_reciprocal)
QUANT_CAST: tl.constexpr = Named(0)  # q(t) by a float-to-int64 conversion
QUANT_SPLIT: tl.constexpr = Named(1)  # q(t) from two round-toward-zero adds (F <= 40)

SPLIT_HI_BITS = 20  # the split's high part: trunc(t 2^20)
MAX_SPLIT_BITS = 40  # the split needs F - 20 <= 20


@functools.lru_cache(maxsize=64)
def split_constants(bits: int) -> tuple[float, float, int, int, int]:
    """The constexprs of the split for F = `bits`, in kernel-signature order: HI_BIAS = 2^(23-K),
    LO_BIAS = 2^(23-F), LO_BITS = F - K, and the biases' fp32 bit patterns (K = min(20, F // 2))."""
    hi_bits = min(SPLIT_HI_BITS, bits // 2)
    hi_bias, lo_bias = 2.0 ** (23 - hi_bits), 2.0 ** (23 - bits)
    pattern = lambda v: struct.unpack("<I", struct.pack("<f", v))[0]  # noqa: E731
    return hi_bias, lo_bias, bits - hi_bits, pattern(hi_bias), pattern(lo_bias)


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
    if TEMP_MODE == TEMP_ROWS:
        t = tl.load(TEMP + row)
    else:
        t = t_scalar
    return t


@triton.jit
def bad_temperature(t, TEMP_MODE: tl.constexpr):
    """A per-row temperature that is not finite and > 0 (its row is scored as NaN)."""
    if TEMP_MODE == TEMP_ROWS:
        bad = (t != t) | (t <= 0.0) | (t == float("inf"))
    else:
        bad = False
    return bad


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
    if DIV == DIV_RECIPROCAL and TEMP_MODE != TEMP_NONE:
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
    if TEMP_MODE != TEMP_NONE:
        if DIV == DIV_RECIPROCAL:
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
def zero_accumulators(tile, QUANT: tl.constexpr):
    """Accumulators of a [lanes, LANE] tile, one per lane: uint32 bit-pattern sums (split) or int64 (cast)."""
    if QUANT == QUANT_SPLIT:
        zero = tl.zeros((tile.shape[0],), tl.uint32)
    else:
        zero = tl.zeros((tile.shape[0],), tl.int64)
    return zero, zero, zero, zero


@triton.jit
def accumulate(s_hi, s_lo, e_hi, e_lo, z, shift, q_scale, ENTROPY: tl.constexpr, QUANT: tl.constexpr,
               HI_BIAS: tl.constexpr, LO_BIAS: tl.constexpr):
    """Add one [lanes, LANE] tile's terms q(exp(d)) (and q(exp(d) (-d)) for the entropy), d = z - shift:
    each lane adds its LANE terms in registers, then into its accumulator (integer adds: order-free)."""
    d = z - shift
    e = exact_exp(d)
    if ENTROPY:
        # trunc(e d 2^F) = -trunc(e (-d) 2^F); d < -200 has e == 0 exactly, and clamping it keeps
        # 0 * -inf (a masked column) out of the product.
        u = e * (0.0 - tl.maximum(d, -200.0))
    if QUANT == QUANT_SPLIT:
        hi, lo = split_terms(e, HI_BIAS, LO_BIAS)
        s_hi += tl.sum(hi, axis=1)
        s_lo += tl.sum(lo, axis=1)
        if ENTROPY:
            hi, lo = split_terms(u, HI_BIAS, LO_BIAS)
            e_hi += tl.sum(hi, axis=1)
            e_lo += tl.sum(lo, axis=1)
    else:
        s_hi += tl.sum((e * q_scale).to(tl.int64), axis=1)
        if ENTROPY:
            e_hi += tl.sum((u * q_scale).to(tl.int64), axis=1)
    return s_hi, s_lo, e_hi, e_lo


@triton.jit
def lane_total(hi, lo, n_terms, QUANT: tl.constexpr, LO_BITS: tl.constexpr, HI_PATTERN: tl.constexpr,
               LO_PATTERN: tl.constexpr):
    """The exact int64 sum of accumulated terms, each lane having added `n_terms` terms.

    Split: each lane added n_terms biased patterns, each hi <= 2^K and lo < 2^(F-K) above its bias, so a
    lane's sum minus n_terms biases fits in 32 bits while n_terms < 2^(32-K) (the launcher checks it).
    """
    if QUANT == QUANT_SPLIT:
        n = n_terms.to(tl.uint32)
        hi64 = (hi - n * HI_PATTERN).to(tl.int64)
        lo64 = (lo - n * LO_PATTERN).to(tl.int64)
        total = (tl.sum(hi64) << LO_BITS) + tl.sum(lo64)
    else:
        total = tl.sum(hi)
    return total
