"""What torch's custom-op dispatch costs a training step's host time: `rl_logp.logprobs` forward and
in-place backward through `rl_logp::row_stats` and `rl_logp::grad_` (the eager path before
`ops._EagerRowStats`) against today's eager path (the same bodies under an `autograd.Function`).

Each step: logits = hidden @ weight (requires grad), `rl_logp.logprobs(..., inplace_backward=True)`, sum,
backward; beside it the same step without rl-logp (the logits' row sums) for scale. The sides alternate in
5 rounds of 1000 steps; prints the median host us per step of each and writes them as JSON. On a CPU the
fused kernels' launches are stubbed out (TRITON_INTERPRET=1 would run them), so what is timed is the
Python and torch work around them; on a GPU the launches are real and the loop never waits for the GPU.

    TRITON_INTERPRET=1 python docs/experiments/op_dispatch_cost.py --out benchmarks/results/cpu_op_dispatch.json
"""

import argparse
import contextlib
import json
import pathlib
import platform
import statistics
import sys
import types

import torch

import rl_logp
from rl_logp import ops

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_logp import host_us_per_call, stubbed_launches

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def through_the_ops():
    """`ops.row_stats` calling `rl_logp::row_stats` where it would apply `_EagerRowStats` (its registered
    autograd formula then calls `rl_logp::grad_`)."""
    saved = ops._EagerRowStats
    ops._EagerRowStats = types.SimpleNamespace(apply=torch.ops.rl_logp.row_stats)
    try:
        yield
    finally:
        ops._EagerRowStats = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="op_dispatch.json")
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    rows, vocab = (64, 1031) if DEVICE.type == "cpu" else (64, 151936)  # host-bound on a GPU too
    hidden = torch.randn(rows, 32, device=DEVICE, dtype=torch.float32 if DEVICE.type == "cpu" else torch.bfloat16)
    weight = torch.randn(32, vocab, device=DEVICE, dtype=hidden.dtype)
    labels = torch.randint(0, vocab, (rows,), device=DEVICE)
    config = rl_logp.LogpConfig(backend="fused")

    def rl_logp_step() -> None:
        logits = hidden.requires_grad_(True) @ weight
        rl_logp.logprobs(logits, labels, config=config, inplace_backward=True).sum().backward()

    def without_rl_logp() -> None:
        logits = hidden.requires_grad_(True) @ weight
        logits.sum(-1).sum().backward()

    sides = {"through the ops": (rl_logp_step, through_the_ops), "eager autograd.Function": (rl_logp_step, None),
             "without rl-logp (row sums)": (without_rl_logp, None)}
    samples = {side: [] for side in sides}
    # On a CPU the forward's and the gradient's launches are stubbed out; on a GPU they run.
    with stubbed_launches("row_stats_launch", "grad_launch") if DEVICE.type == "cpu" else contextlib.nullcontext():
        for _ in range(5):
            for side, (step, path) in sides.items():
                with (path or contextlib.nullcontext)():
                    samples[side].append(host_us_per_call(step, args.steps, DEVICE, warmup=50))
    table = [{"side": side, "host_us_per_step": statistics.median(runs), "rounds_us": runs} for side, runs in samples.items()]
    for row in table:
        print(f"{row['side']:28s} {row['host_us_per_step']:8.1f} us per step")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else platform.machine(),
                   "torch": torch.__version__, "python": platform.python_version(), "rows": rows, "vocab": vocab,
                   "launches": "real" if DEVICE.type == "cuda" else "stubbed", "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
