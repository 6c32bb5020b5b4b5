"""Does torch's CPU fp32 `exp` give the same bits for the same input in every process?

Spawns `--rounds` pairs of fresh processes (as the TP tests and `rl_logp.check` spawn ranks); each computes
`exp` of one fixed, seeded [12, 600] fp32 block divided by 0.7 (the shape and scale of a TP test's shard),
twice: torch's fp32 `exp`, and `rl_logp.contract.exp32` (fp64 `exp` rounded to fp32, what the CPU chunked
engine uses). Records per process a checksum of each result's bits; prints how many distinct results each
way produced and writes JSON (--out).

    python benchmarks/cpu_exp_determinism.py --out benchmarks/results/cpu_exp_determinism.json
"""

from __future__ import annotations

import argparse
import collections
import json
import platform

import torch
import torch.multiprocessing as mp


def _checksum(t: torch.Tensor) -> int:
    weights = torch.arange(1, t.numel() + 1, dtype=torch.int64)
    return int((t.reshape(-1).view(torch.int32).to(torch.int64) * weights).sum())


def _child(queue) -> None:
    from rl_logp.contract import exp32

    gen = torch.Generator().manual_seed(0)
    z = (torch.randn(12, 600, generator=gen) * 3 - 20) / torch.tensor(0.7)
    queue.put({"fp32_exp": _checksum(torch.exp(z)), "exp32": _checksum(exp32(z)),
               "capability": torch.backends.cpu.get_cpu_capability()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=45)
    parser.add_argument("--out", default="benchmarks/results/cpu_exp_determinism.json")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = []
    for _ in range(args.rounds):
        queue = ctx.SimpleQueue()
        procs = [ctx.Process(target=_child, args=(queue,)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        results += [queue.get(), queue.get()]
    summary = {key: dict(collections.Counter(str(r[key]) for r in results)) for key in ("fp32_exp", "exp32", "capability")}
    report = {"processes": len(results), "torch": torch.__version__, "machine": platform.processor() or "cpu",
              "distinct_results": summary, "command": "python benchmarks/cpu_exp_determinism.py"}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for key in ("fp32_exp", "exp32"):
        print(f"{key:9s}: {len(summary[key])} distinct result(s) over {len(results)} processes {summary[key]}")


if __name__ == "__main__":
    main()
