"""Benchmark of selected-token logp / entropy providers: time as a multiple of the HBM floor, peak memory.

For N rows x V (default Qwen's 151936) bf16 logits it times, side by side in one run (CUDA events, warm-up,
median of --reps, two input sets rotated so no run reads the previous one's L2):
  logp        fused (rl-logp), chunked (N <= 8192), torch log_softmax+gather, flash-attn's Triton cross
              entropy, Liger's cross entropy, quack's (each when importable), at T = 1 and T = 0.7
  entropy     fused, and torch's entropy formula (verl's `entropy_from_logits`) under
              torch.compile(dynamic=True), as verl's FSDP engine runs it
  logp+entropy  fused `logprobs_and_entropy` (one read, one combined backward)
forward and forward+backward, each over the floor measured in the same run (bytes moved: forward one read
of the logits, backward one read + one write; over the device-to-device copy bandwidth).
`--sweep` times launch variants of the fused kernels (FusedConfig) at the largest N; `--rollout` times
one call per decode step at N in {1, 8, 64, 256, 1024} (wall time, synchronized, launches included:
what vLLM's sampler sees). Batch invariance: rows scored alone vs in the batch, 64 probes.
Prints a table last and writes JSON (--out). `--smoke` runs tiny shapes on the CPU (torch, chunked,
fused under TRITON_INTERPRET=1) so CI keeps this script working.

    python benchmarks/bench_logp.py --out benchmarks/results/h200_bench.json
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # Triton reads this when the kernels are decorated, so before any import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import dataclasses
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

import rl_logp

Provider = Callable[..., object]  # (x, y, temperature) -> logp | entropy | (logp, entropy)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, nbytes: int = 4 << 30, reps: int = 20) -> float:
    """Bytes read + written per second of a device-to-device copy (a nominal 1e11 on the CPU smoke run)."""
    if device.type != "cuda":
        return 1e11
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = _median_ms(lambda i: dst.copy_(src), reps, device)
    return 2 * nbytes / (ms / 1e3)


def _median_ms(fn: Callable[[int], object], reps: int, device: torch.device, warmup: int = 3) -> float:
    times = []
    for i in range(warmup + reps):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i)
            stop.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(stop)
        else:
            t0 = time.perf_counter()
            fn(i)
            elapsed = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def _flash_attn_ce():
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss
    except ImportError as err:
        return None, str(err)
    return cross_entropy_loss, ""


def logp_providers(device: torch.device, smoke: bool) -> tuple[dict[str, Provider], dict[str, str]]:
    found: dict[str, Provider] = {
        "fused": lambda x, y, t: rl_logp.logprobs(x, y, backend="fused", temperature=t),
        "chunked": lambda x, y, t: rl_logp.logprobs(x, y, backend="chunked", temperature=t),
        "torch": lambda x, y, t: rl_logp.logprobs(x, y, backend="torch", temperature=t),
    }
    missing: dict[str, str] = {}
    if smoke:
        return found, missing
    ce, why = _flash_attn_ce()
    if ce is not None:
        found["flash_attn"] = lambda x, y, t: -ce(x if t is None else x / t, y, inplace_backward=False)[0]
    else:
        missing["flash_attn"] = why
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy

        found["liger"] = lambda x, y, t: -liger_cross_entropy(x if t is None else x / t, y, reduction="none")
    except ImportError as err:
        missing["liger"] = str(err)
    try:
        from quack.cross_entropy import cross_entropy as quack_cross_entropy

        found["quack"] = lambda x, y, t: -quack_cross_entropy(x if t is None else x / t, y, reduction="none")
    except ImportError as err:
        missing["quack"] = str(err)
    return found, missing


def _torch_entropy(logits: torch.Tensor) -> torch.Tensor:
    """verl 0.9.1's `entropy_from_logits` (verl/utils/torch_functional.py): logsumexp - sum(softmax * x)."""
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def entropy_providers(smoke: bool) -> dict[str, Provider]:
    compiled = torch.compile(_torch_entropy, dynamic=True)
    found: dict[str, Provider] = {
        "fused": lambda x, y, t: rl_logp.entropy(x, backend="fused", temperature=t),
        "torch-compiled (verl's formula)": lambda x, y, t: compiled(x if t is None else x.float() / t),
    }
    if smoke:
        found["chunked"] = lambda x, y, t: rl_logp.entropy(x, backend="chunked", temperature=t)
    return found


