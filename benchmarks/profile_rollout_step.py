"""Where the host time of one vLLM sampler step goes, unpatched and patched: cProfile of `--steps` steps of
one `bench_rollout` setting on each side, then the functions whose own time per step differs most between
the sides (patched minus unpatched: what the patch adds or removes), and each side's functions with the
most time of their own. First each side's host time per step without the profiler, medians over alternating
rounds (each step issued after the previous one finished, as `bench_rollout` times it, and back to back), for
five sides: unpatched, patched, and patched with rl-logp's scoring calls (`full_logprobs`,
`column_logprobs`) answered by torch's log_softmax instead (the rest of the patch alone: what the
adapter's wrappers cost beside the call), by an uninitialised output of the same shape (what the step
costs around a call that only allocates), or by rl-logp's own calls with their plans' kernel launch
skipped (the call's Python and allocation in the step, without the launch; these two leave their
outputs unwritten, for timing only); then the scoring call alone, rl-logp's against vLLM's
`log_softmax(dim=-1, dtype=float32)`, on the step's logits. On the V1 path, then the host time of each
stretch of the step between the entries and exits of the Sampler's `compute_logprobs`, `sample` and
`gather_logprobs` and of rl-logp's plan launch (`cuda_source.BoundKernel`), unpatched and patched (where
in the step the patched step's extra time lands). Then each torch op's own host time per step
under torch.profiler, patched minus unpatched (do vLLM's own ops cost more in the patched step?), and the
cProfile of both sides.

    PYTHONPATH=/tmp/vllm-0.24.0 python benchmarks/profile_rollout_step.py --path v1_sampler --batch 8

On a machine without CUDA, `--device cpu` runs the same steps on the CPU (rl-logp's `fused` backend under
TRITON_INTERPRET=1 with `--backend fused`; keep `--vocab` small there).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import itertools
import os
import pstats
import statistics
import sys
import time
from collections.abc import Iterator
from unittest import mock

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_rollout
import torch
from bench_logp import _sync, host_us_per_call
from bench_rollout import Setting, Step

import rl_logp

SIDES = ("unpatched", "patched", "patched, torch scores", "patched, empty scores", "patched, no launch")


def _torch_scores(logits: torch.Tensor, columns: torch.Tensor | None = None, **_: object) -> torch.Tensor:
    """What vLLM computes where the patch calls rl-logp: log_softmax in fp32 (and its columns)."""
    scores = logits.log_softmax(dim=-1, dtype=torch.float32)
    return scores if columns is None else scores.gather(-1, columns.long())


def _empty_scores(logits: torch.Tensor, columns: torch.Tensor | None = None, **_: object) -> torch.Tensor:
    """The scoring call's output, allocated and left unwritten."""
    shape = logits.shape if columns is None else columns.shape
    return torch.empty(shape, dtype=torch.float32, device=logits.device)


@contextlib.contextmanager
def side_scope(side: str, backend: str) -> Iterator[None]:
    """"unpatched", "patched" (`bench_rollout.side_scope`'s two sides), "patched, torch scores" (rl-logp's
    scoring calls answered by torch), "patched, empty scores" (by an unwritten output) or "patched, no
    launch" (rl-logp's calls whose plans launch nothing: a plan's bound launch answers True at once)."""
    with bench_rollout.side_scope(side != "unpatched", argparse.Namespace(backend=backend, driver=False)), \
            contextlib.ExitStack() as stack:
        answer = {"patched, torch scores": _torch_scores, "patched, empty scores": _empty_scores}.get(side)
        if answer is not None:
            for name in ("full_logprobs", "column_logprobs"):
                stack.enter_context(mock.patch.object(rl_logp, name, answer))
        if side == "patched, no launch":
            from rl_logp.kernels import cluster_launch, launcher

            for bound in (cluster_launch.ClusterLaunch, launcher.BoundLaunch):
                stack.enter_context(mock.patch.object(bound, "__call__", lambda self, tensors: True))
        yield


