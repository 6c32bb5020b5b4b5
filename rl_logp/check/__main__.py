"""Command line of the provider-agreement check.

    python -m rl_logp.check                          # TP=1 here, and a spawned TP=2 gloo world
    torchrun --nproc-per-node=2 -m rl_logp.check     # the launched world (NCCL on GPUs)

Exit status 0 only when every comparison of an invariant provider has 0 differing rows.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile

import torch

from rl_logp.check.runner import run_rank, spawned_rank
from rl_logp.config import BACKENDS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m rl_logp.check",
        description="Feed frozen logits through the training provider at TP=1 and TP=N and through the "
        "rollout provider; compare bits against the TP=1 reference; print a table; exit 1 on any "
        "mismatch of an invariant provider (torch and flash_attn are diagnostics).",
    )
    p.add_argument("--rows", type=int, default=256, help="rows of the seeded frozen batch (default 256)")
    p.add_argument("--vocab", type=int, default=32003, help="vocabulary of the seeded batch (default 32003)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logits", help="a .pt/.safetensors file with 'logits' and 'labels' saved from a model")
    p.add_argument("--backends", nargs="+", default=["auto", "chunked", "torch"], choices=BACKENDS,
                   help="training backends to compare (the first invariant one is the reference)")
    p.add_argument("--world", type=int, default=2, help="TP degree to spawn when not under torchrun (default 2)")
    p.add_argument("--dist-backend", choices=["gloo", "nccl"], help="process-group backend (default: nccl on GPUs)")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    p.add_argument("--json", default="rl_logp_check.json", help="where to write the JSON report")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ:  # launched by torchrun
        return run_rank(args)
    if args.world <= 1:
        return run_rank(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["RL_LOGP_CHECK_SPAWNED"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        target = args.json
        args.json = os.path.join(tmp, "report.json")
        torch.multiprocessing.spawn(spawned_rank, args=(args.world, args, port), nprocs=args.world, join=True)
        with open(args.json) as f:
            report = json.load(f)
        with open(target, "w") as f:
            json.dump(report, f, indent=1)
    print(f"report written to {target}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
