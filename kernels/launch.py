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

from .fixed_point import (
    DIV_IEEE,
    DIV_RECIPROCAL,
    INTERPRET,
    MAX_SPLIT_BITS,
    QUANT_CAST,
    QUANT_SPLIT,
    SPLIT_HI_BITS,
    split_constants,
)
from .grad import grad_kernel
from .row_stats import MAX_GIVEN, MAX_SCAN, RESULT_MAX, RESULT_ROW, RESULT_SUMS, row_stats_kernel

INTERPRETER_SLOTS = 4  # programs the interpreter runs in place of a GPU's SMs


def on_device(x: torch.Tensor):
    """A context making x's GPU current when it is not (Triton launches on the current device's stream)."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Launch parameters of the kernels (every variant gives the same bits).

    chunk: logits per tile of the forward (a power of two); lane: adjacent logits one lane sums in registers
    before its accumulator (a power of two dividing chunk); warps: per forward program; programs_per_sm: persistent forward programs per SM (0: one
    program per row); two_pass: the row max in a launch of its own, then the sums (both passes read the
    logits from HBM; the default re-reads each row right after scanning it, mostly from L2); quant:
    QUANT_SPLIT or QUANT_CAST (the split is used where it is exact); div: DIV_IEEE or DIV_RECIPROCAL (the
    IEEE quotient either way; the interpreter defaults to div_rn, the reference the reciprocal paths are
    tested against); maxnreg: a cap on the forward's registers per thread (0: the compiler's choice); ftz:
    libdevice's flush-to-zero `exp` (torch's CUDA `exp` is not flushed: False keeps subnormal results the
    same bits); grad_block, grad_warps: the backward's tile and warps.
    """

    chunk: int = 4096
    lane: int = 8
    warps: int = 8
    programs_per_sm: int = 0
    two_pass: bool = False
    quant: int = QUANT_SPLIT.value
    div: int = DIV_IEEE.value if INTERPRET else DIV_RECIPROCAL.value
    maxnreg: int = 48
    ftz: bool = False
    grad_block: int = 4096
    grad_warps: int = 4


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


@functools.lru_cache(maxsize=256)
def _forward_settings(vocab: int, bits: int, entropy: bool, max_from: int, result: int, temp_mode: int,
                      cfg: LaunchConfig) -> tuple[tuple, dict]:
    """The trailing arguments of a forward launch (scalars and constexprs fixed by the row width and the
    settings) and its options: built once per settings, not at every call."""
    tail = (float(2.0**bits), 2.0**-bits, max_from, result, temp_mode, cfg.div, entropy, cfg.chunk, cfg.lane,
            _quant(vocab, bits, cfg.chunk, cfg.lane, cfg.quant), *split_constants(bits))
    options = {"num_warps": cfg.warps, "enable_fp_fusion": False, "enable_reflect_ftz": cfg.ftz}
    if cfg.maxnreg and not INTERPRET:
        options["maxnreg"] = cfg.maxnreg
    return tail, options


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


def row_stats(x: torch.Tensor, labels: torch.Tensor | None, temp_mode: int, temp_rows: torch.Tensor | None,
              t_scalar: float, bits: int, entropy: bool, out_max: torch.Tensor | None,
              out_log_sum: torch.Tensor | None, out_lse: torch.Tensor | None, out_logp: torch.Tensor | None,
              out_ent: torch.Tensor | None, cfg: LaunchConfig, out_full: torch.Tensor | None = None) -> None:
    """Whole rows of x [n, V]: write each output that is given (fp32 [n]): M, L, lse, logp of `labels`
    (int64 [n], or [n, K] contiguous with out_logp [n, K]; given with out_logp), with `entropy` the
    entropy, and into `out_full` (fp32 [n, V], last dimension contiguous) every column's logprob.
    `cfg.two_pass` needs out_max."""
    outs = (out_max, out_log_sum, out_lse, out_logp, out_ent)
    with on_device(x):
        if cfg.two_pass:
            grid, args, options = forward_launch(x, None, temp_mode, temp_rows, t_scalar, None,
                                                 (out_max, None, None, None, None), (None, None), bits, False,
                                                 MAX_SCAN.value, RESULT_MAX.value, cfg)
            row_stats_kernel[grid](*args, **options)
            grid, args, options = forward_launch(x, labels, temp_mode, temp_rows, t_scalar, out_max, outs,
                                                 (None, None), bits, entropy, MAX_GIVEN.value, RESULT_ROW.value, cfg,
                                                 out_full)
        else:
            grid, args, options = forward_launch(x, labels, temp_mode, temp_rows, t_scalar, None, outs, (None, None),
                                                 bits, entropy, MAX_SCAN.value, RESULT_ROW.value, cfg, out_full)
        row_stats_kernel[grid](*args, **options)


def shard_max(x: torch.Tensor, temp_mode: int, temp_rows: torch.Tensor | None, t_scalar: float,
              out_max: torch.Tensor, cfg: LaunchConfig) -> None:
    """The row max of z over x's columns (fp32 [n], NaN for a NaN row or a bad row temperature)."""
    grid, args, options = forward_launch(x, None, temp_mode, temp_rows, t_scalar, None, (out_max, None, None, None, None),
                                         (None, None), 40, False, MAX_SCAN.value, RESULT_MAX.value, cfg)
    with on_device(x):
        row_stats_kernel[grid](*args, **options)


def shard_sums(x: torch.Tensor, temp_mode: int, temp_rows: torch.Tensor | None, t_scalar: float,
               row_max: torch.Tensor, bits: int, entropy: bool, out_s: torch.Tensor, out_e: torch.Tensor | None,
               cfg: LaunchConfig) -> None:
    """S (and with `entropy` E) of x's columns given the row max, int64 [n] each."""
    grid, args, options = forward_launch(x, None, temp_mode, temp_rows, t_scalar, row_max, (None,) * 5, (out_s, out_e),
                                         bits, entropy, MAX_GIVEN.value, RESULT_SUMS.value, cfg)
    with on_device(x):
        row_stats_kernel[grid](*args, **options)


def grad(x: torch.Tensor, out: torch.Tensor, labels: torch.Tensor | None, label_offset: int, vocab_total: int,
         temp_mode: int, temp_rows: torch.Tensor | None, t_scalar: float, row_max: torch.Tensor,
         log_sum: torch.Tensor, entropy: torch.Tensor | None, g_logp: torch.Tensor | None,
         g_entropy: torch.Tensor | None, cfg: LaunchConfig) -> None:
    """Write into `out` (may be x) the gradient of logp (g_logp given) and/or entropy (g_entropy given).
    `labels` are global column ids; x holds columns [label_offset, label_offset + c) of `vocab_total`."""
    n, vocab = x.shape
    has_lp, has_h = g_logp is not None, g_entropy is not None
    with on_device(x):
        grad_kernel[(n, triton.cdiv(vocab, cfg.grad_block))](
            x, x.stride(0), out, out.stride(0), labels, label_offset, vocab_total, temp_rows, t_scalar,
            row_max, log_sum, entropy, g_logp, g_logp.stride(0) if has_lp else 0, g_entropy,
            g_entropy.stride(0) if has_h else 0, vocab,
            TEMP_MODE=temp_mode, DIV=cfg.div, LOGP=has_lp, ENTROPY=has_h, BLOCK=cfg.grad_block,
            num_warps=cfg.grad_warps, enable_fp_fusion=False, enable_reflect_ftz=cfg.ftz,
        )

