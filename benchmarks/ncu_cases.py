"""One forward and backward of `rl_logp.logprobs` per case, for Nsight Compute to profile the kernels of
(`STAGES=ncu` in benchmarks/device_run.sh runs it under `ncu`, one case per run).

Each case (T = 1, T = 0.7, T = 1 with entropy, T = 0.7 with entropy) warms up outside any NVTX range, then
runs once inside the range `measure`, so `ncu --nvtx --nvtx-include measure/` profiles only the kernels of
that call: the forward's and the in-place backward's. On a machine without a GPU it runs the same calls
under Triton's interpreter at the shape given (a check that the script works, not a measurement).

    ncu --nvtx --nvtx-include measure/ python benchmarks/ncu_cases.py --case t07
    python benchmarks/ncu_cases.py --case t1_entropy --rows 4 --vocab 1031      # CPU, interpreter
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import rl_logp

CASES = {"t1": (1.0, False), "t07": (0.7, False), "t1_entropy": (1.0, True), "t07_entropy": (0.7, True)}


def step(logits: torch.Tensor, labels: torch.Tensor, temperature: float, entropy: bool) -> None:
    x = logits.clone().requires_grad_(True)
    y = x * 1.0  # a non-leaf, as verl's logits: the backward writes its gradient in place
    if entropy:
        logp, ent = rl_logp.logprobs_and_entropy(y, labels, temperature=temperature, backend="fused",
                                                 inplace_backward=True)
        (logp.sum() + ent.sum()).backward()
    else:
        rl_logp.logprobs(y, labels, temperature=temperature, backend="fused", inplace_backward=True).sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=CASES, required=True)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, device=device, generator=gen) * 2).to(torch.bfloat16)
    labels = torch.randint(0, args.vocab, (args.rows,), device=device, generator=gen)
    temperature, entropy = CASES[args.case]
    for _ in range(args.warmup):
        step(logits, labels, temperature, entropy)
    if device == "cuda":
        torch.cuda.synchronize()
    with torch.cuda.nvtx.range("measure") if device == "cuda" else torch.autograd.profiler.record_function("measure"):
        step(logits, labels, temperature, entropy)
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"{args.case}: {args.rows} x {args.vocab} bf16, T={temperature}, entropy={entropy}: forward and backward ran")


if __name__ == "__main__":
    main()
