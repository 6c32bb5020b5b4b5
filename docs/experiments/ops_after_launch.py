"""What a scoring call costs the torch ops issued after it (host time), on a CUDA device.

Each step, after a sync: X (one of `CALLS`), then a fixed block of vLLM-sampler-like torch ops (`ops`:
cast, softmax, exponential noise, divide, argmax, top-k). Prints the median host us of X and of the ops
after it, the Xs alternating round by round. Run with the package importable and a GPU:

    PYTHONPATH=/tmp/pkg:/tmp/site python -P docs/experiments/ops_after_launch.py 8
"""

import ctypes
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

import rl_logp
from rl_logp.kernels import cuda_source


@triton.jit
def _touch(p):
    tl.store(p, 1.0)


CONFIG = rl_logp.resolve_config(None)
LOGITS = torch.randn(8, 151936, device="cuda", dtype=torch.bfloat16)
CELL = torch.zeros(1, device="cuda")
CUDA = cuda_source._launch_driver()
NOW = ctypes.c_void_p()
NOW_REF = ctypes.byref(NOW)
LAUNCH = cuda_source.BoundKernel.__call__


def rl_logp_call() -> None:
    rl_logp.full_logprobs(LOGITS, config=CONFIG)


def rl_logp_without_launch() -> None:
    cuda_source.BoundKernel.__call__ = lambda self, stream, pointers: None
    try:
        rl_logp.full_logprobs(LOGITS, config=CONFIG)
    finally:
        cuda_source.BoundKernel.__call__ = LAUNCH


CALLS = {
    "none": lambda: None,
    "log_softmax": lambda: LOGITS.log_softmax(-1, dtype=torch.float32),
    "rl_logp": rl_logp_call,
    "rl_logp, no launch": rl_logp_without_launch,
    "empty + cuCtxGetCurrent": lambda: (torch.empty(8, 151936, device="cuda"), CUDA.cuCtxGetCurrent(NOW_REF)),
    "triton launch": lambda: _touch[(1,)](CELL),
    "log_softmax + triton launch": lambda: (LOGITS.log_softmax(-1, dtype=torch.float32), _touch[(1,)](CELL)),
}


def ops() -> tuple:
    y = LOGITS.to(torch.float32)
    p = y.softmax(-1)
    q = torch.empty_like(p).exponential_()
    sampled = p.div_(q).argmax(-1)
    values, ids = torch.topk(y, 5, -1)
    return sampled.to(torch.int32), values, ids


def main(rounds: int) -> None:
    for call in CALLS.values():
        for _ in range(20):
            call()
            ops()
    torch.cuda.synchronize()
    own = {name: [] for name in CALLS}
    after = {name: [] for name in CALLS}
    for _ in range(rounds):
        for name, call in CALLS.items():
            for _ in range(200):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call()
                t1 = time.perf_counter()
                ops()
                own[name].append((t1 - t0) * 1e6)
                after[name].append((time.perf_counter() - t1) * 1e6)
    print(f"{'X':32s} {'X us':>8s} {'ops after X us':>15s}")
    for name in CALLS:
        print(f"{name:32s} {statistics.median(own[name]):8.1f} {statistics.median(after[name]):15.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
