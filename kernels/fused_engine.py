"""`FusedEngine`: the `fused` backend, launching the Triton kernels of `fused_forward` and `fused_backward`.

Launch parameters live in `FusedConfig` (the benchmark sweeps them; the defaults are the measured best
on an H200, see docs/performance.md). Every launch runs on the current stream of the tensors' device,
allocates only its outputs and one zeroed int64 workspace of 4 words per row, never syncs the host, and
so can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import struct

import torch
import triton

from rl_logp.engine import LogpEngine, RowStats
from rl_logp.temperature import Temperature

from .fused_backward import launch_grad
from .fused_forward import (
    ACC_WORDS,
    DIV_IEEE,
    DIV_RECIPROCAL,
    INTERPRET,
    QUANT_CAST,
    QUANT_SPLIT,
    SPLIT_HI_BITS,
    TEMP_NONE,
    TEMP_ROWS,
    TEMP_SCALAR,
    _row_pipeline_kernel,
    _row_stats_kernel,
)

MAX_SPLIT_BITS = 40  # the split quantisation: trunc(t 2^20) and the remaining F - 20 <= 20 bits


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Launch parameters of the fused kernels; every variant gives the same bits. The defaults are the
    H200 autotune's choice (benchmarks/results/h200_autotune.json, docs/performance.md).

    seg: logits per work item of `_row_stats_kernel` (a row is cut into cdiv(V, seg) items); chunk:
    logits loaded at once (chunk == seg keeps the item in registers between max and sums; smaller chunks
    stream it twice, the second time from L2); width: columns of one tile row; warps: per program;
    programs_per_sm: programs taking tickets per SM (0: one program per work item); sync: max and sums
    in one launch (False: two launches, as the interpreter needs); quant: QUANT_SPLIT or QUANT_CAST;
    div: DIV_IEEE or DIV_RECIPROCAL (the IEEE quotient either way; the interpreter's fma is not fused,
    so it divides with div_rn); ftz: libdevice's flush-to-zero `exp` (torch's CUDA `exp` is not
    flushed: False keeps subnormal results the same bits).
    From `pipeline_min_rows` rows on, whole rows go to `_row_pipeline_kernel` instead (off by default:
    slower than the segmented kernel on the H200 at T != 1): `pipeline_programs_per_sm` programs per SM
    (the interpreter counts 4 SMs) of `pipeline_warps` warps, `pipeline_chunk` logits per load,
    `pipeline_stages` software-pipeline stages. grad_block, grad_warps: the backward's tile and warps.
    """

    seg: int = 8192
    chunk: int = 2048
    width: int = 2048
    warps: int = 4
    programs_per_sm: int = 0
    sync: bool = not INTERPRET
    quant: int = QUANT_SPLIT
    div: int = DIV_IEEE if INTERPRET else DIV_RECIPROCAL
    ftz: bool = False
    pipeline_min_rows: int = 1 << 62
    pipeline_chunk: int = 8192
    pipeline_warps: int = 16
    pipeline_programs_per_sm: int = 1
    pipeline_stages: int = 1
    grad_block: int = 4096
    grad_warps: int = 8


TUNING_VARIABLE = "RL_LOGP_FUSED_CONFIG"


def config_from_environment() -> FusedConfig:
    """`FusedConfig()` with the overrides of RL_LOGP_FUSED_CONFIG, a JSON object of its fields (a tuning
    knob for other GPUs; every variant gives the same bits). Unknown fields or types are an error."""
    raw = os.environ.get(TUNING_VARIABLE)
    if not raw:
        return FusedConfig()
    try:
        overrides = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"rl_logp: {TUNING_VARIABLE}={raw!r} is not JSON ({err})") from None
    fields = {f.name: f for f in dataclasses.fields(FusedConfig)}
    if not isinstance(overrides, dict) or set(overrides) - set(fields):
        raise ValueError(f"rl_logp: {TUNING_VARIABLE} must be a JSON object with keys among {sorted(fields)}, got {raw!r}")
    for key, value in overrides.items():
        if type(value) is not type(getattr(FusedConfig, key)):
            raise ValueError(f"rl_logp: {TUNING_VARIABLE}: {key}={value!r} must be a {type(getattr(FusedConfig, key)).__name__}")
    return FusedConfig(**overrides)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=16)
