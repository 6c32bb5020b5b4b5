"""The cluster forward's blocks per SM and time at each preferred shared-memory carveout (GPU only).

A bf16 row of 151936 logits takes 4 blocks of 75968-byte slices; with each block's own 248 bytes and the
1 KB the hardware reserves, three fit in an H100/H200 SM's 228 KB, two if the SM is configured with less.
The driver picks the configuration per launch; `CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT` (a
percentage of the maximum) asks for one. For each carveout this prints the driver's occupancy answer
(blocks per SM, clusters at once) and the median time of the public API's forward (`rl_logp.logprobs`,
`logprobs_and_entropy`; below 4096 rows 20 calls back to back per sample) over the same inputs, the carveouts interleaved round by round (same GPU state).
-1 is the driver's default (no preference).

    python benchmarks/cluster_carveout.py [--rows 32768 1024] [--carveouts -1 100] [--reps 10] [--out file.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics

import torch

import rl_logp
from rl_logp.engines.fused import config_from_environment
from rl_logp.kernels import cluster_launch, cuda_source

PREFERRED_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
CASES = {  # name: (temperature, entropy)
    "t1": (None, False), "t07": (0.7, False), "t1_entropy": (None, True), "t07_entropy": (0.7, True)}


class _Shape(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attributes", ctypes.c_void_p),
                ("attribute_count", ctypes.c_uint)]


def _launch(x: torch.Tensor, labels: torch.Tensor, temperature: float | None,
            entropy: bool) -> cluster_launch.ClusterLaunch:
    """The cluster launch a public API call on `x` makes (RL_LOGP_FUSED_CONFIG's launch parameters, as the
    API takes them), built over scratch outputs, not launched: its loaded variant, blocks and shared bytes."""
    cfg = config_from_environment()
    n = x.shape[0]
    outs = tuple(torch.empty(n, device=x.device) for _ in range(4)) + ((torch.empty(n, device=x.device),)
                                                                      if entropy else (None,))
    return cluster_launch.ClusterLaunch(x, labels, temperature, entropy, outs, None, cfg.cluster_threads,
                                        cfg.cluster_slice_bytes, cfg.cluster_wait_ns)


def occupancy(fn: cuda_source.Function, cluster: int, shared: int, threads: int) -> dict:
    cuda = cuda_source._driver()
    blocks, clusters = ctypes.c_int(), ctypes.c_int()
    with cuda_source.current(fn.context):
        cuda_source._check(cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(blocks), fn.handle, ctypes.c_int(threads), ctypes.c_size_t(shared)), "occupancy query")
        shape = _Shape(cluster * 1024, 1, 1, threads, 1, 1, shared, None, None, 0)
        cuda_source._check(cuda.cuOccupancyMaxActiveClusters(ctypes.byref(clusters), fn.handle, ctypes.byref(shape)),
                           "cluster occupancy query")
    return {"blocks_per_sm": blocks.value, "active_clusters": clusters.value}


def set_carveout(fn: cuda_source.Function, percent: int) -> None:
    cuda = cuda_source._driver()
    with cuda_source.current(fn.context):
        cuda_source._check(cuda.cuFuncSetAttribute(fn.handle, PREFERRED_CARVEOUT, percent), "carveout setting")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32768, 1024])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--carveouts", type=int, nargs="+", default=[-1, 100])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cuda = cuda_source._driver()
    cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                                 ctypes.c_int, ctypes.c_size_t]
    cuda.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                  ctypes.POINTER(_Shape)]
    torch.manual_seed(0)
    rows_out = []
    print(f"{'rows':>6} {'case':12} {'carveout':>8} {'blocks/SM':>9} {'clusters':>8} {'median ms':>10} {'min ms':>8}")
    for n in args.rows:
        x = (torch.randn(n, args.vocab, device="cuda") * 3).to(torch.bfloat16)
        labels = torch.randint(0, args.vocab, (n,), device="cuda")
        for case in args.cases:
            temperature, entropy = CASES[case]

            def call(x=x, labels=labels, temperature=temperature, entropy=entropy):
                with torch.no_grad():
                    if entropy:
                        return rl_logp.logprobs_and_entropy(x, labels, temperature=temperature)
                    return rl_logp.logprobs(x, labels, temperature=temperature)

            reference = call()  # loads the variant; the bits every carveout must give
            launch = _launch(x, labels, temperature, entropy)
            fn, cluster, shared = launch.function, launch.grid // n, launch.shared
            times = {c: [] for c in args.carveouts}
            inner = 1 if n >= 4096 else 20  # small calls: back to back, the GPU time of each
            for _ in range(args.reps):
                for carveout in args.carveouts:
                    set_carveout(fn, carveout)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(inner):
                        got = call()
                    end.record()
                    end.synchronize()
                    times[carveout].append(start.elapsed_time(end) / inner)
                    same = all(torch.equal(a, b) for a, b in zip(
                        reference if entropy else (reference,), got if entropy else (got,), strict=True))
                    if not same:
                        raise SystemExit(f"{case} at carveout {carveout}: the bits changed")
            for carveout in args.carveouts:
                set_carveout(fn, carveout)
                row = {"rows": n, "vocab": args.vocab, "case": case, "carveout": carveout,
                       **occupancy(fn, cluster, shared, launch.threads), "median_ms": statistics.median(times[carveout]),
                       "min_ms": min(times[carveout]), "times_ms": times[carveout],
                       "gpu": torch.cuda.get_device_name()}
                rows_out.append(row)
                print(f"{n:6d} {case:12} {carveout:8d} {row['blocks_per_sm']:9d} {row['active_clusters']:8d} "
                      f"{row['median_ms']:10.4f} {row['min_ms']:8.4f}", flush=True)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
