"""Where the host time of one vLLM sampler step goes, unpatched and patched: cProfile of `--steps` steps of
one `bench_rollout` setting on each side, then the functions whose own time per step differs most between
the sides (patched minus unpatched: what the patch adds or removes), and each side's functions with the
most time of their own. Each side's host time per step without the profiler (median of 5 rounds) first.

    PYTHONPATH=/tmp/vllm-0.24.0 python benchmarks/profile_rollout_step.py --path v1_sampler --batch 8

On a machine without CUDA, `--device cpu` runs the same steps on the CPU (rl-logp's `fused` backend under
TRITON_INTERPRET=1 with `--backend fused`; keep `--vocab` small there).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from bench_rollout import Setting, Step, adapter


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def host_us(step: Step, rounds: int, per_round: int, device: torch.device) -> float:
    """Median over rounds of the host time per step (steps issued without waiting)."""
    for _ in range(10):
        step()
    times = []
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(per_round):
            step()
        times.append((time.perf_counter() - t0) / per_round * 1e6)
        _sync(device)
    return statistics.median(times)


def own_times(step: Step, steps: int, device: torch.device) -> dict[tuple, float]:
    """Each function's own time per step (us) under cProfile."""
    for _ in range(5):
        step()
    _sync(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    _sync(device)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, tottime, cumtime, callers)}
    return {func: row[2] / steps * 1e6 for func, row in stats.items()}


def _name(func: tuple) -> str:
    file, line, name = func
    return f"{name} ({os.path.basename(file)}:{line})" if line else name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="v1_sampler", choices=["v1_sampler", "v2_worker"])
    parser.add_argument("--mode", default="raw_logprobs", choices=["raw_logprobs", "processed_logprobs"])
    parser.add_argument("--num-logprobs", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--backend", default="auto", help="rl-logp backend of the patch")
    args = parser.parse_args()
    setting = Setting(args.path, args.mode, args.num_logprobs, args.dtype, args.temperature)
    device = torch.device(args.device)
    print(f"== {setting.name} B={args.batch} V={args.vocab} on {device}")
    unpatched = Step(setting, args.batch, args.vocab, device, args.backend)
    times = {"unpatched": host_us(unpatched, 5, max(1, args.steps // 5), device)}
    base = own_times(unpatched, args.steps, device)
    with adapter.patched(backend=args.backend):  # built and run inside: V1's TopKTopPSampler binds its forward
        patched = Step(setting, args.batch, args.vocab, device, args.backend)
        times["patched"] = host_us(patched, 5, max(1, args.steps // 5), device)
        profile = own_times(patched, args.steps, device)
    print("host us per step without the profiler: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    delta = {func: profile.get(func, 0.0) - base.get(func, 0.0) for func in set(profile) | set(base)}
    print(f"\n== own time per step under cProfile, patched minus unpatched (us), largest {args.top} changes")
    for func in sorted(delta, key=lambda f: -abs(delta[f]))[: args.top]:
        print(f"{delta[func]:+9.2f}  {_name(func)}")
    for name, own in (("unpatched", base), ("patched", profile)):
        print(f"\n== {name}: total {sum(own.values()):.1f} us per step under cProfile; largest own times")
        for func in sorted(own, key=lambda f: -own[f])[: args.top]:
            print(f"{own[func]:9.2f}  {_name(func)}")


if __name__ == "__main__":
    main()
