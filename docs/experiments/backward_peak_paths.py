"""The backward's peak memory of the call in `tests/test_fused_kernel.py`'s
`test_forward_allocates_only_outputs_and_backward_only_the_gradient`, through today's eager path
(`rl_logp.ops._EagerRowStats`) and through the op (`rl_logp::row_stats` and its registered formula), on a
CUDA GPU.

For each side and T (None, 0.7): `rl_logp.logprobs` of 4096 x 151936 bf16 leaf logits (fused, out of place),
then `sum().backward()`; prints the peak allocated above the memory before the backward, minus the
gradient's bytes and minus the block the caching allocator gives a tensor of the gradient's size (what
the test now bounds), beside the test's slack (256 bytes a row). An H100 at 7d946cc failed that test by 50176
bytes on the eager path; this says whether the op path does too.

    PYTHONPATH=/tmp/pkg:/tmp/site python -P docs/experiments/backward_peak_paths.py
"""

import contextlib
import pathlib
import sys

import torch

import rl_logp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from op_dispatch_cost import through_the_ops


def main() -> None:
    n, vocab = 4096, 151936
    x = torch.randn(n, vocab, device="cuda").to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    leaf = x.clone().requires_grad_(True)
    rl_logp.logprobs(leaf * 1.0, labels, backend="fused", temperature=0.7).sum().backward()  # compile first
    for side in ("eager", "op", "eager"):
        with through_the_ops() if side == "op" else contextlib.nullcontext():
            for temperature in (None, 0.7):
                y = (leaf * 1.0).detach().requires_grad_(True)
                out = rl_logp.logprobs(y, labels, backend="fused", temperature=temperature)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                probe = torch.empty_like(y)
                block = torch.cuda.memory_allocated() - base
                del probe
                torch.cuda.reset_peak_memory_stats()
                out.sum().backward()
                extra = torch.cuda.max_memory_allocated() - base - y.numel() * 2
                print(f"{side:5s} T={temperature}: backward peak above the gradient's bytes {extra}, above the "
                      f"allocator's block for it ({block} bytes) {extra + y.numel() * 2 - block} (slack {256 * n})",
                      flush=True)


if __name__ == "__main__":
    main()
