"""The `fused` backend: Triton kernels for the invariant logp contract (see rl_logp/contract.py).

Forward (`_row_stats_kernel`): a persistent grid, one program per row at a time, two passes over the
row. Pass 1 takes the exact row max; pass 2 sums trunc(exp(z - M) * 2^F) in integers. One program per
SM keeps the rows in flight (132 x 297 KB at V=151936 bf16) inside the 60 MB L2, so pass 2 reads L2,
not HBM: the forward costs one HBM read of the logits. The same kernel computes a vocabulary shard's
max alone, or its fixed-point sum given the global max, for the vocab-parallel provider.

Integer sum: `QUANT_SPLIT` forms trunc(t * 2^F) as hi * 2^K + lo (K = F // 2) with two
round-toward-zero adds of 2^23 (exact: every step is an exact IEEE operation) and accumulates them in
wrapping uint32 lanes, which avoids a float-to-int64 conversion per element; `QUANT_CAST` is the plain
cast. Both give the same integers (F <= 44 for the split). Under the Triton interpreter the
round-toward-zero add is emulated with floor, which is the same function on its domain.

Backward (`_grad_kernel`): (onehot - exp(z - lse)) * g/T, row-local, streamed once; it may write into
the logits' own storage (inplace_backward). Exponentials use libdevice's accurate expf, the function
torch's CUDA `exp` uses, so the chunked torch path and this kernel agree bit for bit on a GPU.
All offsets are 64-bit; launches run on the current stream of the tensors' device.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from rl_logp.engine import LogpEngine

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
QUANT_CAST = 0
QUANT_SPLIT = 1
_RZ_BIAS: tl.constexpr = tl.constexpr(8388608.0)  # 2^23
_RZ_BIAS_BITS: tl.constexpr = tl.constexpr(0x4B000000)  # the fp32 bit pattern of 2^23

if INTERPRET:

    @triton.jit
    def _exact_exp(x):
        return tl.exp(x)

    @triton.jit
    def _biased_trunc(x):
        return tl.floor(x) + _RZ_BIAS

else:
    from triton.language.extra import libdevice

    @triton.jit
    def _exact_exp(x):
        return libdevice.exp(x)

    @triton.jit
    def _biased_trunc(x):
        # For 0 <= x < 2^23, x + 2^23 rounded toward zero is exactly trunc(x) + 2^23 (spacing 1 there).
        return libdevice.add_rz(x, _RZ_BIAS)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_stats_kernel(
    X,
    stride_x,
    TEMP,
    MAX_IN,
    MAX_OUT,
    SUM_OUT,
    n_rows,
    n_cols,
    n_programs,
    rows_per_program,
    scale_full,
    scale_hi,
    HAS_TEMP: tl.constexpr,
    PASS_MAX: tl.constexpr,
    PASS_SUM: tl.constexpr,
    QUANT: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    for i in range(0, rows_per_program):
        row = tl.program_id(0) + i * n_programs
        if row < n_rows:
            base = X + row.to(tl.int64) * stride_x
            if PASS_MAX:
                acc = tl.full([BLOCK], float("-inf"), tl.float32)
                for start in range(0, n_cols, BLOCK):
                    idx = start + cols
                    x = tl.load(base + idx, mask=idx < n_cols, other=float("-inf"), eviction_policy="evict_last")
                    acc = _max_nan(acc, x.to(tl.float32))
                row_max = tl.reduce(acc, 0, _max_nan)
                if HAS_TEMP:
                    # Correctly rounded division is monotonic, so max(x / T) == max(x) / T exactly.
                    row_max = tl.math.div_rn(row_max, tl.load(TEMP + row))
                tl.store(MAX_OUT + row, row_max)
            else:
                row_max = tl.load(MAX_IN + row)
            if PASS_SUM:
                shift = tl.where(row_max == float("-inf"), 0.0, row_max)
                if HAS_TEMP:
                    temp = tl.load(TEMP + row)
                if QUANT == 1:
                    acc_hi = tl.zeros([BLOCK], tl.uint32)
                    acc_lo = tl.zeros([BLOCK], tl.uint32)
                else:
                    acc_q = tl.zeros([BLOCK], tl.int64)
                n_iter = 0
                for start in range(0, n_cols, BLOCK):
                    idx = start + cols
                    x = tl.load(base + idx, mask=idx < n_cols, other=float("-inf"), eviction_policy="evict_first")
                    z = x.to(tl.float32)
                    if HAS_TEMP:
                        z = tl.math.div_rn(z, temp)
                    e = _exact_exp(z - shift)
                    if QUANT == 1:
                        a = e * scale_hi
                        hi_biased = _biased_trunc(a)
                        frac = (a - (hi_biased - _RZ_BIAS)) * (1 << SPLIT)
                        lo_biased = _biased_trunc(frac)
                        acc_hi += hi_biased.to(tl.uint32, bitcast=True)
                        acc_lo += lo_biased.to(tl.uint32, bitcast=True)
                    else:
                        acc_q += (e * scale_full).to(tl.int64)
                    n_iter += 1
                if QUANT == 1:
                    bias = n_iter.to(tl.uint32) * _RZ_BIAS_BITS
                    hi = (acc_hi - bias).to(tl.int64)
                    lo = (acc_lo - bias).to(tl.int64)
                    total = (tl.sum(hi, 0) << SPLIT) + tl.sum(lo, 0)
                else:
                    total = tl.sum(acc_q, 0)
                tl.store(SUM_OUT + row, total)


@triton.jit
def _grad_kernel(
    X,
    stride_x,
    DX,
    stride_dx,
    TEMP,
    LSE,
    LABELS,
    SCALE,
    n_cols,
    HAS_TEMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    z = tl.load(X + row * stride_x + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if HAS_TEMP:
        z = tl.math.div_rn(z, tl.load(TEMP + row))
    lse = tl.load(LSE + row)
    label = tl.load(LABELS + row)
    p = _exact_exp(z - lse)
    d = (tl.where(cols == label, 1.0, 0.0) - p) * tl.load(SCALE + row)
    d = tl.where(lse == float("inf"), 0.0, d)
    tl.store(DX + row * stride_dx + cols, d.to(DX.dtype.element_ty), mask=mask)


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Launch parameters; the benchmark sweeps them, the defaults are the measured best on an H200."""

    stats_block: int = 256 if INTERPRET else 4096
    stats_warps: int = 16
    programs_per_sm: int = 8
    quant: int = QUANT_CAST
    grad_block: int = 256 if INTERPRET else 4096
    grad_warps: int = 8


