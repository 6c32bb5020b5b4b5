"""Benchmark of selected-token logp / entropy providers: time over the HBM floor, peak memory, host time.

Suites (`--suites`), each row written to the JSON (`--out`) as soon as it is measured:
  main     for N rows x V (Qwen's 151936) bf16 logits, through each provider's public function: rl-logp
           (`rl_logp.logprobs` / `entropy` / `logprobs_and_entropy`, backend auto), torch log_softmax +
           gather, flash-attn's Triton cross entropy (T != 1 through its own `logit_scale=1/T`), Liger's
           cross entropy (T != 1 on a divided copy: it has no scale), verl 0.9.1's own
           `logprobs_from_logits` and `torch.compile`d `entropy_from_logits` on verl's bf16 `x / T` (how
           its FSDP engine runs them); forward and forward+backward at T = 1 and 0.7. Every provider gets
           its own fresh inputs; forward+backward runs on a non-leaf copy of the logits made outside the
           timed region, with in-place backward where the provider has one (rl-logp, flash-attn: what verl
           uses). Floors: forward one read of the logits, forward+backward three passes (read, read +
           write), over the device-to-device copy bandwidth measured in the same run.
  sweep    launch variants of the fused kernels (`LaunchConfig`) at the largest N, kernel by kernel.
  rollout  one call per decode step at N in `--rollout-rows` (default 1, 8, 64, 256, 1024), the calls of
           one N timed in alternating rounds: wall time per call over a block of calls (synchronised at the
           end, host and launches included: what vLLM's sampler sees), host time per call (the block without
           waiting for the GPU), and GPU time per call (calls replayed from a CUDA graph: no host); the
           sampled token's logp, 21 columns per row (`column_logprobs`) and every column
           (`full_logprobs`), each beside the torch expression vLLM's own PyTorch code computes; with
           `--variants`, rl-logp's calls again under each set of launch overrides.
  overhead host time per call of each piece of a rollout-size `rl_logp.logprobs`, and of the rollout calls
           (`full_logprobs`, `column_logprobs`) with their plans and on the ordinary path.
  tp       the cost of the TP agreement per call: `rl_logp.logprobs` with a `tp_group` (an NCCL group of
           this one process on a GPU, gloo on the CPU) in `tp_agreement` modes `every_call` (a host sync)
           and `first_call`, beside the same call without a group, at rollout and training sizes.
Batch invariance: rows scored alone vs inside the batch. Prints a table last. `--smoke` runs tiny shapes
on the CPU (the fused kernels under TRITON_INTERPRET=1) so CI keeps this script working.

    python benchmarks/bench_logp.py --out benchmarks/results/h200_bench.json
    python benchmarks/bench_logp.py --suites sweep --rows 32768 --out /tmp/sweep.json
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # Triton reads this when the kernels are decorated, so before any import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import contextlib
import dataclasses
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

import rl_logp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling modules, also under `python -P`
import bench_verl_step
from bench_report import Report

Provider = Callable[..., object]  # (x, y, temperature) -> logp | entropy | (logp, entropy)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def host_us_per_call(fn, reps: int, device: torch.device, warmup: int) -> float:
    """Host microseconds per call of `fn` over `reps` calls issued back to back, after `warmup` calls and a
    sync (the GPU's work is not waited for inside the timing; it is drained after)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps * 1e6
    _sync(device)
    return host


def copy_bandwidth(device: torch.device, nbytes: int = 4 << 30, reps: int = 20) -> float:
    """Bytes read + written per second of a device-to-device copy (a nominal 1e11 on the CPU smoke run)."""
    if device.type != "cuda":
        return 1e11
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda i: dst.copy_(src), reps, device)
    return 2 * nbytes / (ms / 1e3)


