"""Benchmark of selected-token logp providers on one GPU: time, % of the HBM floor, peak memory, bits.

For N in --rows x V (default Qwen's 151936) bf16 logits, it times forward, backward and forward+backward
(CUDA events, warm-up, median of --reps, two input sets rotated so no run reads the last one's L2) of:
torch (log_softmax + gather), chunked, fused (and --fused-variants of its launch parameters),
flash-attn's Triton cross entropy, Liger's cross entropy, and quack's cross entropy when importable.
The floor is bytes moved (forward: one read of the logits; backward: one read + one write) over the
device-to-device copy bandwidth measured in the same run. It also counts batch-invariance mismatches
(rows scored alone vs inside the batch) per provider. Prints a table, writes JSON (--out).

    python benchmarks/bench_logp.py --out benchmarks/results/h200_bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
from rl_logp.kernels.fused_logp import QUANT_SPLIT, FusedConfig, FusedEngine

import rl_logp

Provider = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def copy_bandwidth(nbytes: int = 4 << 30, reps: int = 20) -> float:
    """Bytes read + written per second of a device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 3):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        stop.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(stop) / 1e3)
    del src, dst
    return 2 * (nbytes // 2) * 2 / statistics.median(times)


def fused_provider(config: FusedConfig) -> Provider:
    engine = FusedEngine(config)

    def run(x, y):
        from rl_logp.dispatch import InvariantLogp

        return InvariantLogp.apply(x, y, None, engine, 40, None, False)

    return run


def providers(variants: list[FusedConfig]) -> dict[str, Provider]:
    found: dict[str, Provider] = {
        "torch": lambda x, y: rl_logp.logprobs(x, y, backend="torch"),
        "chunked": lambda x, y: rl_logp.logprobs(x, y, backend="chunked"),
        "fused": lambda x, y: rl_logp.logprobs(x, y, backend="fused"),
    }
    for cfg in variants:
        found[f"fused[{_variant_name(cfg)}]"] = fused_provider(cfg)
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss

        found["flash_attn"] = lambda x, y: -cross_entropy_loss(x, y, inplace_backward=False)[0]
    except ImportError as err:
        print(f"flash_attn: not run ({err})", file=sys.stderr)
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy

        found["liger"] = lambda x, y: -liger_cross_entropy(x, y, reduction="none")
    except ImportError as err:
        print(f"liger: not run ({err})", file=sys.stderr)
    try:
        from quack.cross_entropy import cross_entropy as quack_cross_entropy

        found["quack"] = lambda x, y: -quack_cross_entropy(x, y, reduction="none")
    except ImportError as err:
        print(f"quack: not run ({err})", file=sys.stderr)
    return found


def _variant_name(cfg: FusedConfig) -> str:
    default = FusedConfig()
    return ",".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name)) or "default"