@functools.lru_cache(maxsize=8)
def _program_slots(device_index: int) -> int:
    if INTERPRET or device_index < 0:
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_guard(x: torch.Tensor):
    return torch.cuda.device(x.device) if x.is_cuda else _NullGuard()


class _NullGuard:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FusedEngine(LogpEngine):
    """Launches the Triton kernels above; same bits as `ChunkedEngine` on the same GPU."""

    name = "fused"

    def __init__(self, config: FusedConfig | None = None) -> None:
        self.config = config or FusedConfig()

    def _stats(self, x, temperature, row_max, bits, pass_max, pass_sum):
        n, vocab = x.shape
        cfg = self.config
        quant = QUANT_CAST if bits > 44 else cfg.quant
        split = bits // 2
        max_out = torch.empty(n, dtype=torch.float32, device=x.device) if pass_max else None
        sum_out = torch.empty(n, dtype=torch.int64, device=x.device) if pass_sum else None
        slots = _program_slots(x.device.index if x.is_cuda else -1) * cfg.programs_per_sm
        programs = max(1, min(n, slots))
        with _device_guard(x):
            _row_stats_kernel[(programs,)](
                x,
                x.stride(0),
                temperature,
                row_max,
                max_out,
                sum_out,
                n,
                vocab,
                programs,
                triton.cdiv(n, programs),
                float(2.0**bits),
                float(2.0 ** (bits - split)),
                HAS_TEMP=temperature is not None,
                PASS_MAX=pass_max,
                PASS_SUM=pass_sum,
                QUANT=quant,
                SPLIT=split,
                BLOCK=cfg.stats_block,
                num_warps=cfg.stats_warps,
            )
        return max_out, sum_out

    def row_max(self, x: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
        if x.shape[1] == 0:
            return torch.full((x.shape[0],), float("-inf"), dtype=torch.float32, device=x.device)
        return self._stats(x, temperature, None, 40, True, False)[0]

    def fixed_sum(
        self, x: torch.Tensor, temperature: torch.Tensor | None, row_max: torch.Tensor, bits: int
    ) -> torch.Tensor:
        if x.shape[1] == 0:
            return torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
        return self._stats(x, temperature, row_max.contiguous(), bits, False, True)[1]

    def row_stats(
        self, x: torch.Tensor, temperature: torch.Tensor | None, bits: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._stats(x, temperature, None, bits, True, True)

    def grad(
        self,
        x: torch.Tensor,
        temperature: torch.Tensor | None,
        lse_for_grad: torch.Tensor,
        local_labels: torch.Tensor,
        grad_scale: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        n, vocab = x.shape
        if n == 0 or vocab == 0:
            return
        cfg = self.config
        with _device_guard(x):
            _grad_kernel[(n, triton.cdiv(vocab, cfg.grad_block))](
                x,
                x.stride(0),
                out,
                out.stride(0),
                temperature,
                lse_for_grad.contiguous(),
                local_labels.contiguous(),
                grad_scale.contiguous(),
                vocab,
                HAS_TEMP=temperature is not None,
                BLOCK=cfg.grad_block,
                num_warps=cfg.grad_warps,
            )