def both_providers() -> dict[str, Provider]:
    return {"fused": lambda x, y, t: rl_logp.logprobs_and_entropy(x, y, backend="fused", temperature=t)}


def _loss(out) -> torch.Tensor:
    if isinstance(out, tuple):
        return out[0].float().sum() + out[1].float().sum()
    return out.float().sum()


def time_provider(fn: Provider, inputs: list[torch.Tensor], labels: torch.Tensor, temperature, reps: int,
                  device: torch.device) -> dict:
    """Forward (no grad) and forward+backward (the gradient buffer is the peak above the inputs)."""
    leaves = [x.detach().requires_grad_(True) for x in inputs]

    def forward(i):
        with torch.no_grad():
            fn(leaves[i % 2], labels, temperature)

    def both(i):
        x = leaves[i % 2]
        x.grad = None
        _loss(fn(x, labels, temperature)).backward()

    fwd = _median_ms(forward, reps, device)
    _sync(device)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    both(0)
    _sync(device)
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else 0
    fb = _median_ms(both, reps, device)
    for x in leaves:
        x.grad = None
    return {"forward_ms": fwd, "fwd_bwd_ms": fb, "peak_extra_bytes": peak}


def batch_mismatches(fn: Provider, x: torch.Tensor, labels: torch.Tensor, temperature, probes: int = 64) -> int:
    """Rows whose result differs when scored alone vs inside the full batch."""
    with torch.no_grad():
        full = fn(x, labels, temperature)
        full = full[0] if isinstance(full, tuple) else full
        bad = 0
        for i in torch.linspace(0, x.shape[0] - 1, probes).long().tolist():
            one = fn(x[i : i + 1], labels[i : i + 1], temperature)
            one = one[0] if isinstance(one, tuple) else one
            bad += int(one.float().view(torch.int32) != full[i : i + 1].float().view(torch.int32))
        return bad


def make_inputs(n: int, vocab: int, device: torch.device, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    xs = [(torch.randn(n, vocab, device=device, generator=gen) * 2.5 - 3).to(torch.bfloat16) for _ in range(2)]
    return xs, torch.randint(0, vocab, (n,), device=device, generator=gen)


def run_main(args, device, bandwidth) -> list[dict]:
    results = []
    lp, missing = logp_providers(device, args.smoke)
    for name, why in missing.items():
        print(f"{name}: not run ({why})", file=sys.stderr)
        results.append({"suite": "logp", "provider": name, "error": f"not importable: {why}"})
    for n in args.rows:
        inputs, labels = make_inputs(n, args.vocab, device, n)
        elem_bytes = n * args.vocab * 2
        floor = {"forward_ms": elem_bytes / bandwidth * 1e3, "fwd_bwd_ms": 3 * elem_bytes / bandwidth * 1e3}
        suites = [("logp", lp, None), ("logp T=0.7", lp, 0.7), ("entropy", entropy_providers(args.smoke), None),
                  ("entropy T=0.7", entropy_providers(args.smoke), 0.7), ("logp+entropy", both_providers(), None),
                  ("logp+entropy T=0.7", both_providers(), 0.7)]
        for suite, providers, temperature in suites:
            for name, fn in providers.items():
                if name == "chunked" and n > 8192 and not args.smoke:
                    continue
                row = {"suite": suite, "provider": name, "rows": n, "vocab": args.vocab, "temperature": temperature,
                       "logits_bytes": elem_bytes, "floor": floor}
                try:
                    reps = args.reps if name != "chunked" else max(3, args.reps // 5)
                    row.update(time_provider(fn, inputs, labels, temperature, reps, device))
                    if n == args.rows[0] or args.smoke:
                        row["batch_mismatch_rows_of_64"] = batch_mismatches(fn, inputs[0], labels, temperature,
                                                                             probes=8 if args.smoke else 64)
                except Exception as err:  # a provider failing is reported, the run goes on
                    row["error"] = f"{type(err).__name__}: {err}"
                results.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "floor"}), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        del inputs
    return results


