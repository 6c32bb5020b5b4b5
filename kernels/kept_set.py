"""The top-k / top-p kept set of `rl_logp.sampling_mask` in Triton kernels, without sorting a row.

The selection itself (per row: the exact max M, bucket counts of d = M - z, the top-k key and top-p cut
found from them, and the cut value c with kept set {z >= c}) is `kept_set_select`'s. Two launch plans,
the same bits:
- fused (many rows): one persistent program per row at a time does everything, four passes over the
  row in the common case (max, counts, compaction of the bracketed keys, write), the later ones mostly
  from L2 as the row was just read.
- split (few rows, `KeptSetLaunch.split_rows`): the passes that dominate a lone row run on `split`
  programs per row, each over one column range: the range's max (launch 1), its bucket counts and exact
  mass given the row max (launch 2), then one program per row sums the counts (integers: order-free),
  finds c (launch 3), and the ranges are written (launch 4); the ranges' smallest kept values are
  reduced by `torch.amin`. Workspaces are sized by the shape only; no program waits on another.
A last pass writes -inf outside the set (`write`) and each row gets its smallest kept value (the
threshold `z >= threshold` that `rl_logp.sampling_mask` masks with; -inf for a row left alone: max not
finite, or k outside (0, V) with p >= 1 or NaN). No host synchronisation, no data-dependent allocation:
capturable in a CUDA graph. Launched without fp contraction and with libdevice's non-flushing exp, as the
row-statistics kernel is.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from .fixed_point import INTERPRET, Named, max_all
from .kept_set_select import cut_value, first_counts, range_max, write_cut
from .launch import INTERPRETER_SLOTS, on_device, sm_count

MODE_FUSED: tl.constexpr = Named(0)  # rows end to end, writes included
MODE_SELECT: tl.constexpr = Named(1)  # the split plan's launch 3: c per row from the ranges' results
PHASE_MAX: tl.constexpr = Named(0)  # split launch 1: each range's max
PHASE_COUNT: tl.constexpr = Named(1)  # split launch 2: each range's counts and mass
PHASE_WRITE: tl.constexpr = Named(2)  # split launch 4: each range written, its smallest kept value


@dataclasses.dataclass(frozen=True)
class KeptSetLaunch:
    """Launch parameters of the kept-set kernels (every choice gives the same bits).

    block: elements per tile (a power of two); warps; max_registers per thread; programs_per_sm:
    persistent programs of the fused plan; buckets: bucket count of d (a power of two; fewer is cheaper
    per element, more gives narrower brackets); small, big: the two sizes of the sorted scratch row
    (powers of two; a bracket above big is bisected); pivots: keys tried per bisection pass;
    split_rows: the split plan for at most this many rows (0: never); split: programs per row in the
    split plan (0: enough to give each SM `programs_per_sm` programs, at most `max_split`).
    """

    block: int = 4096
    warps: int = 8
    max_registers: int = 128
    programs_per_sm: int = 2
    buckets: int = 128
    small: int = 256
    big: int = 4096
    pivots: int = 16
    split_rows: int = 64
    split: int = 0
    max_split: int = 64


@triton.jit
def _row_parameters(TOP_K, TOP_P, row, vocab, HAS_K: tl.constexpr, HAS_P: tl.constexpr):
    k = tl.full([], 0, tl.int64)
    p = tl.full([], 1.0, tl.float32)
    if HAS_K:
        k = tl.load(TOP_K + row).to(tl.int64)
    if HAS_P:
        p = tl.load(TOP_P + row).to(tl.float32)
    return k, p, (k > 0) & (k < vocab), p < 1.0


@triton.jit
def _is_active(row_max, k_on, p_on):
    return (row_max == row_max) & (tl.abs(row_max) != float("inf")) & (k_on | p_on)


@triton.jit
def kept_set_kernel(Z, stride, TOP_K, TOP_P, THRESHOLD, SCRATCH, MAXES, COUNTS, MASSES, CUTS, n_rows, vocab, rate,
                    q_scale, MODE: tl.constexpr, HAS_K: tl.constexpr, HAS_P: tl.constexpr, WRITE: tl.constexpr,
                    BLOCK: tl.constexpr, NB: tl.constexpr, SMALL_: tl.constexpr, BIG_: tl.constexpr,
                    PIVOTS_: tl.constexpr, SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr):
    """Rows pid, pid + programs, ...: fused, every pass here; select (split plan), c into CUTS (NaN for a
    row left alone) from the ranges' maxima (MAXES), counts (COUNTS) and masses (MASSES)."""
    pid = tl.program_id(0)
    scratch = SCRATCH + pid.to(tl.int64) * BIG_
    row = pid.to(tl.int64)
    while row < n_rows:
        row_ptr = Z + row * stride
        k, p, k_on, p_on = _row_parameters(TOP_K, TOP_P, row, vocab, HAS_K, HAS_P)
        if MODE == MODE_FUSED:
            row_max = range_max(row_ptr, 0, vocab, BLOCK)
        else:
            s = tl.arange(0, SPLIT_PAD)
            row_max = max_all(tl.load(MAXES + row * SPLIT + s, mask=s < SPLIT, other=float("-inf")))
        cut = tl.full([], float("nan"), tl.float32)
        if _is_active(row_max, k_on, p_on):
            if MODE == MODE_FUSED:
                counts, total = first_counts(row_ptr, 0, vocab, row_max, k_on, rate, q_scale, HAS_P, BLOCK, NB)
            else:
                at = (row * SPLIT + s)[:, None] * NB + tl.arange(0, NB)[None, :]
                counts = tl.sum(tl.load(COUNTS + at, mask=(s < SPLIT)[:, None], other=0), axis=0)
                total = tl.sum(tl.load(MASSES + row * SPLIT + s, mask=s < SPLIT, other=0))
            cut = cut_value(row_ptr, vocab, row_max, k, p, k_on, p_on, counts, total, scratch, rate, q_scale, HAS_K,
                            HAS_P, BLOCK, NB, SMALL_, BIG_, PIVOTS_)
        if MODE == MODE_FUSED:
            threshold = tl.full([], float("-inf"), tl.float32)
            if cut == cut:
                threshold = write_cut(row_ptr, 0, vocab, cut, WRITE, BLOCK)
            tl.store(THRESHOLD + row, threshold)
        else:
            tl.store(CUTS + row, cut)
        row += tl.num_programs(0)


