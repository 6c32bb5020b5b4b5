"""Each row's sampled token beside the row's top-n, in one launch: vLLM V1's `Sampler.gather_logprobs`
(logprobs [n, V] already computed, the top-n taken by torch.topk) without its five torch ops.

Per row of fp32 `logprobs`, with `token` the row's entry of `tokens` (int64): column 0 of the outputs is
the token (its id as int32, its logprob read from the row), columns 1..top of them the given top-n ids (as
int32) and values, and `out_rank` (int64) the count of the row's entries >= the token's logprob, what
`(logprobs >= value).sum(-1)` counts (a NaN entry is never counted; a NaN logprob counts nothing). A token
outside [0, V) gets a NaN logprob and the rank -1, never a read from outside the row (torch's gather
raises there). Only copies and comparisons: the bits of torch's gather, cat and casts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch_options, on_device
from .launcher import BoundLaunch, CachedLauncher

BLOCK = 8192  # entries a program compares per step of its row (32 a thread: eight 16-byte loads in flight)
WARPS = 8


@triton.jit
def sampled_rank_kernel(LOGPROBS, stride_row, vocab, TOKENS, TOP_VALUES, TOP_IDS, top, OUT_IDS, OUT_VALUES,
                        OUT_RANK, BLOCK: tl.constexpr, TOP_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    token = tl.load(TOKENS + row)
    inside = (token >= 0) & (token < vocab)
    base = LOGPROBS + row * stride_row
    value = tl.load(base + tl.where(inside, token, 0), mask=inside, other=float("nan"))
    count = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("nan"))
        count += (x >= value).to(tl.int32)
    tl.store(OUT_RANK + row, tl.where(inside, tl.sum(count, axis=0).to(tl.int64), -1))
    at = row * (top + 1)
    tl.store(OUT_IDS + at, token.to(tl.int32))
    tl.store(OUT_VALUES + at, value)
    if TOP_BLOCK > 0:
        j = tl.arange(0, TOP_BLOCK)
        given = j < top
        tl.store(OUT_VALUES + at + 1 + j, tl.load(TOP_VALUES + row * top + j, mask=given), mask=given)
        tl.store(OUT_IDS + at + 1 + j, tl.load(TOP_IDS + row * top + j, mask=given).to(tl.int32), mask=given)


rank_launch = CachedLauncher(sampled_rank_kernel)


def sampled_rank(logprobs: torch.Tensor, tokens: torch.Tensor, top_values: torch.Tensor | None,
                 top_ids: torch.Tensor | None, out_ids: torch.Tensor, out_values: torch.Tensor,
                 out_rank: torch.Tensor) -> None:
    """Write `out_ids` (int32 [n, top + 1]), `out_values` (fp32 [n, top + 1]) and `out_rank` (int64 [n]) of
    `logprobs` (fp32 [n, V], entries of a row contiguous) and `tokens` (int64 [n], contiguous), beside the
    row's top-n `top_values` / `top_ids` (fp32 / int64 [n, top], contiguous; None for top = 0)."""
    if logprobs.shape[0] == 0:
        return
    with on_device(logprobs):
        rank_launch(*_launch(logprobs, tokens, top_values, top_ids, out_ids, out_values, out_rank))


def _launch(logprobs: torch.Tensor, tokens: torch.Tensor, top_values: torch.Tensor | None,
            top_ids: torch.Tensor | None, out_ids: torch.Tensor, out_values: torch.Tensor,
            out_rank: torch.Tensor) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, options) of `sampled_rank`'s launch."""
    n, vocab = logprobs.shape
    top = out_ids.shape[1] - 1
    return ((n,), (logprobs, logprobs.stride(0), vocab, tokens, top_values, top_ids, top, out_ids, out_values, out_rank,
                   BLOCK, triton.next_power_of_2(top) if top else 0), launch_options(WARPS, False, 0))


SLOTS = (0, 3, 4, 5, 7, 8, 9)  # the tensors of a launch, in `sampled_rank`'s order


def bind_sampled_rank(logprobs: torch.Tensor, tokens: torch.Tensor, top_values: torch.Tensor | None,
                      top_ids: torch.Tensor | None, out_ids: torch.Tensor, out_values: torch.Tensor,
                      out_rank: torch.Tensor, direct: bool = False) -> BoundLaunch | None:
    """`sampled_rank` of these arguments, after it ran, as a `BoundLaunch` taking new tensors of the same
    shapes in `sampled_rank`'s order (top-n tensors left out for top = 0; vLLM's call at every decode
    step; with `direct`, through the CUDA driver where it can: `launcher.DriverLaunch`). None where the
    call launches nothing."""
    if logprobs.shape[0] == 0:
        return None
    grid, args, options = _launch(logprobs, tokens, top_values, top_ids, out_ids, out_values, out_rank)
    slots = tuple(s for s in SLOTS if args[s] is not None)
    with on_device(logprobs):
        return rank_launch.bind(grid, args, options, slots, direct=direct)