def time_variant(engine, inputs: list[torch.Tensor], labels: torch.Tensor, vocab: int, reps: int,
                 device: torch.device) -> dict:
    """Forward (logp, logp+entropy; T = 1 and 0.7) and backward times of one FusedEngine, in ms."""
    from rl_logp.temperature import Temperature

    n = labels.shape[0]
    times = {}
    temps = (("t1", Temperature()), ("t07", Temperature(scalar=0.7)))
    for label, temp in temps:
        for ent in (False, True):
            key = f"forward_{label}{'_entropy' if ent else ''}_ms"
            times[key] = _median_ms(lambda i, t=temp, e=ent: engine.row_stats(inputs[i % 2], t, labels, 40, e),
                                    reps, device)
    stats = engine.row_stats(inputs[0], Temperature(), labels, 40, True)
    g = torch.ones(n, device=device)
    out = torch.empty_like(inputs[0])

    def grad(i, temp, g_entropy):
        engine.grad(inputs[i % 2], temp, labels, 0, vocab, stats.row_max, stats.log_sum, stats.entropy, g,
                    g_entropy, out)

    for label, temp in temps:
        times[f"backward_{label}_ms"] = _median_ms(lambda i, t=temp: grad(i, t, None), reps, device)
    times["backward_t1_entropy_ms"] = _median_ms(lambda i: grad(i, Temperature(), g), reps, device)
    return times


def run_sweep(args, device, bandwidth) -> list[dict]:
    from rl_logp.kernels.fused_engine import FusedConfig, FusedEngine
    from rl_logp.kernels.fused_forward import DIV_RECIPROCAL, QUANT_CAST

    n = args.rows[-1]
    inputs, labels = make_inputs(n, args.vocab, device, 7)
    base = FusedConfig()
    pipe = [dataclasses.replace(base, pipeline_chunk=c, pipeline_warps=w, pipeline_programs_per_sm=p, pipeline_stages=st)
            for c, w, p, st in [(8192, 16, 1, 1), (16384, 16, 1, 1), (16384, 32, 1, 1), (8192, 32, 1, 1),
                                (4096, 16, 1, 1), (8192, 16, 2, 1), (8192, 16, 1, 2), (16384, 32, 1, 2)]]
    segmented = dataclasses.replace(base, pipeline_min_rows=1 << 40)
    variants = [base, *pipe, dataclasses.replace(base, quant=QUANT_CAST), dataclasses.replace(base, div=DIV_RECIPROCAL),
                dataclasses.replace(segmented, seg=8192, chunk=2048),
                *[dataclasses.replace(segmented, seg=262144, chunk=4096, warps=8, programs_per_sm=p) for p in (2, 4, 8)],
                *[dataclasses.replace(base, grad_block=b, grad_warps=w) for b, w in [(8192, 8), (2048, 4), (4096, 4)]]]
    if args.smoke:
        variants = variants[:2]
    elem_bytes = n * args.vocab * 2
    results = []
    for cfg in variants:
        engine = FusedEngine(cfg)
        name = ",".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                        if getattr(cfg, f.name) != getattr(base, f.name)) or "default"
        row = {"suite": "sweep", "provider": f"fused[{name}]", "rows": n, "vocab": args.vocab,
               "floor": {"forward_ms": elem_bytes / bandwidth * 1e3, "backward_ms": 2 * elem_bytes / bandwidth * 1e3}}
        try:
            row.update(time_variant(engine, inputs, labels, args.vocab, args.reps, device))
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "floor"}), flush=True)
    return results


def run_rollout(args, device) -> list[dict]:
    """One call per decode step, as vLLM's sampler makes it: wall time with launches, synchronized."""
    lp, _ = logp_providers(device, args.smoke)
    calls = {name: lp[name] for name in ("fused", "torch", "flash_attn") if name in lp}
    results = []
    for n in ([1, 8] if args.smoke else [1, 8, 64, 256, 1024]):
        inputs, labels = make_inputs(n, args.vocab, device, 100 + n)
        for temperature in (None, 0.7):
            for name, fn in calls.items():
                row = {"suite": "rollout", "provider": name, "rows": n, "vocab": args.vocab, "temperature": temperature}
                try:
                    with torch.no_grad():
                        for _ in range(5):
                            fn(inputs[0], labels, temperature)
                        _sync(device)
                        walls = []
                        for i in range(args.rollout_reps):
                            t0 = time.perf_counter()
                            fn(inputs[i % 2], labels, temperature)
                            _sync(device)
                            walls.append((time.perf_counter() - t0) * 1e6)
                        row["wall_us"] = statistics.median(walls)
                        row["cuda_us"] = _median_ms(
                            lambda i, f=fn, t=temperature, xs=inputs, y=labels: f(xs[i % 2], y, t),
                            args.rollout_reps, device) * 1e3
                except Exception as err:
                    row["error"] = f"{type(err).__name__}: {err}"
                results.append(row)
                print(json.dumps(row), flush=True)
    return results