@triton.jit
def kept_set_range_kernel(Z, stride, TOP_K, TOP_P, MAXES, COUNTS, MASSES, CUTS, SMALLEST, vocab, span, rate, q_scale,
                          PHASE: tl.constexpr, HAS_K: tl.constexpr, HAS_P: tl.constexpr, WRITE: tl.constexpr, BLOCK: tl.constexpr,
                          NB: tl.constexpr, SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr):
    """Program (row, r) of the split plan on columns [r span, (r + 1) span) of the row."""
    row = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    slot = row * SPLIT + r
    row_ptr = Z + row * stride
    lo = r * span
    hi = tl.minimum(lo + span, vocab)
    if PHASE == PHASE_MAX:
        tl.store(MAXES + slot, range_max(row_ptr, lo, hi, BLOCK))
    elif PHASE == PHASE_COUNT:
        s = tl.arange(0, SPLIT_PAD)
        row_max = max_all(tl.load(MAXES + row * SPLIT + s, mask=s < SPLIT, other=float("-inf")))
        _, _, k_on, p_on = _row_parameters(TOP_K, TOP_P, row, vocab, HAS_K, HAS_P)
        counts = tl.zeros([NB], tl.int32)
        total = tl.full([], 0, tl.int64)
        if _is_active(row_max, k_on, p_on):
            counts, total = first_counts(row_ptr, lo, hi, row_max, k_on, rate, q_scale, HAS_P, BLOCK, NB)
        tl.store(COUNTS + slot * NB + tl.arange(0, NB), counts)
        tl.store(MASSES + slot, total)
    else:
        cut = tl.load(CUTS + row)
        smallest = tl.full([], float("-inf"), tl.float32)
        if cut == cut:
            smallest = write_cut(row_ptr, lo, hi, cut, WRITE, BLOCK)
        tl.store(SMALLEST + slot, smallest)


@functools.lru_cache(maxsize=64)
def bucket_rate(bits: int, buckets: int) -> float:
    """Buckets per unit of d = M - z: the largest power of two with which the last bucket starts past
    d = F ln 2 + 1, where q(z) = 0."""
    return 2.0 ** math.floor(math.log2((buckets - 1) / (bits * math.log(2.0) + 1.0)))


