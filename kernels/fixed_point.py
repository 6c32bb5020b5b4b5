"""The contract's arithmetic in Triton, shared by the forward and backward kernels.

- `exact_exp` / `exact_log`: libdevice's accurate `expf`/`log` (the functions torch's CUDA `exp`/`log`
  use), so the kernels and the pure-torch `chunked` path give the same bits on a GPU. Under Triton's
  interpreter (`TRITON_INTERPRET=1`, the CPU) they are numpy's, whose `exp` is not torch's CPU `exp`.
- `widen`: fp32(x) (a bf16 pair by one mask and one shift); `max_start`: a row max kept in the logits'
  own type (exact; 16-bit pairs take one packed max).
- `scale_logits`: z = fp32(x) / T, the IEEE quotient: `div_rn` per element, or (`DIV_RECIPROCAL`) where
  that gives the same bits, for 16-bit logits fma(x, hi, x lo) with a pair hi + lo = 1/T checked for
  the row's T (`row_divisor`), else the correctly rounded 1/T and one fma correction (`row_reciprocal`).
- `split_terms` / `accumulate` / `lane_total`: the fixed-point terms q(t) = trunc(t 2^F) summed exactly.
  `QUANT_SPLIT` forms q(t) = hi 2^(F-K) + lo from two round-toward-zero adds and one exact subtraction
  and sums their bit patterns as wrapping uint32 lanes, avoiding a float-to-int64 conversion per
  element (that conversion shares the special-function unit with `exp`); `QUANT_CAST` is the plain
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
    def widen(x):
        return x.to(tl.float32)

    @triton.jit
    def max_start(shape: tl.constexpr, dtype: tl.constexpr):
        # The interpreter builds no bf16 constants: its max runs in fp32.
        return tl.full(shape, float("-inf"), tl.float32)

    @triton.jit
    def max_num(a, b):
        # The interpreter's tl.maximum propagates NaN (numpy's maximum).
        return tl.where(a != a, b, tl.maximum(a, b))

    @triton.jit
    def fma_rn(a, b, c):
        # The interpreter's tl.fma rounds twice. Here a b + c is exact in fp64 up to TwoSum's error; the
        # sum rounded to odd (53 >= 24 + 2 bits) then to fp32 is the single rounding of an fma.
        p = tl.cast(a, tl.float64) * tl.cast(b, tl.float64)
        c64 = tl.cast(c, tl.float64)
        s = p + c64
        back = s - p
        err = (p - (s - back)) + (c64 - back)
        bits = s.to(tl.int64, bitcast=True)
        step = tl.where((err > 0.0) == (s > 0.0), 1, -1)
        odd = tl.where((err != 0.0) & ((bits & 1) == 0), bits + step, bits).to(tl.float64, bitcast=True)
        return tl.where(err == err, odd, s).to(tl.float32)

    @triton.jit
    def split_terms(t, HI_BIAS: tl.constexpr, LO_BIAS: tl.constexpr):
        # The GPU's patterns (see its docstring) from exact fp32 steps.
        hi_spacing: tl.constexpr = HI_BIAS * 1.1920928955078125e-07
        lo_spacing: tl.constexpr = LO_BIAS * 1.1920928955078125e-07
        hi_biased = tl.floor(t * (1.0 / hi_spacing)) * hi_spacing + HI_BIAS
        rest = t - (hi_biased - HI_BIAS)
        lo_biased = tl.floor(rest * (1.0 / lo_spacing)) * lo_spacing + LO_BIAS
        return hi_biased.to(tl.uint32, bitcast=True), lo_biased.to(tl.uint32, bitcast=True)

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
    def widen(x):
        """fp32(x) (exact); a pair of bf16 (one 32-bit register, Triton packs the first element in the
        low half) by one shift and one mask."""
        if x.dtype == tl.bfloat16:
            z = tl.inline_asm_elementwise("{shl.b32 $0, $2, 16; and.b32 $1, $2, -65536;}", "=r,=r,r", [x],
                                          dtype=tl.float32, is_pure=True, pack=2)
        else:
            z = x.to(tl.float32)
        return z

    @triton.jit
    def max_start(shape: tl.constexpr, dtype: tl.constexpr):
        """-inf of the logits' own type: a running max in it is exact (every value widens to fp32 exactly,
        in the same order), and for 16-bit types one packed max takes two logits."""
        return tl.full(shape, float("-inf"), dtype)

    @triton.jit
    def max_num(a, b):
        """IEEE maxNum: the larger operand, the other one where one is NaN."""
        return tl.maximum(a, b)

    @triton.jit
    def fma_rn(a, b, c):
        return tl.fma(a, b, c)

    @triton.jit
    def split_terms(t, HI_BIAS: tl.constexpr, LO_BIAS: tl.constexpr):
        """Bit patterns of bias + trunc(t 2^K) and bias' + trunc((t - hi 2^-K) 2^F), t in [0, 1] (or NaN).

        hi = t + 2^(23-K) rounded toward zero: the fp32 spacing at that bias is 2^-K, so hi is the bias
        plus t truncated to K fractional bits, one exact IEEE operation; with h = hi - 2^(23-K), the
        exact (2^(23-K) + 2^(23-F)) - hi = 2^(23-F) - h, and t plus that rounded toward zero is the bias
        2^(23-F) plus t - h truncated to F fractional bits (t - h < 2^-K, spacing 2^-F there). So
        trunc(t 2^F) = hi' 2^(F-K) + lo' (primes: the integers above the biases). A biased value's bit
        pattern is the bias's plus the integer, so the patterns add as uint32 (wrapping: order-free).
        """
        hi_biased = libdevice.add_rz(t, HI_BIAS)
        lo_biased = libdevice.add_rz(t, (HI_BIAS + LO_BIAS) - hi_biased)
        return hi_biased.to(tl.uint32, bitcast=True), lo_biased.to(tl.uint32, bitcast=True)

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
    exp(z - M) of a -inf or huge negative z is 0 either way). Such a row holds no +inf or NaN (M would be
    +inf or NaN). Other rows take div_rn.
    """
    inv_t = tl.full([], 0.0, tl.float32)
    if DIV == DIV_RECIPROCAL and TEMP_MODE != TEMP_NONE:
        m = tl.abs(row_max)
        ok = (t >= 9.765625e-04) & (t <= 1.2676506002282294e30) & (m >= 8.673617379884035e-19) & (m <= 1.2676506002282294e30)
        inv_t = tl.where(ok, tl.math.div_rn(1.0, t), 0.0)
    return inv_t


