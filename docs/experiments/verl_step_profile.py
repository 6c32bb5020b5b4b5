"""verl 0.9.1's FSDP head step at T = 1 without entropy (the default cell), unpatched against patched:
where the patched step's extra time goes.

For 8192 and 32768 rows (V = 151936, bf16 logits from a matmul, as `benchmarks/bench_verl_step.py` builds
them, whose `StepBench`, engine stand-in and module stubs it reuses): the step's time from the logits to
d loss / d logits in 8 alternating rounds of 5 calls (CUDA events, the GPU idle at the start of each call,
as the benchmark times it); its host time per call with the GPU kept busy by a 50 ms sleep kernel queued
ahead (so the host never waits for it); and torch.profiler's table of 3 calls of each side (each kernel's
GPU time, each op's host time). Prints one JSON line per row count, then the tables; writes the rows to
$OUT/verl_t1_ab.json. On a CPU (no GPU) tiny shapes and no sleep: a smoke run of the script itself.

    PYTHONPATH=/tmp/pkg:/tmp/site:.whl/fa python -P docs/experiments/verl_step_profile.py
"""

import json
import os
import pathlib
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_verl_step as bench_module

SMOKE = not torch.cuda.is_available()
DEVICE = torch.device("cpu" if SMOKE else "cuda")


def patched_as(mode: str):
    """verl patched by rl-logp for the "patched" side (nothing for the other); returns the undo."""
    from rl_logp.integrations import verl as adapter

    if mode == "patched":
        adapter.apply()
    return adapter.revert


def main() -> None:
    bench_module.stub_missing_modules()
    import verl.utils.torch_functional as verl_f
    import verl.workers.engine.fsdp.transformer_impl as fsdp_engine

    vocab, hidden, seq = (1031, 32, 20) if SMOKE else (151936, 1024, 1024)
    engines = {mode: bench_module.make_engine(fsdp_engine, verl_f) for mode in ("unpatched", "patched")}
    rows_out = []
    for rows in [48] if SMOKE else [8192, 32768]:
        bench = bench_module.StepBench(rows, vocab, hidden, DEVICE, seq)
        calls = {mode: bench.fsdp_call(engines[mode], 1.0, False) for mode in engines}
        host = {}
        for mode in engines:
            restore = patched_as(mode)
            try:
                samples = []
                for i in range(6):
                    logits = (bench.hiddens[i % 2].requires_grad_(True) @ bench.weight).unsqueeze(0)
                    if not SMOKE:
                        torch.cuda.synchronize()
                        torch.cuda._sleep(50_000_000)  # the GPU busy: only the host's time is seen
                    t0 = time.perf_counter()
                    out = calls[mode](logits)
                    torch.autograd.grad(out["log_probs"].sum(), logits)
                    samples.append((time.perf_counter() - t0) * 1e3)
                    if not SMOKE:
                        torch.cuda.synchronize()
                host[mode] = statistics.median(samples[2:])
            finally:
                restore()
        times = {mode: [] for mode in engines}
        ratios = []
        for rnd in range(2 if SMOKE else 8):
            for mode in ("unpatched", "patched") if rnd % 2 == 0 else ("patched", "unpatched"):
                restore = patched_as(mode)
                try:
                    times[mode].append(bench.run(calls[mode], 2, 2 if SMOKE else 5)["fwd_bwd_ms"])
                finally:
                    restore()
            ratios.append(times["patched"][-1] / times["unpatched"][-1])
        row = {"rows": rows, "host_ms": host, "unpatched_ms": times["unpatched"], "patched_ms": times["patched"],
               "ratios": ratios, "median_ratio": statistics.median(ratios)}
        print(json.dumps(row), flush=True)
        rows_out.append(row)
        for mode in engines:
            restore = patched_as(mode)
            try:
                for i in range(2):
                    bench.measure(calls[mode], i)
                activities = [ProfilerActivity.CPU] + ([] if SMOKE else [ProfilerActivity.CUDA])
                with profile(activities=activities) as prof:
                    for i in range(3):
                        bench.measure(calls[mode], i)
            finally:
                restore()
            print(f"== {mode} rows={rows} (3 calls)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total" if SMOKE else "self_device_time_total",
                                            row_limit=18, max_name_column_width=70))
        del bench
        if not SMOKE:
            torch.cuda.empty_cache()
    out_dir = pathlib.Path(os.environ.get("OUT", "/tmp"))
    (out_dir / "verl_t1_ab.json").write_text(json.dumps(rows_out, indent=1))


if __name__ == "__main__":
    main()