def _slots(z: torch.Tensor, cfg: KeptSetLaunch) -> int:
    """Programs the device runs at once (the interpreter: INTERPRETER_SLOTS)."""
    return INTERPRETER_SLOTS if INTERPRET or not z.is_cuda else cfg.programs_per_sm * sm_count(z.device.index)


def split_count(z: torch.Tensor, cfg: KeptSetLaunch) -> int:
    """Programs per row of the split plan, 1 for the fused plan."""
    n, vocab = z.shape
    if n > cfg.split_rows:
        return 1
    wanted = cfg.split or min(cfg.max_split, triton.cdiv(_slots(z, cfg), n))
    return max(1, min(wanted, triton.cdiv(vocab, cfg.block)))


def kept_set(z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, bits: int,
             threshold: torch.Tensor, *, write: bool, launch: KeptSetLaunch = KeptSetLaunch()) -> None:
    """Fill `threshold` (fp32 [n]) with each row's smallest kept value of the [n, V] fp32 `z` (last
    dimension contiguous), and with `write` set z to -inf outside the kept set, in place.

    `top_k`: int32/int64 [n] or None; `top_p`: fp32 [n] or None (contiguous); `bits`: the fixed-point F
    (<= 62); `launch`: the launch parameters.
    """
    n, vocab = z.shape
    if top_k is None and top_p is None:
        threshold.fill_(float("-inf"))
        return
    if n == 0:
        return
    cfg = launch
    split = split_count(z, cfg)
    rate, q_scale = bucket_rate(bits, cfg.buckets), float(2.0**bits)
    common = {"BLOCK": cfg.block, "NB": cfg.buckets, "num_warps": cfg.warps, "enable_fp_fusion": False,
              "enable_reflect_ftz": False, **({} if INTERPRET else {"maxnreg": cfg.max_registers})}
    sizes = {"SMALL_": cfg.small, "BIG_": cfg.big, "PIVOTS_": cfg.pivots, "SPLIT": split,
             "SPLIT_PAD": triton.next_power_of_2(split)}
    flags = {"HAS_K": top_k is not None, "HAS_P": top_p is not None, "WRITE": write}
    with on_device(z):  # Triton launches on the current device's stream
        if split == 1:
            programs = n if INTERPRET or not z.is_cuda else max(1, min(n, _slots(z, cfg)))
            scratch = torch.empty((programs, cfg.big), dtype=torch.int32, device=z.device)
            kept_set_kernel[(programs,)](z, z.stride(0), top_k, top_p, threshold, scratch, None, None, None, None, n, vocab,
                                         rate, q_scale, MODE=MODE_FUSED.value, **flags, **sizes, **common)
            return
        maxes = torch.empty((n, split), dtype=torch.float32, device=z.device)
        counts = torch.empty((n, split, cfg.buckets), dtype=torch.int32, device=z.device)
        masses = torch.empty((n, split), dtype=torch.int64, device=z.device)
        cuts = torch.empty(n, dtype=torch.float32, device=z.device)
        smallest = torch.empty((n, split), dtype=torch.float32, device=z.device)
        scratch = torch.empty((n, cfg.big), dtype=torch.int32, device=z.device)
        span = triton.cdiv(triton.cdiv(vocab, split), cfg.block) * cfg.block
        ranges = (z, z.stride(0), top_k, top_p, maxes, counts, masses, cuts, smallest, vocab, span, rate, q_scale)
        range_sizes = {"SPLIT": split, "SPLIT_PAD": sizes["SPLIT_PAD"]}
        for phase in (PHASE_MAX, PHASE_COUNT):
            kept_set_range_kernel[(n, split)](*ranges, PHASE=phase.value, **flags, **range_sizes, **common)
        kept_set_kernel[(n,)](z, z.stride(0), top_k, top_p, threshold, scratch, maxes, counts, masses, cuts, n, vocab, rate,
                              q_scale, MODE=MODE_SELECT.value, **flags, **sizes, **common)
        kept_set_range_kernel[(n, split)](*ranges, PHASE=PHASE_WRITE.value, **flags, **range_sizes, **common)
        torch.amin(smallest, dim=1, out=threshold)
