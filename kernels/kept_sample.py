"""A draw from each row's kept set, given the row's exponential noise, in one pass over the row: the kept
column j (z_j >= the row's threshold, `kept_set`'s) with the largest z_j - log q_j, the smallest such column
on a tie. That is vLLM's native draw argmax_j p_j / q_j (p the softmax of the kept logits) in Gumbel-max form:
p_j / q_j = exp(z_j - M) / (S q_j) ranks the columns as z_j - log q_j does. Each row's logits and noise are
read once; only the token ids are written (the logits are left as they are). `log` is the contract's
`exact_log`, libdevice's (torch's CUDA `log`), so on a GPU the draw is that of the torch expression
`where(z >= threshold, z - log(q), -inf).argmax(-1)` on the same noise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fixed_point import exact_log
from .launch import launch_options, on_device
from .launcher import CachedLauncher

BLOCK = 4096  # columns per tile
WARPS = 8


@triton.jit
def kept_sample_kernel(Z, stride_z, Q, stride_q, THRESHOLD, OUT, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    threshold = tl.load(THRESHOLD + row)
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_cols, BLOCK):
        c = start + cols
        inside = c < n_cols
        z = tl.load(Z + row * stride_z + c, mask=inside, other=float("-inf"), eviction_policy="evict_first")
        q = tl.load(Q + row * stride_q + c, mask=inside, other=1.0, eviction_policy="evict_first")
        key = tl.where(z >= threshold, z - exact_log(q), float("-inf"))
        better = key > best  # strict: each lane keeps its first column of a tie
        best = tl.where(better, key, best)
        best_col = tl.where(better, c, best_col)
    top = tl.max(best)
    tl.store(OUT + row, tl.min(tl.where(best == top, best_col, n_cols)).to(tl.int64))


sample_launch = CachedLauncher(kept_sample_kernel)


def kept_sample(z: torch.Tensor, noise: torch.Tensor, threshold: torch.Tensor, out: torch.Tensor) -> None:
    """Write into `out` (int64 [n]) each row's draw from z [n, V] fp32 and noise [n, V] fp32 (both with a
    contiguous last dimension) above `threshold` (fp32 [n]). A row with no kept finite key (all -inf) draws
    column 0; a row holding NaN draws among its other columns."""
    n, vocab = z.shape
    if n == 0 or vocab == 0:
        return
    with on_device(z):
        sample_launch((n,), (z, z.stride(0), noise, noise.stride(0), threshold, out, vocab, BLOCK),
                      launch_options(WARPS, False, 0))
