"""One call per case for Nsight Compute to profile (`STAGES=ncu` in benchmarks/device_run.sh runs it
under `ncu`, one case per run).

Trainer cases (T = 1, T = 0.7, T = 1 with entropy, T = 0.7 with entropy): one forward and in-place backward
of `rl_logp.logprobs` on bf16 logits, 8192 rows by default; with `--forward-only` the forward alone on
logits that need no gradient, as a rollout calls it once per decode step (`bench_logp.py`'s rollout
suite). Rollout cases (`kept_*`): the top-k / top-p kept set as the patched vLLM samplers call it
(`rl_logp.sampling_mask.mask_logits_` on fp32 logits divided by T = 0.7, drawn as `bench_rollout.py`
draws them), one row by default, where the kept set's step is
GPU-bound (`docs/vllm.md`): the profile gives each of the split plan's launches its own duration. Each case
warms up outside any NVTX range, then runs once inside the range `measure`, so `ncu --nvtx --nvtx-include
measure/` profiles only the kernels of that call. On a machine without a GPU it runs the same calls on the
CPU (the trainer cases under Triton's interpreter, the kept set by its torch reference) at the shape given:
a check that the script works, not a measurement.

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
from rl_logp.config import LogpConfig
from rl_logp.sampling_mask import mask_logits_

CASES = {"t1": (1.0, False), "t07": (0.7, False), "t1_entropy": (1.0, True), "t07_entropy": (0.7, True)}
KEPT_CASES = {"kept_k50": (50, None), "kept_p09": (None, 0.9), "kept_k50_p09": (50, 0.9)}  # (top-k, top-p)


def trainer_call(logits: torch.Tensor, labels: torch.Tensor, temperature: float, entropy: bool,
                 forward_only: bool) -> None:
    if forward_only:
        if entropy:
            rl_logp.logprobs_and_entropy(logits, labels, temperature=temperature, backend="fused")
        else:
            rl_logp.logprobs(logits, labels, temperature=temperature, backend="fused")
        return
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
    parser.add_argument("--case", choices=[*CASES, *KEPT_CASES], required=True)
    parser.add_argument("--rows", type=int, default=None, help="default: 8192 (trainer cases), 1 (kept set)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--forward-only", action="store_true",
                        help="trainer cases: the forward alone, without gradients (a rollout's call)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    if args.case in KEPT_CASES:
        rows = args.rows or 1
        logits = (torch.randn(rows, args.vocab, device=device, generator=gen) * 2.5 - 3).to(torch.bfloat16).float()
        z = logits / torch.tensor(0.7, device=device)
        k, p = KEPT_CASES[args.case]
        top_k = None if k is None else torch.full((rows,), k, dtype=torch.int64, device=device)
        top_p = None if p is None else torch.full((rows,), p, dtype=torch.float32, device=device)
        config = LogpConfig()

        def call() -> None:
            mask_logits_(z.clone(), top_k, top_p, config)

        what = f"kept set, top-k {k}, top-p {p}, fp32 at T = 0.7"
    else:
        rows = args.rows or 8192
        logits = (torch.randn(rows, args.vocab, device=device, generator=gen) * 2).to(torch.bfloat16)
        labels = torch.randint(0, args.vocab, (rows,), device=device, generator=gen)
        temperature, entropy = CASES[args.case]

        def call() -> None:
            trainer_call(logits, labels, temperature, entropy, args.forward_only)

        what = f"bf16, T={temperature}, entropy={entropy}: forward{'' if args.forward_only else ' and backward'}"
    for _ in range(args.warmup):
        call()
    if device == "cuda":
        torch.cuda.synchronize()
    with torch.cuda.nvtx.range("measure") if device == "cuda" else torch.autograd.profiler.record_function("measure"):
        call()
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"{args.case}: {rows} x {args.vocab}, {what} ran")


if __name__ == "__main__":
    main()
