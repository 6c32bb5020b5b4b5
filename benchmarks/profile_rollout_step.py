"""Where the host time of one vLLM sampler step goes, unpatched and patched: cProfile of `--steps` steps
of one `bench_rollout` setting, the functions with the most time of their own printed for each side.

    PYTHONPATH=/tmp/vllm-0.24.0 python benchmarks/profile_rollout_step.py --path v1_sampler --batch 8
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from bench_rollout import Setting, Step, adapter


def profile(step: Step, steps: int, top: int) -> str:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    text.write(f"host us per step: {stats.total_tt / steps * 1e6:.1f} (under the profiler)\n")
    stats.sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="v1_sampler", choices=["v1_sampler", "v2_worker"])
    parser.add_argument("--mode", default="raw_logprobs", choices=["raw_logprobs", "processed_logprobs"])
    parser.add_argument("--num-logprobs", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    setting = Setting(args.path, args.mode, args.num_logprobs, "bfloat16", args.temperature)
    device = torch.device("cuda")
    print(f"== unpatched {setting.name} B={args.batch}\n" + profile(Step(setting, args.batch, 151936, device, "auto"),
                                                                    args.steps, args.top))
    with adapter.patched(backend="auto"):
        step = Step(setting, args.batch, 151936, device, "auto")
        print(f"== patched {setting.name} B={args.batch}\n" + profile(step, args.steps, args.top))


if __name__ == "__main__":
    main()
