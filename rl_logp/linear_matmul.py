"""The batch-invariant product `out (+)= a @ b` of `rl_logp.linear`, on any device.

Two implementations with one rule (each output element is a fixed-order fp32 reduction of its own row
of `a` and column of `b`, whatever the shapes):
- Triton (`rl_logp.kernels.matmul`): CUDA, or the CPU under `TRITON_INTERPRET=1`; one fixed launch
  configuration per dtype.
- torch, for the CPU without Triton: `acc += a[:, t] * b[t, :]` one `t` at a time, in increasing `t`, as an
  fp32 multiply then an fp32 add (each one IEEE operation per element, so vectorisation and threads cannot
  change a bit; never `addcmul`, an fma, or `torch.matmul`, whose blocking depends on the shapes).

`accumulate`: `out` is an fp32 buffer holding the starting accumulator, so calls over consecutive slices
of `t` cut at multiples of `ALIGN` give the bits of one call over all of `t`. Without it the fp32 result
is rounded once into `out`'s dtype.
"""

from __future__ import annotations

import torch

# Cuts of rows, columns and the reduction at multiples of this keep every element's tile position and
# reduction steps in the Triton kernel (`kernels.matmul.ALIGN`, checked by tests/test_linear.py).
ALIGN = 256


def uses_triton(engine: str, device: torch.device) -> bool:
    """The Triton kernel on CUDA (every invariant backend), and on the CPU with the `fused` engine (the
    interpreter); the torch loop otherwise."""
    return device.type == "cuda" or engine == "fused"


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, triton: bool, accumulate: bool = False) -> None:
    """`out (+)= a @ b` for a [I, T], b [T, J] (one dtype, any strides) into out [I, J] (fp32 with
    `accumulate`)."""
    if triton:
        from rl_logp.kernels.matmul import matmul as kernel

        kernel(a, b, out, accumulate)
        return
    acc = out if accumulate else torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    rows = a.t().float().contiguous()
    cols = b.float().contiguous()
    term = torch.empty_like(acc)
    for t in range(rows.shape[0]):
        torch.mul(rows[t].unsqueeze(1), cols[t].unsqueeze(0), out=term)
        acc.add_(term)
    if not accumulate:
        out.copy_(acc)
