"""Benchmark of the lm_head + logp (+ entropy) head: rl-logp's `linear_logprobs` beside verl's fused heads
and the unfused path, forward + backward, time and peak memory.

For N tokens x hidden H x vocabulary V (bf16; default N in {8192, 32768}, H 4096, V 151936), T in {1.0,
0.7}, without and with entropy (loss sum(logp) [+ sum(entropy)], gradients of hidden and weight):
  rl_logp linear_logprobs          the invariant head, no logits-sized buffer (backend auto)
  verl FusedLinearForPPO (torch)   verl 0.9.1's `use_fused_kernels` torch backend (512-row fp32 chunks)
  verl linear_cross_entropy        verl's `triton` fused backend (CUDA only)
  torch lm_head + rl_logp          `hidden @ weight.T` (cuBLAS), then `rl_logp.logprobs[_and_entropy]`
                                   with in-place backward (the unfused path, logits materialised)
Each provider gets fresh inputs; time: CUDA events, warm-up, median of `--reps`; peak: the largest
`torch.cuda.max_memory_allocated` above the inputs over one forward + backward (the gradients of hidden
and weight included: every provider returns them). Each row also gives the largest distance of the
provider's logp (and entropy) from rl-logp's on the same inputs. Rows go to the JSON (`--out`) as they are
measured; a table is printed as they come. `--smoke`: tiny shapes on the CPU.

    python benchmarks/bench_linear.py --out benchmarks/results/h200_linear.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

import rl_logp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling modules, also under `python -P`
from bench_report import Report
from bench_verl_step import stub_missing_modules

Head = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, bool], tuple[torch.Tensor, torch.Tensor | None]]


def rl_logp_head(h, w, y, t, entropy):
    out = rl_logp.linear_logprobs(h, w, y, temperature=t, entropy=entropy)
    return out if entropy else (out, None)


def verl_torch_head(h, w, y, t, entropy):
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    logp, ent = FusedLinearForPPO(impl_backend="torch")(h, w, y, t)
    return logp, ent if entropy else None


def verl_triton_head(h, w, y, t, entropy):
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

    logp, ent = linear_cross_entropy(h, w, y, float(t), "none")
    return logp, ent if entropy else None


def unfused_head(h, w, y, t, entropy):
    x = h @ w.t()
    if entropy:
        return rl_logp.logprobs_and_entropy(x, y, temperature=t, inplace_backward=True)
    return rl_logp.logprobs(x, y, temperature=t, inplace_backward=True), None


PROVIDERS: dict[str, Head] = {
    "rl_logp linear_logprobs": rl_logp_head,
    "verl FusedLinearForPPO (torch)": verl_torch_head,
    "verl linear_cross_entropy (triton)": verl_triton_head,
    "torch lm_head + rl_logp": unfused_head,
}


def inputs(n: int, hidden: int, vocab: int, device: torch.device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    h = (torch.randn(n, hidden, generator=gen, device=device)).bfloat16().requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=gen, device=device) * hidden**-0.5 * 2).bfloat16().requires_grad_(True)
    y = torch.randint(0, vocab, (n,), generator=gen, device=device)
    return h, w, y


def step(head: Head, h, w, y, t: float, entropy: bool):
    h.grad = w.grad = None
    logp, ent = head(h, w, y, t, entropy)
    loss = logp.sum() + (ent.float().sum() if entropy else 0)
    loss.backward()
    return logp.detach(), None if ent is None else ent.detach().float()


def timed(run: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median milliseconds of `run` after one warm-up."""
    run()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            began = time.perf_counter()
            run()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def peak_mib(run: Callable[[], object], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _distance(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    if a is None or b is None:
        return None
    return float((a.float() - b.float()).abs().max())


def measure(name: str, n: int, hidden: int, vocab: int, t: float, entropy: bool, reps: int,
            device: torch.device) -> dict:
    row = {"provider": name, "rows": n, "hidden": hidden, "vocab": vocab, "temperature": t, "entropy": entropy}
    head = PROVIDERS[name]
    try:
        h, w, y = inputs(n, hidden, vocab, device)
        got = step(head, h, w, y, t, entropy)
        want = step(rl_logp_head, h, w, y, t, entropy)
        row["logp_max_abs_diff_vs_rl_logp"] = _distance(got[0], want[0])
        row["entropy_max_abs_diff_vs_rl_logp"] = _distance(got[1], want[1])
        del got, want
        h, w, y = inputs(n, hidden, vocab, device, seed=1)  # fresh inputs for the timed runs
        row["peak_mib"] = peak_mib(lambda: step(head, h, w, y, t, entropy), device)
        row["fwd_bwd_ms"] = timed(lambda: step(head, h, w, y, t, entropy), reps, device)
    except Exception as err:  # recorded in the row: one provider failing does not stop the others
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def print_row(row: dict) -> None:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    if "error" in row:
        print(f"{row['rows']:>6} T={row['temperature']:<4} H={'y' if row['entropy'] else 'n'} {row['provider']:<36} "
              f"error: {row['error']}", flush=True)
        return
    print(f"{row['rows']:>6} T={row['temperature']:<4} H={'y' if row['entropy'] else 'n'} {row['provider']:<36} "
          f"{row['fwd_bwd_ms']:>9.2f} ms {fmt(row['peak_mib'], '>9.0f')} MiB "
          f"dlogp {fmt(row['logp_max_abs_diff_vs_rl_logp'], '.3g')} dH {fmt(row['entropy_max_abs_diff_vs_rl_logp'], '.3g')}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", default="benchmarks/results/h200_linear.json")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        args.rows, args.hidden, args.vocab, args.reps = [64], 32, 1031, 1
    providers = [p for p in args.providers if device.type == "cuda" or "triton" not in p]
    header = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "dtype": "bfloat16", "not_run": {},
              "stubbed_modules": stub_missing_modules()}  # what verl imports at module level but never calls here
    if len(providers) < len(args.providers):
        header["not_run"]["verl linear_cross_entropy (triton)"] = "needs a CUDA GPU"
    report = Report(args.out, header, echo=print_row)
    print(f"{'rows':>6} {'setting':<10} {'provider':<36} {'fwd+bwd':>12} {'peak':>13}  distance from rl-logp", flush=True)
    for n in args.rows:
        for t in (1.0, 0.7):
            for entropy in (False, True):
                for name in providers:
                    report.add(measure(name, n, args.hidden, args.vocab, t, entropy, args.reps, device))
    print(f"report written to {args.out}")


if __name__ == "__main__":
    main()