def median_ms(fn: Callable[[int], object], reps: int, device: torch.device, warmup: int = 3,
              prepare: Callable[[int], object] | None = None) -> float:
    """Median time of fn(i) (CUDA events on the GPU); `prepare(i)` runs before each, outside the timing."""
    times = []
    for i in range(warmup + reps):
        arg = prepare(i) if prepare is not None else i
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(arg)
            stop.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(stop)
        else:
            t0 = time.perf_counter()
            fn(arg)
            elapsed = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def _bf16(t: float | None):
    return None if t is None else torch.tensor(t, dtype=torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _verl_functions():
    """verl 0.9.1's torch_functional module (its own logprobs_from_logits and entropy_from_logits), or the
    reason it is absent. Modules verl imports but these functions never call are stubbed where missing, as
    bench_verl_step.py does (the GPU image has no ray)."""
    bench_verl_step.stub_missing_modules()
    try:
        from verl.utils import torch_functional as verl_tf
    except ImportError as err:
        return None, f"verl not importable: {err}"
    return verl_tf, ""


def with_triton_forward(found: dict[str, Provider], missing: dict[str, str], call: Provider) -> None:
    """`call` again as "rl_logp triton", with the cluster forward off (`LaunchConfig.cluster_rows` 0: the
    Triton forward, which the default takes where the cluster forward does not apply, and for calls captured
    in a CUDA graph below `cluster_rows` rows): the same public call beside the default, in the same run."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        def triton_forward(x, y, t, ip):
            with engine_launch_config({"cluster_rows": 0}):
                return call(x, y, t, ip)

        found["rl_logp triton"] = triton_forward
    else:
        missing["rl_logp triton"] = "the default is the Triton forward here (no thread block clusters)"


def logp_providers(smoke: bool) -> tuple[dict[str, Provider], dict[str, str]]:
    found: dict[str, Provider] = {
        "rl_logp": lambda x, y, t, ip: rl_logp.logprobs(x, y, temperature=t, inplace_backward=ip),
        "torch log_softmax+gather": lambda x, y, t, ip: rl_logp.logprobs(x, y, backend="torch", temperature=t),
    }
    if smoke:
        found["rl_logp chunked"] = lambda x, y, t, ip: rl_logp.logprobs(x, y, backend="chunked", temperature=t)
    missing: dict[str, str] = {}
    with_triton_forward(found, missing, found["rl_logp"])
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss

        found["flash_attn CE"] = lambda x, y, t, ip: -cross_entropy_loss(
            x, y, logit_scale=1.0 if t is None else 1.0 / t, inplace_backward=ip)[0]
    except ImportError as err:
        missing["flash_attn CE"] = str(err)
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy

        found["liger CE"] = lambda x, y, t, ip: -liger_cross_entropy(x if t is None else x / t, y, reduction="none")
    except ImportError as err:
        missing["liger CE"] = str(err)
    verl_tf, why = _verl_functions()
    if verl_tf is not None:
        found["verl logprobs_from_logits"] = lambda x, y, t, ip: verl_tf.logprobs_from_logits(
            x if t is None else x / _bf16(t).to(x.device), y, inplace_backward=ip)
    else:
        missing["verl logprobs_from_logits"] = why
    return found, missing


def entropy_providers() -> tuple[dict[str, Provider], dict[str, str]]:
    found: dict[str, Provider] = {"rl_logp": lambda x, y, t, ip: rl_logp.entropy(x, temperature=t, inplace_backward=ip)}
    missing: dict[str, str] = {}
    with_triton_forward(found, missing, found["rl_logp"])
    verl_tf, why = _verl_functions()
    if verl_tf is None:
        return found, {**missing, "verl entropy_from_logits (compiled)": why}
    compiled = torch.compile(verl_tf.entropy_from_logits, dynamic=True)
    found["verl entropy_from_logits (compiled)"] = lambda x, y, t, ip: compiled(
        x if t is None else x / _bf16(t).to(x.device))
    return found, missing


def both_providers() -> tuple[dict[str, Provider], dict[str, str]]:
    found: dict[str, Provider] = {
        "rl_logp": lambda x, y, t, ip: rl_logp.logprobs_and_entropy(x, y, temperature=t, inplace_backward=ip),
    }
    missing: dict[str, str] = {}
    with_triton_forward(found, missing, found["rl_logp"])
    verl_tf, why = _verl_functions()
    if verl_tf is None:
        return found, {**missing, "verl logprobs + compiled entropy": why}
    compiled = torch.compile(verl_tf.entropy_from_logits, dynamic=True)

    def verl_both(x, y, t, ip):
        z = x if t is None else x / _bf16(t).to(x.device)
        return compiled(z), verl_tf.logprobs_from_logits(z, y, inplace_backward=False)

    found["verl logprobs + compiled entropy"] = verl_both
    return found, missing


def _loss(out) -> torch.Tensor:
    if isinstance(out, tuple):
        return out[0].float().sum() + out[1].float().sum()
    return out.float().sum()


def make_inputs(n: int, vocab: int, device: torch.device, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Two logits sets (rotated, so no timed call reads the previous one's L2) and labels."""
    gen = torch.Generator(device=device).manual_seed(seed)
    xs = [(torch.randn(n, vocab, device=device, generator=gen) * 2.5 - 3).to(torch.bfloat16) for _ in range(2)]
    return xs, torch.randint(0, vocab, (n,), device=device, generator=gen)


def time_provider(fn: Provider, inputs: list[torch.Tensor], labels: torch.Tensor, temperature, reps: int,
                  device: torch.device) -> dict:
    """Forward (no grad) and forward+backward on a fresh non-leaf copy per call (made outside the timing;
    in-place backward may overwrite it); peak memory above the inputs in forward+backward."""
    leaves = [x.detach().requires_grad_(True) for x in inputs]

    def forward(i):
        with torch.no_grad():
            fn(inputs[i % 2], labels, temperature, False)

    def fresh(i):
        leaves[i % 2].grad = None
        return leaves[i % 2].clone()

    def both(x):
        _loss(fn(x, labels, temperature, True)).backward()

    fwd = median_ms(forward, reps, device)
    x = fresh(0)
    _sync(device)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    both(x)
    _sync(device)
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else 0
    del x
    fb = median_ms(both, reps, device, prepare=fresh)
    for leaf in leaves:
        leaf.grad = None
    return {"forward_ms": fwd, "fwd_bwd_ms": fb, "peak_extra_bytes": peak}


def batch_mismatches(fn: Provider, x: torch.Tensor, labels: torch.Tensor, temperature, probes: int) -> int:
    """Rows whose result differs when scored alone vs inside the full batch."""
    with torch.no_grad():  # fresh copies: some providers (Liger) overwrite their input
        full = fn(x.clone(), labels, temperature, False)
        full = full[0] if isinstance(full, tuple) else full
        bad = 0
        for i in torch.linspace(0, x.shape[0] - 1, probes).long().tolist():
            one = fn(x[i : i + 1].clone(), labels[i : i + 1], temperature, False)
            one = one[0] if isinstance(one, tuple) else one
            bad += int(one.float().view(torch.int32) != full[i : i + 1].float().view(torch.int32))
        return bad


def run_main(args, device, bandwidth, report: Report) -> None:
    suites = []
    for name, (providers, missing) in (("logp", logp_providers(args.smoke)), ("entropy", entropy_providers()),
                                        ("logp+entropy", both_providers())):
        for provider, why in missing.items():
            report.add({"suite": name, "provider": provider, "error": f"not importable: {why}"})
        suites += [(name, providers, None), (f"{name} T=0.7", providers, 0.7)]
    for n in args.rows:
        elem_bytes = n * args.vocab * 2
        floor = {"forward_ms": elem_bytes / bandwidth * 1e3, "fwd_bwd_ms": 3 * elem_bytes / bandwidth * 1e3}
        for suite, providers, temperature in suites:
            for name, fn in providers.items():
                if name in ("torch log_softmax+gather", "rl_logp chunked") and n > 8192:
                    continue
                row = {"suite": suite, "provider": name, "rows": n, "vocab": args.vocab, "temperature": temperature,
                       "logits_bytes": elem_bytes, "floor": floor}
                try:
                    inputs, labels = make_inputs(n, args.vocab, device, n)  # fresh for every provider
                    if n == args.rows[0]:
                        row["batch_mismatch_rows_of_64"] = batch_mismatches(fn, inputs[0], labels, temperature,
                                                                             probes=8 if args.smoke else 64)
                    row.update(time_provider(fn, inputs, labels, temperature, args.reps, device))
                except Exception as err:  # a provider failing is reported, the run goes on
                    row["error"] = f"{type(err).__name__}: {err}"
                finally:
                    inputs = labels = None
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                report.add(row)


def sweep_variants(smoke: bool) -> list[dict]:
    """Overrides of `LaunchConfig` to time (the first is the default)."""
    if smoke:
        return [{}, {"chunk": 512, "lane": 8}]
    # The default takes the cluster forward at these rows (one HBM read per row: 4 blocks of 76 KB per bf16
    # row of 151936); beside it its other shapes and the Triton forward (`cluster_rows` 0), with one Triton
    # program per SM (132 rows in flight, 39 MB: does the second pass then come from L2?); the copy wait
    # suspended up to 10 ms a test instead of polling.
    forward = [{}, {"cluster_wait_ns": 10_000_000}, {"cluster_threads": 512}, {"cluster_slice_bytes": 49152},
               {"cluster_rows": 0},
               {"cluster_rows": 0, "programs_per_sm": 1, "warps": 32, "chunk": 16384}]
    backward = [{"grad_block": 8192, "grad_warps": 8}, {"grad_block": 2048, "grad_warps": 4}]
    return forward + backward


def run_sweep(args, device, bandwidth, report: Report) -> None:
    """Each variant's forward (T=1, T=0.7, with entropy) and backward (same three), engine-level calls."""
    from rl_logp.engines import RowStats
    from rl_logp.engines.fused import FusedEngine
    from rl_logp.kernels.launch import LaunchConfig
    from rl_logp.request import prepare_inputs

    n = args.rows[-1]
    inputs, labels = make_inputs(n, args.vocab, device, 7)
    cfg_settings = rl_logp.resolve_config(None)
    g = torch.ones(n, device=device)
    out = torch.empty_like(inputs[0])
    elem_bytes = n * args.vocab * 2
    floor = {"forward_ms": elem_bytes / bandwidth * 1e3, "backward_ms": 2 * elem_bytes / bandwidth * 1e3}
    for overrides in args.variants or sweep_variants(args.smoke):
        engine = FusedEngine(dataclasses.replace(LaunchConfig(), **overrides))
        row = {"suite": "sweep", "provider": json.dumps(overrides) if overrides else "default", "rows": n,
               "vocab": args.vocab, "floor": floor}
        try:
            for label, temperature, entropy in (("t1", None, False), ("t07", 0.7, False), ("t1_entropy", None, True)):
                reqs = [prepare_inputs(x, labels, temperature).request(cfg_settings, "fused", entropy=entropy,
                                                                       normalizer=True) for x in inputs]
                row[f"forward_{label}_ms"] = median_ms(lambda i, r=reqs, e=engine: e.row_stats(r[i % 2]), args.reps, device)
                s = engine.row_stats(reqs[0])
                stats = RowStats(row_max=s.row_max, log_sum=s.log_sum, entropy=s.entropy)
                row[f"backward_{label}_ms"] = median_ms(
                    lambda i, r=reqs, st=stats, e=entropy, eng=engine: eng.grad(r[i % 2], st, g, g if e else None, out),
                    args.reps, device)
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"
        report.add(row)


def _divided(x: torch.Tensor, temperature: float | None) -> torch.Tensor:
    return x.float() if temperature is None else x.float() / temperature


def rollout_calls(providers: dict, labels: torch.Tensor, ids: torch.Tensor) -> dict:
    """What a rollout asks per decode step, each call as fn(logits, temperature): the sampled token's logp
    (rl-logp and the peers of `logp_providers`), K = ids.shape[1] columns per row (the sampled token and
    the top-n: rl-logp's one launch vs log_softmax + gather, vLLM's own PyTorch rule), every column's logprob
    (rl-logp vs log_softmax in fp32, vLLM V1's `compute_logprobs`)."""
    k = ids.shape[1]
    calls = {name: (lambda x, t, fn=providers[name]: fn(x, labels, t, False))
             for name in ("rl_logp", "torch log_softmax+gather", "flash_attn CE") if name in providers}
    calls[f"rl_logp.column_logprobs K={k}"] = lambda x, t: rl_logp.column_logprobs(x, ids, temperature=t)
    calls[f"torch log_softmax+gather K={k}"] = lambda x, t: torch.log_softmax(_divided(x, t), -1).gather(1, ids)
    calls["rl_logp.full_logprobs"] = lambda x, t: rl_logp.full_logprobs(x, temperature=t)
    calls["torch log_softmax fp32"] = lambda x, t: torch.log_softmax(_divided(x, t), -1)
    return calls


@contextlib.contextmanager
def engine_launch_config(overrides: dict):
    """The public functions' fused engine with these `LaunchConfig` overrides, for the block."""
    from rl_logp.engines import make_engine

    engine = make_engine("fused", rl_logp.resolve_config(None).chunk_bytes)
    saved = engine.config
    engine.config = dataclasses.replace(saved, **overrides)
    try:
        yield
    finally:
        engine.config = saved


def graph_us(fn: Callable[[], object], calls: int, device: torch.device) -> float | None:
    """GPU time per call without the host: `calls` calls captured in one CUDA graph, replayed (None on the
    CPU). What the kernels cost once launches are free."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    stop.record()
    torch.cuda.synchronize()
    elapsed = start.elapsed_time(stop) * 1e3 / calls
    del graph
    torch.cuda.empty_cache()
    return elapsed


def run_rollout(args, device, report: Report) -> None:
    """One call per decode step, the calls of one (N, T) timed in alternating rounds (a drifting host hits
    each alike): per round a block of calls, host time (issuing them) and wall time (to the sync), the
    medians over rounds; and the GPU time from a CUDA graph. With `--variants`, rl-logp's calls again under
    each set of launch overrides (named in the provider)."""
    providers, _ = logp_providers(args.smoke)
    variants = [{}] + [v for v in args.variants or [] if v and device.type == "cuda"]
    rounds = 2 if args.smoke else 5
    block = max(1, args.rollout_reps // rounds)
    for n in ([1, 8] if args.smoke else args.rollout_rows):
        inputs, labels = make_inputs(n, args.vocab, device, 100 + n)
        ids = torch.cat([labels[:, None], torch.randint(0, args.vocab, (n, 20), device=device)], dim=1)
        for temperature in (None, 0.7):
            calls = [(f"{name} {json.dumps(overrides)}" if overrides else name, overrides, fn)
                     for overrides in variants for name, fn in rollout_calls(providers, labels, ids).items()
                     if not overrides or name.startswith("rl_logp")]
            rows = {name: {"suite": "rollout", "provider": name, "rows": n, "vocab": args.vocab,
                           "temperature": temperature, "host_us_rounds": [], "wall_us_rounds": []}
                    for name, _, _ in calls}
            with torch.no_grad():
                for name, overrides, fn in calls:
                    try:
                        with engine_launch_config(overrides):
                            for _ in range(10):
                                fn(inputs[0], temperature)
                            rows[name]["gpu_us"] = graph_us(lambda f=fn, t=temperature, x=inputs[0]: f(x, t), 20, device)
                    except Exception as err:
                        rows[name]["error"] = f"{type(err).__name__}: {err}"
                for r in range(rounds):
                    for name, overrides, fn in calls[r % len(calls):] + calls[:r % len(calls)]:
                        if "error" in rows[name]:
                            continue
                        with engine_launch_config(overrides):
                            _sync(device)
                            t0 = time.perf_counter()
                            for i in range(block):
                                fn(inputs[i % 2], temperature)
                            t1 = time.perf_counter()
                            _sync(device)
                            t2 = time.perf_counter()
                        rows[name]["host_us_rounds"].append((t1 - t0) / block * 1e6)
                        rows[name]["wall_us_rounds"].append((t2 - t0) / block * 1e6)
            for row in rows.values():
                if "error" not in row:
                    row["host_us"] = statistics.median(row["host_us_rounds"])
                    row["wall_us"] = statistics.median(row["wall_us_rounds"])
                report.add(row)


@contextlib.contextmanager
def stubbed_launches(*names: str):
    """The launches of `rl_logp.kernels.launch`'s cached launchers `names` (the forward kernel's,
    "row_stats_launch", by default) replaced by no-ops (the CPU: the interpreter's launch runs the kernel),
    so what is timed is the Python and torch work around them."""
    from rl_logp.kernels import launch

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **options: None

    launchers = [getattr(launch, name) for name in names or ("row_stats_launch",)]
    kernels = [launcher.kernel for launcher in launchers]
    for launcher in launchers:
        launcher.kernel = NoLaunch()
    try:
        yield
    finally:
        for launcher, kernel in zip(launchers, kernels, strict=True):
            launcher.kernel = kernel


def run_overhead(args, device, report: Report) -> None:
    """Host time per call, the loop not waiting for the GPU: the pieces of a rollout-size `rl_logp.logprobs`
    (8 rows, T=0.7), and that call and the two vLLM's adapter makes at every decode step (`full_logprobs`,
    `column_logprobs` of 21 ids) with their plans and on the ordinary path, beside torch's expressions, and
    two pieces of a plan's call (its signature; its output's allocation, beside `torch.empty`); on a GPU
    also the plans' launch alone (a BoundLaunch through Triton's launcher and through the CUDA driver, and
    `full_logprobs`' bound cluster launch) and the three calls with plans bound through the driver
    (`LaunchConfig.driver`). On the CPU (the fused
    kernels under the interpreter) the rollout calls run with the launch stubbed out."""
    from rl_logp import rollout_calls
    from rl_logp.engines import make_engine
    from rl_logp.engines.fused import _temperature_args
    from rl_logp.kernels import cluster_launch, launch
    from rl_logp.request import prepare_inputs

    inputs, labels = make_inputs(8, args.vocab, device, 5)
    x = inputs[0]
    ids = torch.randint(0, args.vocab, (8, 21), device=device, generator=torch.Generator(device).manual_seed(6))
    cfg = rl_logp.resolve_config(None)
    engine_name = rl_logp.resolve_backend("auto", device)
    engine = make_engine(engine_name, cfg.chunk_bytes)
    req = prepare_inputs(x, labels, 0.7).request(cfg, engine_name, entropy=False, normalizer=False)
    out = torch.empty(8, dtype=torch.float32, device=device)
    temp = _temperature_args(req.temperature)
    launch_config = getattr(engine, "config", launch.LaunchConfig())
    grid, kernel_args, options = launch.forward_launch(x, labels, *temp, None, (None, None, None, out, None), (None, None),
                                                    40, False, 0, 0, launch_config)
    stubbed = " (launch stubbed)" if device.type != "cuda" else ""
    prototype = torch.empty((), dtype=torch.float32, device=device).expand(x.shape)  # as `rollout_calls.Plan` holds
    fused = rl_logp.LogpConfig(backend="fused") if rl_logp.fused_runs_on(device) else cfg
    full = lambda: rl_logp.full_logprobs(x, config=fused)  # noqa: E731
    columns = lambda: rl_logp.column_logprobs(x, ids, config=fused)  # noqa: E731
    logp = lambda: rl_logp.logprobs(x, labels, temperature=0.7, config=fused)  # noqa: E731
    pieces = {
        "rl_logp.logprobs (no grad)": (lambda: rl_logp.logprobs(x, labels, temperature=0.7), None),
        "resolve_config": (lambda: rl_logp.resolve_config(None), None),
        "prepare_inputs": (lambda: prepare_inputs(x, labels, 0.7), None),
        "Inputs.request": (lambda: prepare_inputs(x, labels, 0.7).request(cfg, engine_name, entropy=False,
                                                                          normalizer=False), None),
        "engine.row_stats (output + launch)": (lambda: engine.row_stats(req), None),
        "kernels.launch.row_stats (launch only)": (lambda: launch.row_stats(x, labels, *temp, 40, False, None, None,
                                                                            None, out, None, launch_config), None),
        "torch.empty(8)": (lambda: torch.empty(8, dtype=torch.float32, device=device), None),
        "rollout_calls.signature (full_logprobs')": (lambda: rollout_calls.signature(("full", id(fused), None), x, None),
                                                     None),
        "torch.empty of [8, V] fp32 (the plans' output before)": (
            lambda: torch.empty(x.shape, dtype=torch.float32, device=device), None),
        "a plan's output, [8, V] fp32 (empty_like of its prototype)": (
            lambda: torch.empty_like(prototype, memory_format=torch.contiguous_format), None),
        "the kernel's launch alone (kernel[grid](...))": (
            lambda: launch.row_stats_kernel[grid](*kernel_args, **options), None),
        "the kernel's launch alone (launcher.CachedLauncher)": (
            lambda: launch.row_stats_launch(grid, kernel_args, options), None),
        "torch log_softmax + gather": (lambda: torch.log_softmax(x.float() / 0.7, -1).gather(1, labels[:, None]), None),
        f"rl_logp.logprobs (no grad, T=0.7), plan{stubbed}": (logp, contextlib.nullcontext),
        f"rl_logp.logprobs (no grad, T=0.7), ordinary path{stubbed}": (logp, rollout_calls.ordinary_path),
        f"rl_logp.full_logprobs, plan{stubbed}": (full, contextlib.nullcontext),
        f"rl_logp.full_logprobs, ordinary path{stubbed}": (full, rollout_calls.ordinary_path),
        f"rl_logp.column_logprobs of 21 ids, plan{stubbed}": (columns, contextlib.nullcontext),
        f"rl_logp.column_logprobs of 21 ids, ordinary path{stubbed}": (columns, rollout_calls.ordinary_path),
        "torch log_softmax (V1 compute_logprobs)": (lambda: x.log_softmax(-1, dtype=torch.float32), None),
        "torch log_softmax + gather of 21 ids": (lambda: x.log_softmax(-1, dtype=torch.float32).gather(1, ids), None),
    }
    if device.type == "cuda":  # the plans' launch: a BoundLaunch through Triton's launcher or the driver
        launch.row_stats_launch(grid, kernel_args, options)
        slots = [next(i for i, a in enumerate(kernel_args) if a is t) for t in (x, labels, out)]
        for how, direct in (("Triton's launcher", False), ("the CUDA driver", True)):
            bound = launch.row_stats_launch.bind(grid, kernel_args, options, slots, direct=direct)
            pieces[f"the kernel's launch alone (BoundLaunch, {how})"] = (functools.partial(bound, (x, labels, out)), None)
        full_out = rl_logp.full_logprobs(x, config=fused)
        cluster = launch.bind_row_stats(x, None, launch.TEMP_NONE.value, 1.0, 40, None, launch_config, full_out)
        if isinstance(cluster, cluster_launch.ClusterLaunch):  # where the cluster forward takes full_logprobs
            pieces["full_logprobs' bound cluster launch alone (ClusterLaunch, cuda_source.BoundKernel)"] = (
                functools.partial(cluster, (x, full_out)), None)

        @contextlib.contextmanager
        def driver_plans():
            """Plans bound with `LaunchConfig.driver` (every engine's launch parameters, for the block)."""
            saved = engine.config
            engine.config = dataclasses.replace(saved, driver=True)
            rollout_calls.clear()
            try:
                yield
            finally:
                engine.config = saved
                rollout_calls.clear()

        for name, fn in (("rl_logp.logprobs (no grad, T=0.7)", logp), ("rl_logp.full_logprobs", full),
                         ("rl_logp.column_logprobs of 21 ids", columns)):
            pieces[f"{name}, plan through the CUDA driver"] = (fn, driver_plans)
    else:
        for name in [name for name in pieces if "launch" in name and "row_stats (output" not in name and
                     "stubbed" not in name]:
            del pieces[name]
    with torch.no_grad():
        for name, (fn, path) in pieces.items():
            stub = stubbed_launches() if path is not None and stubbed else contextlib.nullcontext()
            with stub, (path or contextlib.nullcontext)():
                host = host_us_per_call(fn, args.rollout_reps, device, warmup=20)
            report.add({"suite": "overhead", "provider": name, "rows": 8, "host_us": host})


def run_tp(args, device, report: Report) -> None:
    """Wall time per call of a vocab-parallel call in each agreement mode (the group: this process alone)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        cuda = device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                **({"device_id": torch.device("cuda", torch.cuda.current_device())} if cuda else {}))
    calls = {
        "no tp_group": {},
        "tp_group, every_call": {"tp_group": dist.group.WORLD, "config": {"tp_agreement": "every_call"}},
        "tp_group, first_call": {"tp_group": dist.group.WORLD, "config": {"tp_agreement": "first_call"}},
    }
    for n in ([1, 8] if args.smoke else [1, 64, 1024, 8192]):
        inputs, labels = make_inputs(n, args.vocab, device, 300 + n)
        for name, kwargs in calls.items():
            row = {"suite": "tp", "provider": name, "rows": n, "vocab": args.vocab}
            with torch.no_grad():
                for _ in range(5):
                    rl_logp.logprobs(inputs[0], labels, temperature=0.7, **kwargs)
                _sync(device)
                reps = max(3, args.rollout_reps // (1 + n // 256))
                t0 = time.perf_counter()
                for i in range(reps):
                    rl_logp.logprobs(inputs[i % 2], labels, temperature=0.7, **kwargs)
                _sync(device)
                row["wall_us"] = (time.perf_counter() - t0) / reps * 1e6
            report.add(row)


def print_table(results: list[dict]) -> None:
    main = [r for r in results if r.get("suite") not in ("sweep", "rollout", "tp", "overhead")]
    print(f"\n{'suite':20s} {'provider':36s} {'N':>6s} {'fwd ms':>8s} {'x flr':>6s} {'f+b ms':>8s} {'x flr':>6s} "
          f"{'peak GiB':>8s} {'mism':>4s}")
    for r in main:
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
        print(f"\n{'sweep variant (x floor)':58s} " + " ".join(f"{k.replace('_ms', ''):>13s}" for k in keys))
        for r in sweep:
            cells = [r[k] / r["floor"]["forward_ms" if k.startswith("forward") else "backward_ms"] for k in keys]
            print(f"{r['provider'][:58]:58s} " + " ".join(f"{c:13.2f}" for c in cells))
    for r in results:
        if r.get("suite") == "sweep" and "error" in r:
            print(f"sweep {r['provider'][:50]} error: {r['error'][:80]}")
    rollout = [r for r in results if r.get("suite") == "rollout"]
    if rollout:
        print(f"\n{'rollout call':52s} {'N':>5s} {'T':>4s} {'wall us':>9s} {'host us':>9s} {'gpu us':>9s}")
        for r in rollout:
            if "error" in r:
                print(f"{r['provider'][:52]:52s} {r['rows']:5d} error: {r['error'][:60]}")
                continue
            gpu = f"{r['gpu_us']:9.1f}" if r.get("gpu_us") is not None else f"{'-':>9s}"
            print(f"{r['provider'][:52]:52s} {r['rows']:5d} {r['temperature'] or 1.0:4.1f} {r['wall_us']:9.1f} "
                  f"{r['host_us']:9.1f} {gpu}")
    for r in results:
        if r.get("suite") == "overhead":
            print(f"host per call {r['provider']:45s} {r['host_us']:8.1f} us")
    for r in results:
        if r.get("suite") == "tp":
            print(f"tp agreement {r['provider']:24s} N={r['rows']:5d} {r['wall_us']:9.1f} us per call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rollout-reps", type=int, default=200)
    parser.add_argument("--rollout-rows", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    parser.add_argument("--suites", nargs="+", default=["main", "rollout"], choices=["main", "sweep", "rollout", "tp", "overhead"])
    parser.add_argument("--variants", type=json.loads, default=None,
                        help="sweep: a JSON list of LaunchConfig overrides to time instead of the built-in list "
                             "(e.g. '[{}, {\"maxnreg\": 64}]'); rollout: rl-logp's calls again under each")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (fused under TRITON_INTERPRET=1)")
    parser.add_argument("--out", default="benchmarks/results/bench_logp.json")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.vocab, args.reps, args.rollout_reps = [6], 1031, 2, 3
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth (read+write): {bandwidth / 1e12:.3f} TB/s on {device}", flush=True)
    report = Report(args.out, echo=lambda row: print(json.dumps({k: v for k, v in row.items() if k != "floor"}),
                                                       flush=True), header={
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "copy_bandwidth_Bps": bandwidth,
        "command": " ".join(sys.argv),
        "fused_config": os.environ.get("RL_LOGP_FUSED_CONFIG", ""),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    })
    if "sweep" in args.suites:
        run_sweep(args, device, bandwidth, report)
    if "rollout" in args.suites:
        run_rollout(args, device, report)
    if "overhead" in args.suites:
        run_overhead(args, device, report)
    if "tp" in args.suites:
        run_tp(args, device, report)
    if "main" in args.suites:
        run_main(args, device, bandwidth, report)
    print_table(report.rows)


if __name__ == "__main__":
    main()