def _timed_call(engine, kind: str, inputs: list[torch.Tensor], labels: torch.Tensor, temp, vocab: int):
    """fn(i) running one forward or backward of `engine` on input set i % 2."""
    if kind == "forward":
        return lambda i: engine.row_stats(inputs[i % 2], temp, labels, 40, False)
    stats = engine.row_stats(inputs[0], temp, labels, 40, False)
    g, out = torch.ones(labels.shape[0], device=labels.device), torch.empty_like(inputs[0])
    return lambda i: engine.grad(inputs[i % 2], temp, labels, 0, vocab, stats.row_max, stats.log_sum, None, g, None,
                                 out)


def run_autotune(args, device, bandwidth) -> list[dict]:
    """Time forward and backward variants of the fused kernels at the largest N, pick the fastest
    (forward: T = 1 plus T = 0.7; backward likewise), write the choice as RL_LOGP_FUSED_CONFIG JSON to
    --tuned (later stages of the device run export it) and use it for the rest of this run."""
    from rl_logp import backends
    from rl_logp.kernels import fused_engine
    from rl_logp.kernels.fused_forward import DIV_IEEE, DIV_RECIPROCAL
    from rl_logp.temperature import Temperature

    n = args.rows[-1]
    inputs, labels = make_inputs(n, args.vocab, device, 11)
    base = fused_engine.FusedConfig()
    segmented = {"pipeline_min_rows": 1 << 40}
    forward = [{**segmented, "seg": 262144, "chunk": c, "warps": w, "programs_per_sm": p}
               for c, w, p in [(4096, 8, 8), (4096, 8, 4), (8192, 16, 4)]]
    forward += [{**segmented, "seg": 8192, "chunk": 2048},
                {"pipeline_chunk": 16384, "pipeline_warps": 32, "pipeline_programs_per_sm": 1}]
    backward = [{"grad_block": b, "grad_warps": w} for b, w in [(4096, 8), (8192, 8), (2048, 4)]]
    if args.smoke:
        forward, backward = forward[:1], backward[:1]
    temps = (Temperature(), Temperature(scalar=0.7))
    results, best = [], {}
    for kind, variants in (("forward", forward), ("backward", backward)):
        for div in (DIV_IEEE, DIV_RECIPROCAL):
            for overrides in variants:
                cfg = dataclasses.replace(base, div=div, **overrides)
                engine = fused_engine.FusedEngine(cfg)
                row = {"suite": "autotune", "kind": kind, "config": {**overrides, "div": div}, "rows": n}
                try:
                    times = [_median_ms(_timed_call(engine, kind, inputs, labels, t, args.vocab), args.reps, device)
                             for t in temps]
                    row.update(t1_ms=times[0], t07_ms=times[1])
                    if (kind, div) not in best or sum(times) < best[kind, div][0]:
                        best[kind, div] = (sum(times), overrides)
                except Exception as err:
                    row["error"] = f"{type(err).__name__}: {err}"
                results.append(row)
                print(json.dumps(row), flush=True)
    # one division for both kernels: the one with the smaller best forward + best backward
    div = min((DIV_IEEE, DIV_RECIPROCAL), key=lambda d: best["forward", d][0] + best["backward", d][0])
    chosen = {**best["forward", div][1], **best["backward", div][1], "div": div}
    os.environ[fused_engine.TUNING_VARIABLE] = json.dumps(chosen)
    backends.make_engine.cache_clear()
    if args.tuned:
        with open(args.tuned, "w") as f:
            json.dump(chosen, f)
    results.append({"suite": "autotune", "kind": "chosen", "config": chosen})
    print("chosen fused config:", json.dumps(chosen), flush=True)
    return results


