"""The batch-invariant matmul: `out[i, j] (+)= sum_t a[i, t] * b[t, j]` with one fixed launch configuration.

Every output element is the fp32 reduction of its own row of `a` and column of `b`, in steps of `block_k`
taken in increasing `t`, by the same instruction sequence whatever the shapes: the tile sizes, warps and
stages come from the operands' dtype alone (`CONFIGS`), never from the number of rows or columns, there is
no split over `t` and no atomics. So an element's bits do not depend on how many rows or columns the call
has, where they sit, or where a caller cut them. Zero padding at the tails adds exact zeros.

With `accumulate`, `out` is an fp32 buffer the kernel loads as its starting accumulator and stores back:
calls over consecutive slices of `t` whose boundaries are multiples of `ALIGN` give exactly the bits of one
call over all of `t` (the accumulator is the same fp32 value in registers or in memory). Without it the
accumulator starts at zero and is stored in `out`'s dtype (round to nearest, as torch's `.to`).

The three products of a linear layer are this one kernel on strided views: logits `h @ W.T` (a = h,
b = W.T), `grad_h = g @ W` and `grad_W = g.T @ h`. Triton specialises a stride of 1, so each view's
contiguous dimension is known when it compiles. fp32 operands multiply in IEEE fp32 (no TF32), as torch's
default matmul does. Under Triton's interpreter (the CPU) a tile product is a sum over the tile's `t`, in
increasing `t` for every element, of outer products of a column of `a` and a row of `b` widened to fp32
(exact; the interpreter would multiply bf16 tiles' raw bit patterns): numpy's matmul (OpenBLAS) gives an
element bits that depend on its row's place in the tile on some CPUs. A 16-bit output is accumulated in
fp32 and rounded by torch (the interpreter's downcast does not round to nearest even). So the CPU checks
the kernel's logic and invariances, not the GPU's bits.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from .fixed_point import INTERPRET
from .launch import on_device


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """One fixed launch configuration (tile sizes, warps, software-pipelining stages)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    group_m: int = 8  # programs ordered in groups of block rows for L2 reuse (does not change bits)


# By operand element size: Hopper's wgmma tile for 16-bit operands; half the K step for fp32 (shared memory).
CONFIGS = {
    2: MatmulConfig(block_m=128, block_n=256, block_k=64, warps=8, stages=3),
    4: MatmulConfig(block_m=128, block_n=128, block_k=32, warps=8, stages=3),
}
# A multiple of every block size above: slices cut at multiples of it keep every element's tile position
# and every reduction step.
ALIGN = math.lcm(*(size for c in CONFIGS.values() for size in (c.block_m, c.block_n, c.block_k)))


@triton.jit
def matmul_kernel(
    A, B, C, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    ACCUMULATE: tl.constexpr, EVEN_K: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Rows and columns past the end read wrapped-around ones (always in bounds); their results are not stored.
    am = (rm % M).to(tl.int64)
    bn = (rn % N).to(tl.int64)
    a_ptrs = A + am[:, None] * stride_am + rk[None, :].to(tl.int64) * stride_ak
    b_ptrs = B + rk[:, None].to(tl.int64) * stride_bk + bn[None, :] * stride_bn
    c_ptrs = C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :].to(tl.int64) * stride_cn
    c_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ACCUMULATE:
        acc = tl.load(c_ptrs, mask=c_mask, other=0.0)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if INTERPRETED:  # see the module docstring: one outer product of a column and a row per t
            for kk in range(0, BLOCK_K):
                t = k * BLOCK_K + kk
                a_col = tl.load(A + am * stride_am + t * stride_ak, mask=t < K, other=0.0).to(tl.float32)
                b_row = tl.load(B + t * stride_bk + bn * stride_bn, mask=t < K, other=0.0).to(tl.float32)
                acc += a_col[:, None] * b_row[None, :]
        else:
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                left = K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=rk[None, :] < left, other=0.0)
                b = tl.load(b_ptrs, mask=rk[:, None] < left, other=0.0)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=c_mask)


def config_for(dtype: torch.dtype) -> MatmulConfig:
    return CONFIGS[torch.empty((), dtype=dtype).element_size()]


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
    """`out (+)= a @ b` for a [I, T] and b [T, J] of one dtype (bf16, fp16 or fp32; any strides) and out
    [I, J]; with `accumulate` out is fp32 and holds the starting accumulator. Runs on the current stream,
    allocates nothing, never syncs the host."""
    rows, depth = a.shape
    cols = b.shape[1]
    if rows == 0 or cols == 0:
        return
    if depth == 0:
        if not accumulate:
            out.zero_()
        return
    if INTERPRET and out.dtype != torch.float32 and not accumulate:  # see the module docstring
        acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
        matmul(a, b, acc, accumulate=True)
        out.copy_(acc)
        return
    cfg = config_for(a.dtype)
    grid = (triton.cdiv(rows, cfg.block_m) * triton.cdiv(cols, cfg.block_n),)
    with on_device(a):
        matmul_kernel[grid](
            a, b, out, rows, cols, depth, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            out.stride(0), out.stride(1),
            ACCUMULATE=accumulate, EVEN_K=depth % cfg.block_k == 0, INTERPRETED=INTERPRET,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.warps, num_stages=cfg.stages,
        )
