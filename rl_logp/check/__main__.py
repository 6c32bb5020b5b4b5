"""Command line of the provider-agreement check.

    python -m rl_logp.check                          # TP=1 here, and a spawned TP=2 gloo world
    torchrun --nproc-per-node=2 -m rl_logp.check     # the launched world (NCCL on GPUs)

Exit status 0 only when every comparison of an invariant provider has 0 differing rows and nothing
raised; 1 otherwise (the JSON report and each failure's traceback are still written); 2 when the
arguments are refused (for instance a reference backend that cannot run on this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile

import torch
from torch.multiprocessing.spawn import ProcessException

from rl_logp.check.runner import reference_backend, run_rank, spawned_rank, unavailable
from rl_logp.config import BACKENDS


def build_parser() -> argparse.ArgumentParser:
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
                   help="training backends to compare; the first invariant one (auto, fused, chunked) is the "
                   "reference, auto when none is listed")
    p.add_argument("--world", type=int, default=2, help="TP degree to spawn when not under torchrun (default 2)")
    p.add_argument("--dist-backend", choices=["gloo", "nccl"], help="process-group backend (default: nccl on GPUs)")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    p.add_argument("--json", default="rl_logp_check.json", help="where to write the JSON report")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.backends = list(dict.fromkeys(args.backends))
    args.reference = reference_backend(args.backends)
    device = torch.device("cpu")
    if torch.cuda.is_available():  # the GPU this rank (or spawned rank 0) will use
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    why = unavailable(args.reference, device)
    if why is not None:
        print(f"rl_logp.check: refused: the reference backend {args.reference!r} cannot run on {device.type} "
              f"({why}); list an invariant backend that can (auto picks one)", file=sys.stderr)
        return 2
    if "WORLD_SIZE" in os.environ or args.world <= 1:  # launched by torchrun, or TP=1 only
        return run_rank(args)
    return spawn_world(args)


def spawn_world(args: argparse.Namespace) -> int:
    """Run `args.world` gloo ranks in spawned processes; copy rank 0's report to `--json`, or write one
    holding the error when the ranks died before rank 0 could."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["RL_LOGP_CHECK_SPAWNED"] = "1"
    target = args.json
    with tempfile.TemporaryDirectory() as tmp:
        args.json = os.path.join(tmp, "report.json")
        try:
            torch.multiprocessing.spawn(spawned_rank, args=(args.world, args, port), nprocs=args.world, join=True)
            crash = ""
        except ProcessException as err:
            crash = f"a spawned rank died: {err}"
            print(f"rl_logp.check: {crash}", file=sys.stderr)
        if os.path.exists(args.json):
            with open(args.json) as f:
                report = json.load(f)
        else:
            report = {"passed": False, "error": "", "comparisons": []}
            crash = crash or "rank 0 wrote no report"
    if crash:
        report["passed"] = False
        report["error"] = "\n".join(e for e in (report["error"], crash) if e)
    with open(target, "w") as f:
        json.dump(report, f, indent=1)
    print(f"report written to {target}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