def run_overhead(args, device) -> list[dict]:
    """Host time per rollout-size call, piece by piece (no sync inside the loop: launches queue up)."""
    from rl_logp.config import resolve_config
    from rl_logp.kernels.fused_engine import FusedEngine
    from rl_logp.temperature import Temperature
    from rl_logp.validation import prepare_inputs

    inputs, labels = make_inputs(8, args.vocab, device, 5)
    x = inputs[0]
    engine = FusedEngine()
    temp = Temperature(scalar=0.7)
    pieces = {
        "rl_logp.logprobs (no grad)": lambda: rl_logp.logprobs(x, labels, temperature=0.7),
        "resolve_config": lambda: resolve_config(None),
        "prepare_inputs": lambda: prepare_inputs(x, labels, 0.7),
        "FusedEngine.row_stats (allocs + launch)": lambda: engine.row_stats(x, temp, labels, 40, False),
        "torch.zeros(34)": lambda: torch.zeros(34, dtype=torch.int64, device=device),
        "log_softmax + gather": lambda: torch.log_softmax(x.float() / 0.7, -1).gather(1, labels[:, None]),
    }
    results = []
    with torch.no_grad():
        for name, fn in pieces.items():
            for _ in range(10):
                fn()
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(args.rollout_reps):
                fn()
            host = (time.perf_counter() - t0) / args.rollout_reps * 1e6
            _sync(device)
            row = {"suite": "overhead", "provider": name, "rows": 8, "host_us": host}
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def print_table(results: list[dict]) -> None:
    print(f"\n{'suite':20s} {'provider':36s} {'N':>6s} {'fwd ms':>8s} {'x flr':>6s} {'f+b ms':>8s} {'x flr':>6s} "
          f"{'peak GiB':>8s} {'mism':>4s}")
    for r in results:
        if r.get("suite") in ("sweep", "rollout", "overhead", "autotune"):
            continue
        if "error" in r:
            print(f"{r['suite']:20s} {r['provider']:36s} {r.get('rows', 0):6d} error: {r['error'][:60]}")
            continue
        f = r["floor"]
        print(f"{r['suite']:20s} {r['provider']:36s} {r['rows']:6d} {r['forward_ms']:8.3f} "
              f"{r['forward_ms'] / f['forward_ms']:6.2f} {r['fwd_bwd_ms']:8.3f} {r['fwd_bwd_ms'] / f['fwd_bwd_ms']:6.2f} "
              f"{r['peak_extra_bytes'] / 2**30:8.2f} {r.get('batch_mismatch_rows_of_64', ''):>4}")
    sweep = [r for r in results if r.get("suite") == "sweep" and "error" not in r]
    if sweep:
        keys = [k for k in sweep[0] if k.endswith("_ms")]
        print(f"\n{'sweep variant':60s} " + " ".join(f"{k.replace('_ms', ''):>18s}" for k in keys))
        for r in sweep:
            print(f"{r['provider'][:60]:60s} " + " ".join(f"{r[k]:18.3f}" for k in keys))
    for r in results:
        if r.get("suite") == "overhead":
            print(f"host per call {r['provider']:45s} {r['host_us']:8.1f} us")
    for r in results:
        if r.get("suite") == "autotune" and "t1_ms" in r:
            print(f"autotune {r['kind']:8s} {json.dumps(r['config'])[:90]:90s} {r['t1_ms']:7.3f} {r['t07_ms']:7.3f}")
    rollout = [r for r in results if r.get("suite") == "rollout"]
    if rollout:
        print(f"\n{'rollout call':14s} {'N':>5s} {'T':>4s} {'wall us':>9s} {'cuda us':>9s}")
        for r in rollout:
            if "error" in r:
                print(f"{r['provider']:14s} {r['rows']:5d} error: {r['error'][:60]}")
                continue
            print(f"{r['provider']:14s} {r['rows']:5d} {r['temperature'] or 1.0:4.1f} {r['wall_us']:9.1f} {r['cuda_us']:9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rollout-reps", type=int, default=200)
    parser.add_argument("--suites", nargs="+", default=["main", "rollout"], choices=["autotune", "main", "sweep", "rollout", "overhead"])
    parser.add_argument("--tuned", help="autotune: where to write the chosen RL_LOGP_FUSED_CONFIG JSON")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (fused under TRITON_INTERPRET=1)")
    parser.add_argument("--out", default="benchmarks/results/bench_logp.json")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.vocab, args.reps, args.rollout_reps = [6], 1031, 2, 3
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth (read+write): {bandwidth / 1e12:.3f} TB/s on {device}", flush=True)
    results = []
    if "autotune" in args.suites:
        results += run_autotune(args, device, bandwidth)
    if "main" in args.suites:
        results += run_main(args, device, bandwidth)
    if "sweep" in args.suites:
        results += run_sweep(args, device, bandwidth)
    if "rollout" in args.suites:
        results += run_rollout(args, device)
    if "overhead" in args.suites:
        results += run_overhead(args, device)
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "copy_bandwidth_Bps": bandwidth,
        "command": " ".join(sys.argv),
        "fused_config": os.environ.get("RL_LOGP_FUSED_CONFIG", ""),
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_table(results)


if __name__ == "__main__":
    main()
