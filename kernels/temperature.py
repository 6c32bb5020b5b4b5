"""Each row of fp32 logits divided in place by its temperature, looked up through an index (vLLM Model
Runner V2's `apply_temperature(logits, expanded_idx_mapping, temperature)`), in one launch and with the
IEEE quotient (`div_rn`) by which the contract defines z = fp32(x) / T: what torch's division of the same
tensors gives, bit for bit. A row whose temperature is 0 (greedy) or 1 is left as it is (x / 1 is x), as
vLLM's own kernel leaves it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch_options, on_device
from .launcher import BoundLaunch, CachedLauncher

BLOCK = 8192  # columns per program
WARPS = 8


@triton.jit
def divide_rows_kernel(X, stride_x, ROW_INDEX, TEMPERATURE, n_temperatures, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    index = tl.load(ROW_INDEX + row)
    inside = (index >= 0) & (index < n_temperatures)
    t = tl.load(TEMPERATURE + index, mask=inside, other=float("nan")).to(tl.float32)
    if t != 0.0 and t != 1.0:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        ptrs = X + row * stride_x + cols
        tl.store(ptrs, tl.math.div_rn(tl.load(ptrs, mask=mask), t), mask=mask)


divide_launch = CachedLauncher(divide_rows_kernel)


def divide_rows_(x: torch.Tensor, row_index: torch.Tensor, temperature: torch.Tensor) -> None:
    """x [n, V] fp32 (last dimension contiguous) /= temperature[row_index] per row, in place; `row_index` [n]
    (int32/int64), `temperature` [r] (any float dtype, read as fp32). A row whose index is outside [0, r)
    becomes NaN (no temperature is read from outside the tensor)."""
    n, vocab = x.shape
    if n == 0 or vocab == 0:
        return
    with on_device(x):
        divide_launch(*_launch(x, row_index, temperature))


def _launch(x: torch.Tensor, row_index: torch.Tensor, temperature: torch.Tensor) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, options) of `divide_rows_`'s launch."""
    n, vocab = x.shape
    return ((n, triton.cdiv(vocab, BLOCK)), (x, x.stride(0), row_index, temperature, temperature.shape[0], vocab, BLOCK),
            launch_options(WARPS, False, 0))


def bind_divide_rows(x: torch.Tensor, row_index: torch.Tensor, temperature: torch.Tensor,
                     direct: bool = False) -> BoundLaunch | None:
    """`divide_rows_` of these arguments, after it ran, as a `BoundLaunch` taking new (x, row_index,
    temperature) of the same shapes (vLLM V2's call at every decode step; with `direct`, through the CUDA
    driver where it can: `launcher.DriverLaunch`). None where the call launches nothing."""
    if x.shape[0] == 0 or x.shape[1] == 0:
        return None
    grid, args, options = _launch(x, row_index, temperature)
    with on_device(x):
        return divide_launch.bind(grid, args, options, (0, 2, 3), direct=direct)