@triton.jit
def row_divisor(t, row_max, TEMP_MODE: tl.constexpr, DIV: tl.constexpr, FRACTION_BITS: tl.constexpr):
    """(inv_t, inv_lo) for `scale_logits` in a forward row of logits with FRACTION_BITS fraction bits:
    `row_reciprocal`'s 1/T and 0.0; or for 16-bit logits (7: bf16, 10: fp16), where `row_reciprocal`
    gave 1/T, the pair hi = 1/T rounded down, lo = (1/T - hi) rounded (hi 2^-30 where 1/T is exact) if
    fma(x, hi, x lo) is the IEEE x / T for every such x, else (0.0, 0.0) (div_rn).

    x hi + fl(x lo) is within about 2^-46 of x / T (an exact 1/T: x hi is the quotient and x lo under a
    quarter of its ulp), so the rounding can only differ from the IEEE one where x / T lies that close
    to a midpoint of two floats, which depends on x's significand alone: scaling x by 2^k scales every
    step exactly (overflow included) while x lo is normal and the quotient is not subnormal. So the
    2^FRACTION_BITS significands of [1, 2) are checked here for this T, and the pair is kept only if
    all match. Where x lo or the quotient is subnormal, lo >= 2^-40 hi bounds |x / T| and the result
    below 2^-85, under a quarter ulp of M (|M| >= 2^-60 on this path, `row_reciprocal`), so z - M = -M
    either way. +-inf, NaN and +-0 give the IEEE quotient too (hi > 0, lo > 0).
    """
    inv_t = row_reciprocal(t, row_max, TEMP_MODE, DIV)
    inv_lo = tl.full([], 0.0, tl.float32)
    if FRACTION_BITS < 23 and DIV == DIV_RECIPROCAL and TEMP_MODE != TEMP_NONE:
        above = fma_rn(-inv_t, t, 1.0) < 0.0  # the residual 1 - inv_t T is exact
        down = tl.where(above, (inv_t.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True), inv_t)
        rest = tl.math.div_rn(fma_rn(-down, t, 1.0), t)
        rest = tl.where(rest > 0.0, rest, down * 9.313225746154785e-10)
        m = 1.0 + tl.arange(0, 1 << FRACTION_BITS).to(tl.float32) * (1.0 / (1 << FRACTION_BITS))
        wrong = tl.max((fma_rn(m, down, m * rest) != tl.math.div_rn(m, t)).to(tl.int32))
        ok = (inv_t > 0.0) & (down >= 8.271806125530277e-25) & (rest >= down * 9.094947017729282e-13) & (wrong == 0)
        inv_t = tl.where(ok, down, 0.0)
        inv_lo = tl.where(ok, rest, 0.0)
    return inv_t, inv_lo


@triton.jit
def uses_reciprocal(inv_t, inv_lo, PAIR: tl.constexpr):
    """Whether `scale_logits` multiplies by these `row_reciprocal` / `row_divisor` values (else div_rn)."""
    if PAIR:
        usable = inv_lo > 0.0
    else:
        usable = inv_t > 0.0
    return usable


@triton.jit
def scale_logits(x, t, inv_t, TEMP_MODE: tl.constexpr, DIV: tl.constexpr, inv_lo=0.0, PAIR: tl.constexpr = False):
    """z = fp32(x) / T, or fp32(x) without a temperature, the IEEE quotient: `div_rn`, or with
    DIV_RECIPROCAL where `uses_reciprocal`: with `PAIR` (`row_divisor`'s pair, hi in `inv_t`),
    fma(x, hi, x lo); else the reciprocal and one fma correction (Markstein: it is NaN where x is -inf
    and the product x (1/T) itself is the quotient; the max with -inf takes that, and a row on this path
    holds no +inf or NaN)."""
    z = widen(x)
    if TEMP_MODE != TEMP_NONE:
        if DIV == DIV_RECIPROCAL:
            if uses_reciprocal(inv_t, inv_lo, PAIR):
                if PAIR:
                    z = fma_rn(z, inv_t, z * inv_lo)
                else:
                    q = z * inv_t
                    z = max_num(fma_rn(fma_rn(-q, t, z), inv_t, q), float("-inf"))
            else:
                z = tl.math.div_rn(z, t)
        else:
            z = tl.math.div_rn(z, t)
    return z


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
    nd = shift - z  # -d: rounding is symmetric; exp's argument -nd is a negation its fmas absorb
    e = exact_exp(nd * -1.0)
    if ENTROPY:
        # trunc(e d 2^F) = -trunc(e (-d) 2^F); -d > 200 has e == 0 exactly, and clamping it keeps
        # 0 * inf (a masked column) out of the product.
        u = e * tl.minimum(nd, 200.0)
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