def split_constants(bits: int, hi_bits: int) -> dict:
    """The biases of `split_terms`, 2^(23-K) and 2^(23-F), and their fp32 bit patterns."""
    hi_bias, lo_bias = 2.0 ** (23 - hi_bits), 2.0 ** (23 - bits)
    return {
        "HI_BIAS": hi_bias,
        "LO_BIAS": lo_bias,
        "LO_BITS": bits - hi_bits,
        "HI_PATTERN": struct.unpack("<I", struct.pack("<f", hi_bias))[0],
        "LO_PATTERN": struct.unpack("<I", struct.pack("<f", lo_bias))[0],
    }


def _on_device(x: torch.Tensor):
    """Make x's GPU current for the launch (Triton launches on the current device's stream)."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


def _temp_args(temp: Temperature) -> tuple[int, torch.Tensor | None, float]:
    if temp.rows is not None:
        return TEMP_ROWS, temp.rows, 1.0
    return (TEMP_NONE if temp.scalar == 1.0 else TEMP_SCALAR), None, temp.scalar


class FusedEngine(LogpEngine):
    """Same bits as `ChunkedEngine` on the same GPU (see the module docstrings of the kernels)."""

    name = "fused"

    def __init__(self, config: FusedConfig | None = None) -> None:
        self.config = config or config_from_environment()

    def _launch(self, x, temp, labels, bits, *, phase, finalize, logp, entropy, max_in=None, ticket_slot=0,
                ws=None, part_max=None, outs=None):
        n, vocab = x.shape
        cfg = self.config
        n_seg = triton.cdiv(vocab, cfg.seg)
        quant = cfg.quant if bits <= MAX_SPLIT_BITS else QUANT_CAST
        hi_bits = min(SPLIT_HI_BITS, bits // 2)
        temp_mode, temp_rows, t_scalar = _temp_args(temp)
        items = n * n_seg
        programs = items
        if cfg.programs_per_sm and x.is_cuda:
            programs = min(items, cfg.programs_per_sm * _sm_count(x.device.index))
        width = min(cfg.width, cfg.chunk)
        out_max, out_log_sum, out_lse, out_logp, out_ent = outs
        with _on_device(x):
            _row_stats_kernel[(max(1, programs),)](
                x, x.stride(0), labels, temp_rows, t_scalar,
                ws, part_max, max_in,
                out_max, out_log_sum, out_lse, out_logp, out_ent,
                n, vocab, n_seg, ticket_slot,
                float(2.0**bits), 2.0**-bits,
                TEMP_MODE=temp_mode, DIV=cfg.div, PHASE=phase, FINALIZE=finalize, LOGP=logp, ENTROPY=entropy,
                MAX_FROM_INPUT=max_in is not None,
                SEG=cfg.seg, CHUNK=cfg.chunk, WIDTH=width, NSEG_POW2=triton.next_power_of_2(n_seg),
                QUANT=quant, **split_constants(bits, hi_bits),
                num_warps=cfg.warps, enable_fp_fusion=False, enable_reflect_ftz=cfg.ftz,
            )

    def _launch_pipeline(self, x, temp, labels, bits, entropy, outs):
        n, vocab = x.shape
        cfg = self.config
        quant = cfg.quant if bits <= MAX_SPLIT_BITS else QUANT_CAST
        temp_mode, temp_rows, t_scalar = _temp_args(temp)
        width = min(cfg.width, cfg.pipeline_chunk)
        slots = _sm_count(x.device.index) if x.is_cuda else 4
        programs = min(n, cfg.pipeline_programs_per_sm * slots)
        with _on_device(x):
            _row_pipeline_kernel[(programs,)](
                x, x.stride(0), labels, temp_rows, t_scalar, *outs, n, vocab, float(2.0**bits), 2.0**-bits,
                TEMP_MODE=temp_mode, DIV=cfg.div, LOGP=labels is not None, ENTROPY=entropy,
                CHUNK=cfg.pipeline_chunk, WIDTH=width, STAGES=cfg.pipeline_stages, QUANT=quant,
                **split_constants(bits, min(SPLIT_HI_BITS, bits // 2)),
                num_warps=cfg.pipeline_warps, enable_fp_fusion=False, enable_reflect_ftz=cfg.ftz,
            )

    def _workspace(self, x):
        n, vocab = x.shape
        ws = torch.zeros(ACC_WORDS * n + 2, dtype=torch.int64, device=x.device)
        part_max = torch.empty(n * triton.cdiv(vocab, self.config.seg), dtype=torch.float32, device=x.device)
        return ws, part_max

    def row_stats(
        self, x: torch.Tensor, temp: Temperature, labels: torch.Tensor | None, bits: int, entropy: bool
    ) -> RowStats:
        n = x.shape[0]

        def out() -> torch.Tensor:  # separate tensors: a custom op's outputs may not alias each other
            return torch.empty(n, dtype=torch.float32, device=x.device)

        outs = (out(), out(), out(), out() if labels is not None else None, out() if entropy else None)
        if n >= self.config.pipeline_min_rows:
            self._launch_pipeline(x, temp, labels, bits, entropy, outs)
            return RowStats(row_max=outs[0], log_sum=outs[1], lse=outs[2], logp=outs[3], entropy=outs[4])
        ws, part_max = self._workspace(x)
        flags = {"logp": labels is not None, "entropy": entropy, "ws": ws, "part_max": part_max, "outs": outs}
        if self.config.sync:
            self._launch(x, temp, labels, bits, phase=3, finalize=True, **flags)
        else:
            self._launch(x, temp, labels, bits, phase=1, finalize=False, **flags)
            self._launch(x, temp, labels, bits, phase=2, finalize=True, ticket_slot=1, **flags)
        return RowStats(row_max=outs[0], log_sum=outs[1], lse=outs[2], logp=outs[3], entropy=outs[4])

    def shard_max(self, x: torch.Tensor, temp: Temperature) -> torch.Tensor:
        n = x.shape[0]
        row_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=x.device)
        if x.shape[1] == 0 or n == 0:
            return row_max
        ws, part_max = self._workspace(x)
        self._launch(x, temp, None, 40, phase=1, finalize=True, logp=False, entropy=False, ws=ws,
                     part_max=part_max, outs=(row_max, None, None, None, None))
        return row_max

    def shard_sums(
        self, x: torch.Tensor, temp: Temperature, row_max: torch.Tensor, bits: int, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = x.shape[0]
        ws, part_max = self._workspace(x)
        if x.shape[1] and n:
            self._launch(x, temp, None, bits, phase=2, finalize=False, logp=False, entropy=entropy,
                         max_in=row_max.contiguous(), ws=ws, part_max=part_max, outs=(None,) * 5)
        acc = ws[: ACC_WORDS * n].view(n, ACC_WORDS)
        return acc[:, 0].contiguous(), (acc[:, 1].contiguous() if entropy else None)

    def grad(
        self,
        x: torch.Tensor,
        temp: Temperature,
        labels: torch.Tensor | None,
        label_offset: int,
        vocab_total: int,
        row_max: torch.Tensor,
        log_sum: torch.Tensor,
        entropy: torch.Tensor | None,
        g_logp: torch.Tensor | None,
        g_entropy: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        n, vocab = x.shape
        if n == 0 or vocab == 0:
            return
        temp_mode, temp_rows, t_scalar = _temp_args(temp)
        with _on_device(x):
            launch_grad(x, out, labels, label_offset, vocab_total, temp_mode, temp_rows, t_scalar, row_max,
                        log_sum, entropy, g_logp, g_entropy, self.config.grad_block, self.config.grad_warps,
                        self.config.div, self.config.ftz)
