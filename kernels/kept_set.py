"""The top-k / top-p kept set of `rl_logp.sampling_mask` in Triton kernels, without sorting a row.

The selection itself (per row: the exact max M, bucket counts of d = M - z, the top-k key and top-p cut
found from them, and the cut value c with kept set {z >= c}) is `kept_set_select`'s. Two launch plans,
the same bits:
- fused (many rows): one launch of `kept_set_kernel`, one persistent program per row at a time doing
  everything. With top-k on, a pivot guessed from a sample spread over the row (`pivot_key`) lets
  the pass that finds the max also compact every key at or above it; where that holds between k and
  `big` keys (the common case for k in the hundreds or less), the k-th key (and top-p chained on it) is
  found by sorting them: two passes over the row (max and compaction, write). Otherwise four passes
  (max, counts, compaction of the bracketed keys, write), the later ones from L2 where the row still
  is. One allocation: the programs' scratch rows.
- split (few rows, `KeptSetLaunch.split_rows`): four launches of `kept_set_range_kernel` (a draw with
  neither top-k nor top-p: the first and the last), each on `split` programs per row, one per column
  range: (1) the range's max (and the row's arrival counter zeroed); (2) the range's bucket counts and
  exact mass given the row max; (3) the range's keys in the row's bracket compacted into the row's
  scratch (at the range's offset, so in column order), with the exact mass before the bracket where
  top-p alone needs it; (4) the range written and its smallest kept value (and with a draw its best
  key). Each program of launches 2 to 4 counts its arrival on the row's counter with an atomic add; the
  last of a row to finish launch 2 sums the ranges' counts and masses (integers: order-free) and finds
  the row's bracket (`bracket`: the buckets holding the top-k key or the top-p cut) and each range's
  offset in the scratch; the last to finish launch 3 sorts the compacted keys and finds the row's c
  (`cut_value`; what is left serial there is a top-p after a top-k that did not resolve it, and a
  bracket over `big` keys, bisected); the last to finish launch 4 reduces the ranges' smallest kept
  values to the row's threshold (and their best keys to the row's draw). The atomics only count
  arrivals and every reduction is exact (max, min, integer sums), so which program comes last changes no
  bit. Every workspace is a section of one int32 allocation, sized by the shape (`row_words` per row).
  No program waits on another.
A last pass (`finish_range`) writes -inf outside the set (`write`), gives each row its smallest kept value
(the threshold `z >= threshold` that `rl_logp.sampling_mask` masks with; -inf for a row left alone: max
not finite, or k outside (0, V) with p >= 1 or NaN) and, with a draw (`draw`: the patched FlashInfer
sampler's), reads the row's exponential noise q beside z and keeps the kept column with the largest
z - log q: one pass over z and q for the draw, spread over the split plan's programs at few rows. No host
synchronisation, no data-dependent allocation, no torch op after the launches: capturable in a CUDA
graph. Launched without fp contraction and with libdevice's non-flushing exp, as the row-statistics
kernel is.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from .arrival import last_to_arrive, published
from .fixed_point import INTERPRET, Named, max_all
from .kept_set_select import (
    bracket,
    compact_bracket,
    cut_value,
    finish_range,
    first_counts,
    max_and_compact_above,
    pivot_cut,
    pivot_key,
    range_max,
)
from .launch import INTERPRETER_SLOTS, launch_options, on_device, sm_count
from .launcher import CachedLauncher

Draw = tuple[torch.Tensor, torch.Tensor]  # (noise fp32 [n, V], tokens int64 [n]) of a draw from the kept set

PHASE_MAX: tl.constexpr = Named(0)  # split launch 1: each range's max, the row's arrival counter zeroed
PHASE_COUNT: tl.constexpr = Named(1)  # split launch 2: each range's counts and mass; the bracket by the last
PHASE_CUT: tl.constexpr = Named(2)  # split launch 3: each range's bracketed keys compacted; c by the last
PHASE_WRITE: tl.constexpr = Named(3)  # split launch 4: each range written; the row's threshold by the last


@dataclasses.dataclass(frozen=True)
class KeptSetLaunch:
    """Launch parameters of the kept-set kernels (every choice gives the same bits).

    block: elements per tile (a power of two); warps; max_registers per thread; programs_per_sm:
    persistent programs of the fused plan; buckets: bucket count of d (a power of two; fewer is cheaper
    per element, more gives narrower brackets); small, big: the two sizes of the sorted scratch row
    (powers of two; a bracket above big is bisected); pivots: keys tried per bisection pass;
    split_rows: the split plan for at most this many rows (0: never); split: programs per row in the
    split plan (0: enough to give each SM `programs_per_sm` programs, at most `max_split`); sample:
    adjacent columns per group of the fused plan's top-k pivot sample (a power of two; 256 groups spread
    over the row, `kept_set_select.pivot_key`).
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
    sample: int = 64


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
def kept_set_kernel(Z, stride, TOP_K, TOP_P, THRESHOLD, SCRATCH, NOISE, stride_noise, TOKENS, n_rows, vocab, rate,
                    q_scale, HAS_K: tl.constexpr, HAS_P: tl.constexpr, WRITE: tl.constexpr, DRAW: tl.constexpr,
                    BLOCK: tl.constexpr, NB: tl.constexpr, SMALL_: tl.constexpr, BIG_: tl.constexpr,
                    PIVOTS_: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """The fused plan: rows pid, pid + programs, ... end to end, each with the program's scratch row."""
    pid = tl.program_id(0)
    scratch = SCRATCH + pid.to(tl.int64) * BIG_
    row = pid.to(tl.int64)
    while row < n_rows:
        row_ptr = Z + row * stride
        k, p, k_on, p_on = _row_parameters(TOP_K, TOP_P, row, vocab, HAS_K, HAS_P)
        pivoted = False  # a constant without top-k: the max pass alone
        if HAS_K:
            pivot = pivot_key(row_ptr, vocab, k, k_on, CHUNK, CHUNKS, BIG_)
            row_max, above_pivot = max_and_compact_above(row_ptr, vocab, pivot, scratch, BLOCK, BIG_)
            pivoted = k_on & (above_pivot >= k) & (above_pivot <= BIG_)
        else:
            row_max = range_max(row_ptr, 0, vocab, BLOCK)
            above_pivot = tl.full([], 0, tl.int32)
        threshold = tl.full([], float("-inf"), tl.float32)
        token = tl.full([], 0, tl.int32)
        if _is_active(row_max, k_on, p_on):
            if pivoted:
                cut = pivot_cut(scratch, above_pivot, k, p, p_on, row_max, q_scale, HAS_P, SMALL_, BIG_)
            else:
                counts, total = first_counts(row_ptr, 0, vocab, row_max, k_on, rate, q_scale, HAS_P, BLOCK, NB)
                first, last = bracket(k, p, k_on, p_on, counts, total, rate, q_scale, HAS_K, HAS_P, NB, BIG_)
                above = compact_bracket(row_ptr, 0, vocab, row_max, first, last, scratch, k_on, rate, q_scale, HAS_P,
                                        BLOCK, NB)
                cut = cut_value(row_ptr, vocab, row_max, k, p, k_on, p_on, counts, total, above, scratch, rate,
                                q_scale, HAS_K, HAS_P, False, BLOCK, NB, SMALL_, BIG_, PIVOTS_)
            threshold, _, token = finish_range(row_ptr, NOISE, row * stride_noise, 0, vocab, cut, WRITE, DRAW,
                                               BLOCK)
        elif DRAW:  # a row left alone draws from every column
            _, _, token = finish_range(row_ptr, NOISE, row * stride_noise, 0, vocab, float("-inf"), False, DRAW,
                                       BLOCK)
        if THRESHOLD is not None:
            tl.store(THRESHOLD + row, threshold)
        if DRAW:
            tl.store(TOKENS + row, token.to(tl.int64))
        row += tl.num_programs(0)


@triton.jit
def _row_workspace(WS, row, SPLIT: tl.constexpr, NB: tl.constexpr, BIG_: tl.constexpr, ROW_WORDS: tl.constexpr):
    """Typed pointers to the row's sections of the split plan's int32 workspace WS, ROW_WORDS (`row_words`)
    words a row: masses and the masses above the bracket (int64 [SPLIT] each, first, so 8-byte aligned),
    counts (int32 [SPLIT, NB]), scratch (int32 [BIG_]), maxes, smallest and the draw's best keys (fp32
    [SPLIT] each), the cut (fp32), the arrival counter, the bracket's first and last bucket, the ranges'
    offsets in the scratch and the draw's best columns (int32 [SPLIT] each)."""
    tl.static_assert(ROW_WORDS >= 9 * SPLIT + SPLIT * NB + BIG_ + 4)
    masses = WS + row * ROW_WORDS
    counts = masses + 4 * SPLIT
    scratch = counts + SPLIT * NB
    maxes = (scratch + BIG_).to(tl.pointer_type(tl.float32), bitcast=True)
    cut = maxes + 3 * SPLIT
    arrivals = (cut + 1).to(tl.pointer_type(tl.int32), bitcast=True)
    masses = masses.to(tl.pointer_type(tl.int64), bitcast=True)
    return (masses, masses + SPLIT, counts, scratch, maxes, maxes + SPLIT, maxes + 2 * SPLIT, cut, arrivals,
            arrivals + 1, arrivals + 3, arrivals + 3 + SPLIT)


@triton.jit
def kept_set_range_kernel(Z, stride, TOP_K, TOP_P, THRESHOLD, WS, NOISE, stride_noise, TOKENS, vocab, span, rate,
                          q_scale, PHASE: tl.constexpr, HAS_K: tl.constexpr, HAS_P: tl.constexpr, WRITE: tl.constexpr,
                          DRAW: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, SMALL_: tl.constexpr,
                          BIG_: tl.constexpr, PIVOTS_: tl.constexpr, SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr,
                          ROW_WORDS: tl.constexpr):
    """Program (row, r) of the split plan on columns [r span, (r + 1) span) of the row, launch PHASE."""
    row = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    row_ptr = Z + row * stride
    lo = r * span
    hi = tl.minimum(lo + span, vocab)
    masses, aboves, counts, scratch, maxes, smallest, bests, cuts, arrivals, brackets, offsets, best_cols = \
        _row_workspace(WS, row, SPLIT, NB, BIG_, ROW_WORDS)
    s = tl.arange(0, SPLIT_PAD)
    if PHASE == PHASE_MAX:
        tl.store(maxes + r, range_max(row_ptr, lo, hi, BLOCK))
        if r == 0:
            tl.store(arrivals, 0)
    elif PHASE == PHASE_WRITE:
        cut = tl.full([], float("nan"), tl.float32)  # a draw alone: launches 2 and 3 are not run
        if HAS_K or HAS_P:
            cut = tl.load(cuts)
        least = tl.full([], float("-inf"), tl.float32)
        best = tl.full([], float("-inf"), tl.float32)
        best_col = tl.full([], 0, tl.int32)
        if cut == cut:
            least, best, best_col = finish_range(row_ptr, NOISE, row * stride_noise, lo, hi, cut, WRITE, DRAW, BLOCK)
        elif DRAW:  # a row left alone draws from every column
            _, best, best_col = finish_range(row_ptr, NOISE, row * stride_noise, lo, hi, float("-inf"), False, DRAW,
                                             BLOCK)
        tl.store(smallest + r, least)
        if DRAW:
            tl.store(bests + r, best)
            tl.store(best_cols + r, best_col)
        if last_to_arrive(arrivals, (3 if HAS_K or HAS_P else 1) * SPLIT - 1):
            if THRESHOLD is not None:
                tl.store(THRESHOLD + row, tl.min(published(smallest + s, s < SPLIT, float("inf"))))
            if DRAW:  # the ranges' best keys: the largest, the smallest column holding it (ranges are ordered)
                keys = published(bests + s, s < SPLIT, float("-inf"))
                top = tl.max(keys)
                token = tl.min(tl.where((keys == top) & (s < SPLIT), published(best_cols + s, s < SPLIT, 0), vocab))
                tl.store(TOKENS + row, token.to(tl.int64))
    else:
        row_max = max_all(tl.load(maxes + s, mask=s < SPLIT, other=float("-inf")))
        k, p, k_on, p_on = _row_parameters(TOP_K, TOP_P, row, vocab, HAS_K, HAS_P)
        active = _is_active(row_max, k_on, p_on)
        at = s[:, None] * NB + tl.arange(0, NB)[None, :]
        if PHASE == PHASE_COUNT:
            range_counts = tl.zeros([NB], tl.int32)
            total = tl.full([], 0, tl.int64)
            if active:
                range_counts, total = first_counts(row_ptr, lo, hi, row_max, k_on, rate, q_scale, HAS_P, BLOCK, NB)
            tl.store(counts + r * NB + tl.arange(0, NB), range_counts)
            tl.store(masses + r, total)
            if last_to_arrive(arrivals, SPLIT - 1):  # the bracket, and where each range's keys in it go
                first = tl.full([], 1, tl.int32)
                last = tl.full([], 0, tl.int32)
                in_bracket = tl.zeros([SPLIT_PAD], tl.int32)
                if active:
                    each = published(counts + at, (s < SPLIT)[:, None], 0)
                    total = tl.sum(published(masses + s, s < SPLIT, 0))
                    first, last = bracket(k, p, k_on, p_on, tl.sum(each, axis=0), total, rate, q_scale, HAS_K, HAS_P,
                                          NB, BIG_)
                    b = tl.arange(0, NB)[None, :]
                    in_bracket = tl.sum(tl.where((b >= first) & (b <= last), each, 0), axis=1)
                tl.store(brackets, first)
                tl.store(brackets + 1, last)
                tl.store(offsets + s, tl.cumsum(in_bracket, 0) - in_bracket, mask=s < SPLIT)
        else:
            first = tl.load(brackets)
            last = tl.load(brackets + 1)
            above = compact_bracket(row_ptr, lo, hi, row_max, first, last, scratch + tl.load(offsets + r), k_on, rate,
                                    q_scale, HAS_P, BLOCK, NB)
            tl.store(aboves + r, above)
            if last_to_arrive(arrivals, 2 * SPLIT - 1):  # the row's c from every range's counts and keys
                cut = tl.full([], float("nan"), tl.float32)
                if active:
                    row_counts = tl.sum(published(counts + at, (s < SPLIT)[:, None], 0), axis=0)
                    total = tl.sum(published(masses + s, s < SPLIT, 0))
                    above = tl.sum(published(aboves + s, s < SPLIT, 0))
                    cut = cut_value(row_ptr, vocab, row_max, k, p, k_on, p_on, row_counts, total, above, scratch,
                                    rate, q_scale, HAS_K, HAS_P, True, BLOCK, NB, SMALL_, BIG_, PIVOTS_)
                tl.store(cuts, cut)


fused_launch = CachedLauncher(kept_set_kernel)  # Triton's launch with less host time (`launcher`)
range_launch = CachedLauncher(kept_set_range_kernel)


@functools.lru_cache(maxsize=64)
def bucket_rate(bits: int, buckets: int) -> float:
    """Buckets per unit of d = M - z: the largest power of two with which the last bucket starts past
    d = F ln 2 + 1, where q(z) = 0."""
    return 2.0 ** math.floor(math.log2((buckets - 1) / (bits * math.log(2.0) + 1.0)))


def _slots(z: torch.Tensor, cfg: KeptSetLaunch) -> int:
    """Programs the device runs at once (the interpreter: INTERPRETER_SLOTS)."""
    return INTERPRETER_SLOTS if INTERPRET or not z.is_cuda else cfg.programs_per_sm * sm_count(z.device.index)


def split_count(z: torch.Tensor, cfg: KeptSetLaunch) -> int:
    """Programs per row of the split plan, 1 for the fused plan. The split is a constexpr of the kernels,
    so the automatic one is a power of two: a handful of compiled variants serve every batch size a
    decode loop passes through (an explicit `cfg.split` is taken as given, up to the row's tiles)."""
    n, vocab = z.shape
    if n > cfg.split_rows:
        return 1
    tiles = triton.cdiv(vocab, cfg.block)
    if cfg.split:
        return max(1, min(cfg.split, tiles))
    wanted = min(cfg.max_split, triton.cdiv(_slots(z, cfg), n), tiles)
    return 1 << (wanted.bit_length() - 1)


def row_words(split: int, cfg: KeptSetLaunch) -> int:
    """int32 words of one row's workspace in the split plan (its sections: `_row_workspace`), rounded up to
    a multiple of 32 so that each row starts on a 128-byte line."""
    return triton.cdiv(9 * split + split * cfg.buckets + cfg.big + 4, 32) * 32


def _workspace_shape(z: torch.Tensor, split: int, cfg: KeptSetLaunch) -> tuple[int, ...]:
    """The int32 allocation of a call: the fused plan's scratch rows, or the split plan's row workspaces."""
    n = z.shape[0]
    if split == 1:
        return (n if INTERPRET or not z.is_cuda else max(1, min(n, _slots(z, cfg))), cfg.big)
    return (n * row_words(split, cfg),)


def _launches(z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, bits: int,
              threshold: torch.Tensor | None, workspace: torch.Tensor, write: bool, draw: Draw | None, split: int,
              cfg: KeptSetLaunch) -> list[tuple[CachedLauncher, tuple[int, ...], tuple]]:
    """(launcher, grid, arguments) of each launch of a call, in order, over its `workspace`."""
    n, vocab = z.shape
    rate, q_scale = bucket_rate(bits, cfg.buckets), float(2.0**bits)
    noise, tokens = draw if draw is not None else (None, None)
    sampling = (noise, 0 if noise is None else noise.stride(0), tokens)
    modes = (top_k is not None, top_p is not None, write, draw is not None, cfg.block, cfg.buckets, cfg.small, cfg.big,
             cfg.pivots)
    if split == 1:
        chunk = min(cfg.sample, 16)
        return [(fused_launch, (workspace.shape[0],), (z, z.stride(0), top_k, top_p, threshold, workspace, *sampling, n,
                                                       vocab, rate, q_scale, *modes, chunk, cfg.sample // chunk))]
    span = triton.cdiv(triton.cdiv(vocab, split), cfg.block) * cfg.block
    sizes = (split, triton.next_power_of_2(split), row_words(split, cfg))
    return [(range_launch, (n, split), (z, z.stride(0), top_k, top_p, threshold, workspace, *sampling, vocab, span, rate,
                                        q_scale, phase.value, *modes, *sizes))
            for phase in ((PHASE_MAX, PHASE_COUNT, PHASE_CUT, PHASE_WRITE) if top_k is not None or top_p is not None
                          else (PHASE_MAX, PHASE_WRITE))]


def kept_set(z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, bits: int,
             threshold: torch.Tensor | None, *, write: bool, draw: Draw | None = None,
             launch: KeptSetLaunch = KeptSetLaunch()) -> None:
    """Fill `threshold` (fp32 [n], or None) with each row's smallest kept value of the [n, V] fp32 `z` (last
    dimension contiguous), with `write` set z to -inf outside the kept set, in place, and with
    `draw = (noise, tokens)` write into `tokens` (int64 [n]) each row's draw from its kept set given its
    exponential `noise` (fp32 [n, V], last dimension contiguous): the kept column with the largest
    z - log(noise), the first on a tie (column 0 where no key is finite), in the same last pass.

    `top_k`: int32/int64 [n] or None; `top_p`: fp32 [n] or None (contiguous); `bits`: the fixed-point F
    (<= 62); `launch`: the launch parameters. One allocation and one launch (fused plan) or four (split;
    two for a draw alone); none where there is neither a top-k, a top-p nor a draw.
    """
    if top_k is None and top_p is None and draw is None:
        if threshold is not None:
            threshold.fill_(float("-inf"))
        return
    if z.shape[0] == 0:
        return
    split = split_count(z, launch)
    options = launch_options(launch.warps, False, launch.max_registers)  # exp not flushed, as the forward
    with on_device(z):  # Triton launches on the current device's stream
        workspace = torch.empty(_workspace_shape(z, split, launch), dtype=torch.int32, device=z.device)
        for launcher, grid, args in _launches(z, top_k, top_p, bits, threshold, workspace, write, draw, split, launch):
            launcher(grid, args, options)


def bind_kept_set(z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, bits: int,
                  threshold: torch.Tensor | None, *, write: bool, draw: Draw | None = None,
                  launch: KeptSetLaunch = KeptSetLaunch(),
                  direct: bool = False) -> Callable[[Sequence[torch.Tensor]], bool] | None:
    """`kept_set` of these arguments, after it ran, as a call for new tensors of the same shapes (a rollout's
    at every decode step): called with (z, top_k, top_p, threshold) or, drawing, (z, top_k, top_p, noise,
    tokens), the absent ones left out, it allocates the workspace and launches through `BoundLaunch`es
    (with `direct`, through the CUDA driver where they can: `launcher.DriverLaunch`), returning True, or False where one declined (the launches before it wrote only their own workspace: `z`,
    `threshold` and `tokens` are written by the last). None where the call launches nothing or a launch
    cannot be bound."""
    if (top_k is None and top_p is None and draw is None) or z.shape[0] == 0:
        return None
    split = split_count(z, launch)
    options = launch_options(launch.warps, False, launch.max_registers)
    shape = _workspace_shape(z, split, launch)
    workspace = torch.empty(shape, dtype=torch.int32, device=z.device)
    given = [t for t in (z, top_k, top_p, threshold, *(draw or ())) if t is not None] + [workspace]
    bound = []
    with on_device(z):
        for launcher, grid, args in _launches(z, top_k, top_p, bits, threshold, workspace, write, draw, split, launch):
            one = launcher.bind(grid, args, options, [next(i for i, a in enumerate(args) if a is t) for t in given],
                                direct=direct)
            if one is None:
                return None
            bound.append(one)
    device = z.device

    def run(tensors: Sequence[torch.Tensor]) -> bool:
        scratch = torch.empty(shape, dtype=torch.int32, device=device)
        return all(one((*tensors, scratch)) for one in bound)

    return run