def host_samples(call, per_round: int, device: torch.device) -> tuple[list[float], float]:
    """(host us of each of `per_round` calls, each issued after the previous finished; host us per call of
    `per_round` calls back to back)."""
    each = []
    for _ in range(per_round):
        _sync(device)
        t0 = time.perf_counter()
        call()
        each.append((time.perf_counter() - t0) * 1e6)
    return each, host_us_per_call(call, per_round, device, warmup=0)


def interleaved_host_us(calls: dict[str, tuple], rounds: int, per_round: int,
                        device: torch.device) -> dict[str, tuple[float, float]]:
    """Per side (name: (call, scope)): (median host us of a call issued after the previous finished, median
    over rounds of the host us per call back to back), the sides alternating round by round."""
    each: dict[str, list[float]] = {name: [] for name in calls}
    back: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (call, scope) in calls.items():
            with scope():
                for _ in range(5):
                    call()
                samples, per_call = host_samples(call, per_round, device)
            each[name] += samples
            back[name].append(per_call)
    return {name: (statistics.median(each[name]), statistics.median(back[name])) for name in calls}


SEGMENT_MARKS = ("compute_logprobs", "sample", "gather_logprobs")  # V1 Sampler's methods, called in this order


@contextlib.contextmanager
def marked(marks: list) -> Iterator[None]:
    """Each call of the V1 Sampler's `SEGMENT_MARKS` methods and of a plan's driver launch
    (`cuda_source.BoundKernel`, "launch") appends (its name + ">", perf_counter) on entry and (name + "<",
    ...) on exit to `marks`. Entered inside a side's scope, so that it wraps what the patch installed."""
    from vllm.v1.sample.sampler import Sampler

    from rl_logp.kernels import cuda_source

    def wrap(name: str, fn):
        def timed(*args, **kwargs):
            marks.append((name + ">", time.perf_counter()))
            try:
                return fn(*args, **kwargs)
            finally:
                marks.append((name + "<", time.perf_counter()))
        return timed

    with contextlib.ExitStack() as stack:
        for name in SEGMENT_MARKS:
            found = Sampler.__dict__[name]
            static = isinstance(found, staticmethod)
            timed = wrap(name, found.__func__ if static else found)
            stack.enter_context(mock.patch.object(Sampler, name, staticmethod(timed) if static else timed))
        stack.enter_context(mock.patch.object(cuda_source.BoundKernel, "__call__",
                                              wrap("launch", cuda_source.BoundKernel.__call__)))
        yield


def segment_us(steps: dict[str, Step], backend: str, rounds: int, per_round: int,
               device: torch.device) -> dict[str, dict[str, tuple[float, float]]]:
    """Per side (unpatched, patched), the host us of each stretch of a V1 step between consecutive marks
    (`marked`: "start", a method's entry ">" and exit "<", "end"): medians of steps each issued after the
    previous finished, and of steps back to back (`host_samples`' two loops), the sides alternating round
    by round."""
    samples: dict[str, dict[str, tuple[list, list]]] = {side: {} for side in ("unpatched", "patched")}
    marks: list = []
    for _ in range(rounds):
        for side, by_stretch in samples.items():
            step, traced = steps[side], []

            def call(step=step, traced=traced) -> None:
                marks.clear()
                t0 = time.perf_counter()
                step()
                traced.append([("start", t0), *marks, ("end", time.perf_counter())])

            with side_scope(side, backend), marked(marks):
                for _ in range(5):
                    step()
                host_samples(call, per_round, device)
            for n, points in enumerate(traced):  # the first per_round issued after the previous finished
                for (a, ta), (b, tb) in itertools.pairwise(points):
                    by_stretch.setdefault(f"{a} -> {b}", ([], []))[n >= per_round].append((tb - ta) * 1e6)
    return {side: {stretch: (statistics.median(each), statistics.median(back))
                   for stretch, (each, back) in by_stretch.items()} for side, by_stretch in samples.items()}


def own_times(step: Step, steps: int, device: torch.device) -> dict[tuple, float]:
    """Each function's own time per step (us) under cProfile."""
    for _ in range(5):
        step()
    _sync(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    _sync(device)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, tottime, cumtime, callers)}
    return {func: row[2] / steps * 1e6 for func, row in stats.items()}