def _median_ms(fn: Callable[[int], None], reps: int, warmup: int = 3) -> float:
    times = []
    for i in range(warmup + reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        stop.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def time_provider(fn: Provider, inputs: list[torch.Tensor], labels: torch.Tensor, reps: int) -> dict:
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    grad_out = torch.ones(labels.shape[0], device="cuda")

    def forward(i):
        with torch.no_grad():
            fn(leaves[i % len(leaves)], labels)

    outs = {}

    def prepare(i):
        x = leaves[i % len(leaves)]
        x.grad = None
        outs[i % len(leaves)] = fn(x, labels)

    def backward(i):
        outs[i % len(leaves)].backward(grad_out)

    def both(i):
        x = leaves[i % len(leaves)]
        x.grad = None
        fn(x, labels).backward(grad_out)

    fwd = _median_ms(forward, reps)
    bwd_times = []
    for i in range(3 + reps):
        prepare(i)
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        backward(i)
        stop.record()
        torch.cuda.synchronize()
        if i >= 3:
            bwd_times.append(start.elapsed_time(stop))
    outs.clear()
    for x in leaves:
        x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    both(0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for x in leaves:
        x.grad = None
    fb = _median_ms(both, reps)
    return {"forward_ms": fwd, "backward_ms": statistics.median(bwd_times), "fwd_bwd_ms": fb, "peak_extra_bytes": peak}


def batch_mismatches(fn: Provider, x: torch.Tensor, labels: torch.Tensor, probes: int = 64) -> int:
    """Rows whose logp differs when scored alone vs inside the full batch."""
    with torch.no_grad():
        full = fn(x, labels).float()
        idx = torch.linspace(0, x.shape[0] - 1, probes).long().tolist()
        return sum(int(fn(x[i : i + 1], labels[i : i + 1]).float().view(torch.int32) != full[i : i + 1].view(torch.int32)) for i in idx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--only", nargs="*", help="provider names to run (default: all found)")
    parser.add_argument("--variants-at", type=int, default=32768, help="N at which the fused variants run")
    parser.add_argument("--out", default="benchmarks/results/bench_logp.json")
    args = parser.parse_args()

    variants = [
        FusedConfig(split_row=False),
        FusedConfig(split_row=False, quant=QUANT_SPLIT),
        FusedConfig(split_segment=8192, split_warps=8),
        FusedConfig(split_segment=32768, split_warps=32),
        FusedConfig(split_segment=16384, split_warps=8),
    ]
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth (read+write): {bandwidth / 1e12:.3f} TB/s", flush=True)
    found = providers(variants)
    if args.only:
        found = {k: v for k, v in found.items() if k in args.only or k.split("[")[0] in args.only}
    results = []
    for n in args.rows:
        gen = torch.Generator(device="cuda").manual_seed(n)
        inputs = [
            (torch.randn(n, args.vocab, device="cuda", generator=gen, dtype=torch.float32) * 2.5 - 3).to(torch.bfloat16)
            for _ in range(2)
        ]
        labels = torch.randint(0, args.vocab, (n,), device="cuda", generator=gen)
        elem_bytes = n * args.vocab * 2
        floors = {
            "forward_ms": elem_bytes / bandwidth * 1e3,
            "backward_ms": 2 * elem_bytes / bandwidth * 1e3,
            "fwd_bwd_ms": 3 * elem_bytes / bandwidth * 1e3,
        }
        for name, fn in found.items():
            if "[" in name and n != args.variants_at:
                continue
            row = {"provider": name, "rows": n, "vocab": args.vocab, "logits_bytes": elem_bytes, "floor": floors}
            try:
                reps = args.reps if name != "chunked" else max(3, args.reps // 5)
                t0 = time.time()
                row.update(time_provider(fn, inputs, labels, reps))
                row["batch_mismatch_rows_of_64"] = batch_mismatches(fn, inputs[0], labels)
                row["wall_s"] = time.time() - t0
            except Exception as err:  # a provider failing is reported, the run goes on
                row["error"] = f"{type(err).__name__}: {err}"
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "floor"}), flush=True)
            torch.cuda.empty_cache()
        del inputs
        torch.cuda.empty_cache()

    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "copy_bandwidth_Bps": bandwidth,
        "command": " ".join(sys.argv),
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{'provider':44s} {'N':>6s} {'fwd ms':>8s} {'x':>5s} {'bwd ms':>8s} {'x':>5s} {'f+b ms':>8s} {'x':>5s} {'peak GiB':>8s} {'mism':>4s}")
    for r in results:
        if "error" in r:
            print(f"{r['provider']:44s} {r['rows']:6d} error: {r['error'][:60]}")
            continue
        f = r["floor"]
        print(
            f"{r['provider']:44s} {r['rows']:6d} {r['forward_ms']:8.3f} {r['forward_ms'] / f['forward_ms']:5.2f} "
            f"{r['backward_ms']:8.3f} {r['backward_ms'] / f['backward_ms']:5.2f} {r['fwd_bwd_ms']:8.3f} "
            f"{r['fwd_bwd_ms'] / f['fwd_bwd_ms']:5.2f} {r['peak_extra_bytes'] / 2**30:8.2f} {r['batch_mismatch_rows_of_64']:4d}"
        )


if __name__ == "__main__":
    main()
