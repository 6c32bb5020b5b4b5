"""Launches of the forward and backward kernels: tensors and integers in, preallocated outputs written.

Launch parameters live in `LaunchConfig`, beside the launches that read them; every variant gives the
same bits. The defaults are the H200 measurements' choice (docs/performance.md). Each launch runs on the
current stream of the tensors' device, allocates nothing (the two-pass forward aside, which keeps the row
max in `out_max`), never syncs the host, and so can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import triton

from . import cluster_launch
from .fixed_point import (
    DIV_IEEE,
    DIV_RECIPROCAL,
    INTERPRET,
    MAX_SPLIT_BITS,
    QUANT_CAST,
    QUANT_SPLIT,
    SPLIT_HI_BITS,
    TEMP_NONE,
    TEMP_ROWS,
    split_constants,
)
from .grad import grad_kernel
from .launcher import BoundLaunch, CachedLauncher
from .row_stats import MAX_GIVEN, MAX_SCAN, RESULT_MAX, RESULT_ROW, RESULT_SUMS, row_stats_kernel
from .row_stats_ranges import PHASE_MAX, PHASE_SUMS, PHASE_WRITE, row_stats_range_kernel, row_words

INTERPRETER_SLOTS = 4  # programs the interpreter runs in place of a GPU's SMs
# The kernels' launchers (`launcher.CachedLauncher`: Triton's launch with less host time per call).
row_stats_launch = CachedLauncher(row_stats_kernel)
range_launch = CachedLauncher(row_stats_range_kernel)
grad_launch = CachedLauncher(grad_kernel)


def on_device(x: torch.Tensor):
    """A context making x's GPU current when it is not (Triton launches on the current device's stream)."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Launch parameters of the kernels (every variant gives the same bits).

    chunk: logits per tile of the forward (a power of two); lane: adjacent logits one lane sums in registers
    before its accumulator (a power of two dividing chunk); warps: per forward program; programs_per_sm:
    persistent forward programs per SM (0: one program per row); two_pass: the row max in a launch of its own, then the sums (both passes read the
    logits from HBM; the default re-reads each row right after scanning it, mostly from L2); quant:
    QUANT_SPLIT or QUANT_CAST (the split is used where it is exact); div: DIV_IEEE or DIV_RECIPROCAL (the
    IEEE quotient either way; the interpreter defaults to div_rn, the reference the reciprocal paths are
    tested against); maxnreg: a cap on the forward's registers per thread (0: the compiler's choice);
    split_rows: `row_stats` runs the split plan for at most this many rows (0: never) when the launches are
    captured in a CUDA graph, where they cost no host time at replay (eager, each of its two or three
    launches costs host time that a rollout-size call cannot spare, docs/performance.md), or always with
    split_eager (where the cluster forward, which comes first, is not taken); split: programs per row in
    it (0: enough to give each SM `split_per_sm` programs; at most one per tile either way); ftz:
    libdevice's flush-to-zero `exp` (torch's CUDA `exp` is not flushed: False keeps subnormal results the
    same bits); grad_block, grad_warps: the backward's tile and warps (its general path works in sub-tiles
    of four columns per thread, `grad_sub`); cluster_rows: `row_stats` calls captured in a CUDA graph of
    at least this many rows take the cluster forward (`cluster_launch`: one HBM read per row) where it
    applies (0: no call takes it, eager or captured; a call it does not apply to takes the Triton kernels,
    the same bits; 256: on an H100 it took less GPU time from 256 rows on, the Triton kernels at 1-64,
    `h100_calls_rollout*.json`, and GPU time is what a replay costs); cluster_rows_eager: the same for
    eager calls (0: none; 1: every size, where an eager call costs its host time more than its GPU time
    and the cluster launch through the driver costs less of it: on an H100 vLLM's V1 steps at 64 rows
    were 0.88-0.98x of unpatched with it against 0.96-1.11x from 256 rows, at 1-8 rows the same,
    `h100_rollout_vllm_0.24.0_v1_eager{1,256}.json`);
    cluster_threads, cluster_slice_bytes: its threads per block (whole warps, at most 1024) and the most
    bytes of a row one block holds; cluster_wait_ns: the suspend-time hint of its blocks' wait for their
    slice (0: none, the hardware's own limit between polls; at most 2^32 - 1); driver: the rollout plans'
    launches (`bind_row_stats`, and the kept set's `bind_kept_set` through `rl_logp.sampling_mask`) go through the
    CUDA driver itself where the kernel's parameters are known (`launcher.DriverLaunch`; off: on an H100 the launch alone was faster but vLLM's steps were not,
    `h100_rollout_vllm_0.24.0_driver.json`).
    """

    chunk: int = 4096
    lane: int = 8
    warps: int = 8
    programs_per_sm: int = 0
    two_pass: bool = False
    quant: int = QUANT_SPLIT.value
    div: int = DIV_IEEE.value if INTERPRET else DIV_RECIPROCAL.value
    maxnreg: int = 48
    split_rows: int = 64
    split_eager: bool = False
    split: int = 0
    split_per_sm: int = 2
    ftz: bool = False
    grad_block: int = 4096
    grad_warps: int = 4
    cluster_rows: int = 256
    cluster_rows_eager: int = 1
    cluster_threads: int = 256
    cluster_slice_bytes: int = 98304
    cluster_wait_ns: int = 0
    driver: bool = False

    def __post_init__(self) -> None:
        for name in ("cluster_rows", "cluster_rows_eager"):
            if getattr(self, name) < 0:
                raise ValueError(f"rl_logp: LaunchConfig.{name}={getattr(self, name)} must be >= 0 (rows; 0: never)")
        if self.cluster_threads % 32 or not 32 <= self.cluster_threads <= 1024:
            raise ValueError(f"rl_logp: LaunchConfig.cluster_threads={self.cluster_threads} must be a multiple "
                             "of 32 in [32, 1024] (whole warps, a block's most threads)")
        if not 0 <= self.cluster_wait_ns < 1 << 32:
            raise ValueError(f"rl_logp: LaunchConfig.cluster_wait_ns={self.cluster_wait_ns} must be in [0, 2^32) "
                             "(nanoseconds, a 32-bit hint; 0: none)")


@functools.lru_cache(maxsize=8)
def sm_count(device_index: int) -> int:
    """The GPU's SM count (persistent grids of this module and of `kept_set` size from it)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs(x: torch.Tensor, cfg: LaunchConfig) -> int:
    n = x.shape[0]
    if cfg.programs_per_sm == 0:
        return n
    slots = INTERPRETER_SLOTS if not x.is_cuda else cfg.programs_per_sm * sm_count(x.device.index)
    return max(1, min(n, slots))


@functools.lru_cache(maxsize=256)
def _quant(vocab: int, bits: int, chunk: int, lane: int, quant: int) -> int:
    """The split quantisation where its per-lane uint32 sums cannot wrap past their bias (see
    `fixed_point.lane_total`: a lane adds cdiv(V, chunk) * lane terms), else the plain conversion."""
    terms = triton.cdiv(max(vocab, 1), chunk) * lane
    if quant == QUANT_SPLIT.value and bits <= MAX_SPLIT_BITS and terms < 2 ** (32 - min(SPLIT_HI_BITS, bits // 2)):
        return QUANT_SPLIT.value
    return QUANT_CAST.value


@functools.lru_cache(maxsize=64)
def launch_options(warps: int, ftz: bool, maxnreg: int) -> dict:
    """The options of every launch of these kernels: no fp contraction, libdevice's `exp` flushed or not
    (`ftz`), a cap on the registers per thread (0: none; the interpreter takes none). One dict object per
    setting: the launcher keys on its text."""
    options = {"num_warps": warps, "enable_fp_fusion": False, "enable_reflect_ftz": ftz}
    if maxnreg and not INTERPRET:
        options["maxnreg"] = maxnreg
    return options


@functools.lru_cache(maxsize=256)
def _forward_settings(vocab: int, bits: int, entropy: bool, max_from: int, result: int, temp_mode: int,
                      cfg: LaunchConfig) -> tuple[tuple, dict]:
    """The trailing arguments of a forward launch (scalars and constexprs fixed by the row width and the
    settings) and its options: built once per settings, not at every call."""
    tail = (float(2.0**bits), 2.0**-bits, max_from, result, temp_mode, cfg.div, entropy, cfg.chunk, cfg.lane,
            _quant(vocab, bits, cfg.chunk, cfg.lane, cfg.quant), *split_constants(bits))
    return tail, launch_options(cfg.warps, cfg.ftz, cfg.maxnreg)


def forward_launch(x, labels, temp_mode, temp_rows, t_scalar, max_in, outs, sums, bits, entropy, max_from, result,
                   cfg, out_full=None) -> tuple[tuple[int], tuple, dict]:
    """(grid, positional arguments, options) of one `row_stats_kernel` launch."""
    n, vocab = x.shape
    picks = 1 if labels is None or labels.dim() == 1 else labels.shape[1]
    full_stride = 0 if out_full is None else out_full.stride(0)
    tail, options = _forward_settings(vocab, bits, entropy, max_from, result, temp_mode, cfg)
    args = (x, x.stride(0), labels, picks, temp_rows, t_scalar, max_in, *outs, *sums, out_full, full_stride, n, vocab,
            *tail)
    return (_programs(x, cfg),), args, options


@functools.lru_cache(maxsize=256)
def split_ranges(n: int, vocab: int, device_index: int | None, cfg: LaunchConfig) -> tuple[int, int]:
    """(ranges, span) of a row in `row_stats`: the split plan's programs per row and the columns of each
    (a multiple of the chunk; every range non-empty), or (1, vocab): whole rows (whether the split plan is
    wanted at all, eager or captured, is `row_stats`'s choice). `device_index`: the GPU's
    (None: the interpreter). The automatic split is a power of two before it is cut to the row's tiles:
    it is a constexpr of the kernel, so a handful of compiled variants serve every batch size."""
    tiles = triton.cdiv(vocab, cfg.chunk)
    if cfg.two_pass or not 0 < n <= cfg.split_rows or tiles < 2:
        return 1, vocab
    if cfg.split:
        wanted = cfg.split
    else:
        slots = INTERPRETER_SLOTS if device_index is None else cfg.split_per_sm * sm_count(device_index)
        wanted = 1 << (triton.cdiv(slots, n).bit_length() - 1)
    span_tiles = triton.cdiv(tiles, min(wanted, tiles))
    ranges = triton.cdiv(tiles, span_tiles)
    return (ranges, span_tiles * cfg.chunk) if ranges > 1 else (1, vocab)


@functools.lru_cache(maxsize=256)
def _range_settings(vocab: int, bits: int, entropy: bool, temp_mode: int, ranges: int,
                    cfg: LaunchConfig) -> tuple[tuple[tuple, ...], dict]:
    """The trailing arguments of the split plan's three launches (`row_stats_range_kernel`), and options."""
    _, options = _forward_settings(vocab, bits, entropy, MAX_SCAN.value, RESULT_ROW.value, temp_mode, cfg)
    quant = _quant(vocab, bits, cfg.chunk, cfg.lane, cfg.quant)
    sizes = (ranges, triton.next_power_of_2(ranges), row_words(ranges))
    tails = tuple((float(2.0**bits), 2.0**-bits, phase, temp_mode, cfg.div, entropy and phase == PHASE_SUMS.value,
                   cfg.chunk, cfg.lane, quant, *split_constants(bits), *sizes)
                  for phase in (PHASE_MAX.value, PHASE_SUMS.value, PHASE_WRITE.value))
    return tails, options


def _split_row_stats(x, labels, temp_mode, temp_rows, t_scalar, bits, entropy, outs, out_full, ranges, span,
                     cfg) -> None:
    n, vocab = x.shape
    tails, options = _range_settings(vocab, bits, entropy, temp_mode, ranges, cfg)
    workspace = torch.empty(n * row_words(ranges), dtype=torch.int32, device=x.device)
    picks = 1 if labels is None or labels.dim() == 1 else labels.shape[1]
    head = (x, x.stride(0), labels, picks, temp_rows, t_scalar, workspace, *outs, out_full,
            0 if out_full is None else out_full.stride(0), vocab, span)
    for tail in tails if out_full is not None else tails[:2]:
        range_launch((n, ranges), (*head, *tail), options)


def cluster_min_rows(cfg: LaunchConfig, captured: bool) -> int:
    """The fewest rows from which a `row_stats` call takes the cluster forward where it applies (0: never):
    `cfg.cluster_rows` for a call captured in a CUDA graph, `cfg.cluster_rows_eager` for an eager one; none
    with `cfg.cluster_rows` 0 or `cfg.two_pass`."""
    if not cfg.cluster_rows or cfg.two_pass:
        return 0
    return cfg.cluster_rows if captured else cfg.cluster_rows_eager


def _takes_cluster(x: torch.Tensor, labels: torch.Tensor | None, temp_mode: int, bits: int,
                   out_full: torch.Tensor | None, cfg: LaunchConfig, captured: bool) -> bool:
    """Whether `row_stats` takes the cluster forward: `cluster_min_rows` rows or more, where it applies."""
    rows = cluster_min_rows(cfg, captured)
    return bool(rows) and x.shape[0] >= rows and cluster_launch.applies(
        x, labels, temp_mode == TEMP_ROWS.value, bits, out_full, cfg.cluster_slice_bytes)


def row_stats(x: torch.Tensor, labels: torch.Tensor | None, temp_mode: int, temp_rows: torch.Tensor | None,
              t_scalar: float, bits: int, entropy: bool, out_max: torch.Tensor | None,
              out_log_sum: torch.Tensor | None, out_lse: torch.Tensor | None, out_logp: torch.Tensor | None,
              out_ent: torch.Tensor | None, cfg: LaunchConfig, out_full: torch.Tensor | None = None) -> None:
    """Rows of x [n, V]: write each output that is given (fp32 [n]): M, L, lse, logp of `labels`
    (int64 [n], or [n, K] contiguous with out_logp [n, K]; given with out_logp), with `entropy` the
    entropy, and into `out_full` (fp32 [n, V], last dimension contiguous) every column's logprob.
    `cfg.two_pass` needs out_max. Whole rows, or for at most `cfg.split_rows` rows, when captured in a CUDA
    graph (or with `cfg.split_eager`), the split plan; for at least `cluster_min_rows` rows, the cluster
    forward where it applies."""
    outs = (out_max, out_log_sum, out_lse, out_logp, out_ent)
    captured = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if _takes_cluster(x, labels, temp_mode, bits, out_full, cfg, captured):
        with on_device(x):
            cluster_launch.row_stats_cluster(x, labels, None if temp_mode == TEMP_NONE.value else t_scalar, entropy,
                                             outs, out_full, cfg.cluster_threads, cfg.cluster_slice_bytes,
                                             cfg.cluster_wait_ns)
        return
    ranges, span = 1, 0
    if x.shape[0] <= cfg.split_rows and (cfg.split_eager or captured):
        ranges, span = split_ranges(x.shape[0], x.shape[1], x.device.index if x.is_cuda else None, cfg)
    with on_device(x):
        if ranges > 1:
            _split_row_stats(x, labels, temp_mode, temp_rows, t_scalar, bits, entropy, outs, out_full, ranges, span,
                             cfg)
            return
        if cfg.two_pass:
            grid, args, options = forward_launch(x, None, temp_mode, temp_rows, t_scalar, None,
                                                 (out_max, None, None, None, None), (None, None), bits, False,
                                                 MAX_SCAN.value, RESULT_MAX.value, cfg)
            row_stats_launch(grid, args, options)
            grid, args, options = forward_launch(x, labels, temp_mode, temp_rows, t_scalar, out_max, outs,
                                                 (None, None), bits, entropy, MAX_GIVEN.value, RESULT_ROW.value, cfg,
                                                 out_full)
        else:
            grid, args, options = forward_launch(x, labels, temp_mode, temp_rows, t_scalar, None, outs, (None, None),
                                                 bits, entropy, MAX_SCAN.value, RESULT_ROW.value, cfg, out_full)
        row_stats_launch(grid, args, options)


def bind_row_stats(x: torch.Tensor, labels: torch.Tensor | None, temp_mode: int, t_scalar: float, bits: int,
                   out_logp: torch.Tensor | None, cfg: LaunchConfig,
                   out_full: torch.Tensor | None = None) -> BoundLaunch | cluster_launch.ClusterLaunch | None:
    """An eager `row_stats` of these arguments writing `out_logp` or `out_full` alone (no tensor temperature),
    as a `BoundLaunch` taking (x, labels, out) (labels given) or (x, out), or where `row_stats` takes the
    cluster forward its `ClusterLaunch` taking the same: for a caller that repeats the call with new
    tensors of the same shapes (a rollout, at every decode step). None where an eager `row_stats`
    would launch more than once (`cfg.two_pass`, the split plan with `cfg.split_eager`) or where the launch
    has not yet run (bind after a `row_stats` of these arguments: it compiled the kernel)."""
    n, vocab = x.shape
    if _takes_cluster(x, labels, temp_mode, bits, out_full, cfg, captured=False):
        with on_device(x):
            return cluster_launch.ClusterLaunch(x, labels, None if temp_mode == TEMP_NONE.value else t_scalar, False,
                                                (None, None, None, out_logp, None), out_full, cfg.cluster_threads,
                                                cfg.cluster_slice_bytes, cfg.cluster_wait_ns)
    if cfg.two_pass or (cfg.split_eager and split_ranges(n, vocab, x.device.index if x.is_cuda else None, cfg)[0] > 1):
        return None
    grid, args, options = forward_launch(x, labels, temp_mode, None, t_scalar, None, (None, None, None, out_logp, None),
                                         (None, None), bits, False, MAX_SCAN.value, RESULT_ROW.value, cfg, out_full)
    tensors = [t for t in (x, labels, out_logp, out_full) if t is not None]
    slots = [next(i for i, a in enumerate(args) if a is t) for t in tensors]
    with on_device(x):
        return row_stats_launch.bind(grid, args, options, slots, direct=cfg.driver)


def shard_max(x: torch.Tensor, temp_mode: int, temp_rows: torch.Tensor | None, t_scalar: float,
              out_max: torch.Tensor, cfg: LaunchConfig) -> None:
    """The row max of z over x's columns (fp32 [n], NaN for a NaN row or a bad row temperature)."""
    grid, args, options = forward_launch(x, None, temp_mode, temp_rows, t_scalar, None, (out_max, None, None, None, None),
                                         (None, None), 40, False, MAX_SCAN.value, RESULT_MAX.value, cfg)
    with on_device(x):
        row_stats_launch(grid, args, options)


def shard_sums(x: torch.Tensor, temp_mode: int, temp_rows: torch.Tensor | None, t_scalar: float,
               row_max: torch.Tensor, bits: int, entropy: bool, out_s: torch.Tensor, out_e: torch.Tensor | None,
               cfg: LaunchConfig) -> None:
    """S (and with `entropy` E) of x's columns given the row max, int64 [n] each."""
    grid, args, options = forward_launch(x, None, temp_mode, temp_rows, t_scalar, row_max, (None,) * 5, (out_s, out_e),
                                         bits, entropy, MAX_GIVEN.value, RESULT_SUMS.value, cfg)
    with on_device(x):
        row_stats_launch(grid, args, options)


def grad_sub(cfg: LaunchConfig) -> int:
    """Columns per sub-tile of the backward's general path: four per thread."""
    return min(cfg.grad_block, 4 * 32 * cfg.grad_warps)


def grad(x: torch.Tensor, out: torch.Tensor, labels: torch.Tensor | None, label_offset: int, vocab_total: int,
         temp_mode: int, temp_rows: torch.Tensor | None, t_scalar: float, row_max: torch.Tensor,
         log_sum: torch.Tensor, entropy: torch.Tensor | None, g_logp: torch.Tensor | None,
         g_entropy: torch.Tensor | None, cfg: LaunchConfig) -> None:
    """Write into `out` (may be x) the gradient of logp (g_logp given) and/or entropy (g_entropy given).
    `labels` are global column ids; x holds columns [label_offset, label_offset + c) of `vocab_total`."""
    n, vocab = x.shape
    has_lp, has_h = g_logp is not None, g_entropy is not None
    with on_device(x):
        grad_launch((n, triton.cdiv(vocab, cfg.grad_block)), (
            x, x.stride(0), out, out.stride(0), labels, label_offset, vocab_total, temp_rows, t_scalar,
            row_max, log_sum, entropy, g_logp, g_logp.stride(0) if has_lp else 0, g_entropy,
            g_entropy.stride(0) if has_h else 0, vocab, temp_mode, cfg.div, has_lp, has_h, cfg.grad_block,
            grad_sub(cfg)),
            launch_options(cfg.grad_warps, cfg.ftz, 0))

