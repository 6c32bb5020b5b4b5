"""Full-vocabulary logprobs from a row's normaliser, in one Triton pass: out = (fp32(x) - M) - L.

The writer behind the vLLM adapter's V1 `Sampler.compute_logprobs` (M, L from `rl_logp.log_normalizer`):
one read of the logits and one fp32 write, where `x.to(float32).sub_(M).sub_(L)` makes three passes
over [B, V] fp32. Two IEEE subtractions per element, in that order (no contraction is possible), so the
same bits as the torch expression on every device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def full_logprobs_kernel(X, stride_x, OUT, stride_out, ROW_MAX, LOG_SUM, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    m = tl.load(ROW_MAX + row)
    log_sum = tl.load(LOG_SUM + row)
    x = tl.load(X + row * stride_x + cols, mask=inside).to(tl.float32)
    tl.store(OUT + row * stride_out + cols, (x - m) - log_sum, mask=inside)


def full_logprobs(x: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor, *, block: int = 2048,
                  warps: int = 4) -> torch.Tensor:
    """A new fp32 [n, V] tensor `(fp32(x) - M) - L` for the [n, V] logits `x` (last dimension
    contiguous) and fp32 [n] `row_max`, `log_sum`."""
    n, vocab = x.shape
    out = torch.empty((n, vocab), dtype=torch.float32, device=x.device)
    if n and vocab:
        grid = (n, triton.cdiv(vocab, block))
        full_logprobs_kernel[grid](x, x.stride(0), out, out.stride(0), row_max, log_sum, vocab, BLOCK=block,
                                   num_warps=warps, enable_fp_fusion=False)
    return out