def op_times(step: Step, steps: int, device: torch.device) -> dict[str, float]:
    """Each torch op's own host time per step (us) under torch.profiler (CPU activity: the ops' own time,
    not the Python around them)."""
    for _ in range(5):
        step()
    _sync(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    return {event.key: event.self_cpu_time_total / steps for event in prof.key_averages()}


def _print_changes(title: str, base: dict, profile: dict, top: int, name=str) -> None:
    delta = {key: profile.get(key, 0.0) - base.get(key, 0.0) for key in set(profile) | set(base)}
    print(f"\n== {title}: unpatched total {sum(base.values()):.1f} us per step, patched {sum(profile.values()):.1f}; "
          f"patched minus unpatched (us), largest {top} changes")
    for key in sorted(delta, key=lambda k: -abs(delta[k]))[:top]:
        print(f"{delta[key]:+9.2f}  {name(key)}")


def _name(func: tuple) -> str:
    file, line, name = func
    return f"{name} ({os.path.basename(file)}:{line})" if line else name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="v1_sampler", choices=["v1_sampler", "v2_worker"])
    parser.add_argument("--mode", default="raw_logprobs", choices=["raw_logprobs", "processed_logprobs"])
    parser.add_argument("--num-logprobs", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds of the host timings")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--backend", default="auto", help="rl-logp backend of the patch")
    args = parser.parse_args()
    setting = Setting(args.path, args.mode, args.num_logprobs, args.dtype, args.temperature)
    device = torch.device(args.device)
    print(f"== {setting.name} B={args.batch} V={args.vocab} on {device}")
    steps = {}
    for side in SIDES:  # each built in its scope: V1's TopKTopPSampler binds its forward when built
        with side_scope(side, args.backend):
            steps[side] = Step(setting, args.batch, args.vocab, device, args.backend)
    logits = steps["unpatched"].pristine
    calls = {side: (steps[side], functools.partial(side_scope, side, args.backend)) for side in SIDES}
    calls |= {"rl_logp.full_logprobs alone": (lambda: rl_logp.full_logprobs(logits), contextlib.nullcontext),
              "torch log_softmax alone": (lambda: _torch_scores(logits), contextlib.nullcontext)}
    times = interleaved_host_us(calls, args.rounds, max(1, args.steps // args.rounds), device)
    print(f"host us per call without the profiler, medians over {args.rounds} alternating rounds: each call "
          "issued after the previous finished / back to back")
    for name, (each, back_to_back) in times.items():
        print(f"  {name:32s} {each:8.1f} {back_to_back:8.1f}")
    if args.path == "v1_sampler":
        stretches = segment_us(steps, args.backend, args.rounds, max(1, args.steps // args.rounds), device)
        print("\nhost us of each stretch of the step between the V1 Sampler's methods (and rl-logp's plan launch), "
              "medians: each step issued after the previous finished / back to back")
        names = list(stretches["patched"]) + [n for n in stretches["unpatched"] if n not in stretches["patched"]]
        print(f"  {'stretch':40s} {'unpatched':>17s} {'patched':>17s}")
        for name in names:
            cells = [stretches[side].get(name) for side in ("unpatched", "patched")]
            print(f"  {name:40s} " + " ".join("        -        " if c is None else f"{c[0]:8.1f} {c[1]:8.1f}"
                                              for c in cells))
    base_ops = op_times(steps["unpatched"], args.steps, device)
    with side_scope("patched", args.backend):
        patched_ops = op_times(steps["patched"], args.steps, device)
    _print_changes("each torch op's own host time per step under torch.profiler (what vLLM's ops cost in "
                   "each step, rl-logp's launch not among them)", base_ops, patched_ops, args.top)
    base = own_times(steps["unpatched"], args.steps, device)
    with side_scope("patched", args.backend):
        profile = own_times(steps["patched"], args.steps, device)
    _print_changes("own time per step under cProfile", base, profile, args.top, _name)
    for name, own in (("unpatched", base), ("patched", profile)):
        print(f"\n== {name}: total {sum(own.values()):.1f} us per step under cProfile; largest own times")
        for func in sorted(own, key=lambda f: -own[f])[: args.top]:
            print(f"{own[func]:9.2f}  {_name(func)}")


if __name__ == "__main__":
    main()
