"""vLLM's own sampler code per decode step, with and without the rl-logp patch, on one GPU.

Whatever `import vllm` finds is measured (the device bundle carries vLLM's Python sources only, no
compiled `vllm._C`: `PYTHONPATH=/tmp/vllm-<version>`, see benchmarks/device_run.sh), so the script runs
once per vLLM version:
- `v1_sampler` (vLLM 0.2x): `vllm.v1.sample.sampler.Sampler.forward` with logprobs requested
  (`max_num_logprobs` 0 and 20) in `raw_logprobs` and `processed_logprobs` modes; one extra setting
  samples with top-k 50 / top-p 0.9 (processed mode, the contract's kept set against vLLM's kernel).
- `v2_topk` (the V2 GPU worker, 0.24 and 0.3x): `compute_topk_logprobs` / `compute_topk_scores` on the
  raw logits, or (processed) on the fp32 copy the worker makes, divided by its `apply_temperature`.
For batch 1, 8, 64, 256, 1024 x 151936, bf16 and fp32 logits, T 1.0 and 0.7, each step is timed patched
and unpatched: CUDA time (events) and wall time (synchronised before and after, launches included),
median of --reps. At batch 64 each step is also run under `torch.cuda.set_sync_debug_mode` ("warn":
synchronisations counted; "error": whether it raised) and captured in a CUDA graph and replayed (the
replay's bits against the eager step's; the sampled token is random, so its logprob is checked against
`rl_logp.logprobs` of the token the replay drew). Prints a table of patched / unpatched CUDA time last;
writes JSON (--out).

    PYTHONPATH=/tmp/vllm-0.24.0 python benchmarks/bench_rollout.py --out /tmp/out/h200_rollout_0.24.0.json
    python benchmarks/bench_rollout.py --smoke --out /tmp/rollout_smoke.json      # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not carried to the device

import torch
import vllm

import rl_logp
from rl_logp.integrations import vllm as adapter
from rl_logp.sampling_mask import apply_top_k_top_p

Outputs = tuple[torch.Tensor, torch.Tensor]  # (token ids [B, 1 + n], logprobs [B, 1 + n])


@dataclasses.dataclass(frozen=True)
class Setting:
    path: str  # "v1_sampler" | "v2_topk"
    mode: str  # "raw_logprobs" | "processed_logprobs"
    num_logprobs: int
    dtype: str
    temperature: float
    top_k: int | None = None
    top_p: float | None = None

    @property
    def name(self) -> str:
        mask = f" k{self.top_k}/p{self.top_p}" if self.top_k or self.top_p else ""
        mode = self.mode.split("_")[0]
        return f"{self.path} {mode} n={self.num_logprobs} {self.dtype} T={self.temperature}{mask}"


class Step:
    """One decode step of `setting` on a fixed batch; `reset()` restores the inputs vLLM's steps modify."""

    def __init__(self, setting: Setting, batch: int, vocab: int, device: torch.device, seed: int) -> None:
        self.setting = setting
        gen = torch.Generator(device=device).manual_seed(seed)
        dtype = getattr(torch, setting.dtype)
        self.pristine = (torch.randn(batch, vocab, device=device, generator=gen) * 2.5 - 3).to(dtype)
        self.logits = self.pristine.clone()
        self.sampled = torch.randint(0, vocab, (batch,), device=device, generator=gen)
        self.temperature = torch.full((batch,), setting.temperature, device=device)
        self.rows = torch.arange(batch, device=device, dtype=torch.int32)
        k, p = setting.top_k, setting.top_p
        self.top_k = None if k is None else torch.full((batch,), k, dtype=torch.int32, device=device)
        self.top_p = None if p is None else torch.full((batch,), p, device=device)
        self.run = self._v1() if setting.path == "v1_sampler" else self._v2()

    def reset(self) -> None:
        self.logits.copy_(self.pristine)

    def __call__(self) -> Outputs:
        return self.run()

    def _v1(self) -> Callable[[], Outputs]:
        """Built inside the patch scope when patched: `TopKTopPSampler` binds its forward when constructed."""
        from vllm.v1.sample.logits_processor import LogitsProcessors
        from vllm.v1.sample.metadata import SamplingMetadata
        from vllm.v1.sample.sampler import Sampler

        batch = self.logits.shape[0]
        sampler = Sampler(logprobs_mode=self.setting.mode)
        zeros, ones = torch.zeros_like(self.temperature), torch.ones_like(self.temperature)
        metadata = SamplingMetadata(
            temperature=self.temperature, all_greedy=False, all_random=True, top_p=self.top_p, top_k=self.top_k,
            generators={}, max_num_logprobs=self.setting.num_logprobs, no_penalties=True, prompt_token_ids=None,
            frequency_penalties=zeros, presence_penalties=zeros, repetition_penalties=ones,
            output_token_ids=[[] for _ in range(batch)], allowed_token_ids_mask=None, bad_words_token_ids={},
            logitsprocs=LogitsProcessors(),
        )

        def run() -> Outputs:
            out = sampler.forward(self.logits, metadata).logprobs_tensors
            return out.logprob_token_ids, out.logprobs

        return run

    def _v2(self) -> Callable[[], Outputs]:
        """The worker's own calls; the functions are looked up when called, so a patch applies to them."""
        logprob = importlib.import_module(adapter.V2_GPU_LOGPROB)
        gumbel = importlib.import_module(adapter.V2_GPU_TEMPERATURE)
        topk = next(name for name in adapter.V2_TOPK_NAMES if hasattr(logprob, name))
        processed = self.setting.mode == "processed_logprobs"
        divide = self.setting.temperature != 1.0  # the worker skips the kernel when every T is 0 or 1

        def run() -> Outputs:
            x = self.logits
            if processed:
                x = torch.empty_like(x, dtype=torch.float32).copy_(x)
                if divide:
                    gumbel.apply_temperature(x, self.rows, self.temperature)
            out = getattr(logprob, topk)(x, self.setting.num_logprobs, self.sampled)
            return out.logprob_token_ids, out.logprobs

        return run

    def expected_first_column(self, tokens: torch.Tensor) -> torch.Tensor:
        """What the patched step's sampled-token logprob must be: the trainer's call on the same logits."""
        s = self.setting
        if s.mode == "raw_logprobs":
            return rl_logp.logprobs(self.pristine, tokens)
        if s.top_k or s.top_p:
            masked = apply_top_k_top_p(self.pristine, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
            return rl_logp.logprobs(masked, tokens)
        return rl_logp.logprobs(self.pristine, tokens, temperature=s.temperature)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_times(step: Step, reps: int, device: torch.device) -> tuple[float | None, float]:
    """(median CUDA ms or None on the CPU, median wall ms); the inputs are restored outside the timings."""
    cuda_ms, wall_ms = [], []
    for i in range(reps + 3):
        step.reset()
        sync(device)
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            stop.record()
            torch.cuda.synchronize()
            if i >= 3:
                cuda_ms.append(start.elapsed_time(stop))
        step.reset()
        sync(device)
        begin = time.perf_counter()
        step()
        sync(device)
        if i >= 3:
            wall_ms.append((time.perf_counter() - begin) * 1e3)
    return (statistics.median(cuda_ms) if cuda_ms else None), statistics.median(wall_ms)


def host_syncs(step: Step) -> dict:
    """Synchronisations the step makes ("warn" mode, counted) and whether "error" mode raised."""
    step.reset()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    count = sum("synchroniz" in str(w.message).lower() for w in caught)
    step.reset()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        raised = ""
    except RuntimeError as err:
        raised = str(err).splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return {"syncs": count, "error_mode_raised": raised}


def graph_replay(step: Step, patched: bool) -> dict:
    """Capture the step in a CUDA graph, replay it on restored inputs, compare with an eager step."""
    step.reset()
    eager_ids, eager_lp = (t.clone() for t in step())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step.reset()
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    step.reset()
    try:
        with torch.cuda.graph(graph):
            ids, lp = step()
    except Exception as err:  # capture is refused by whatever the step does (a sync, a CPU tensor...)
        torch.cuda.synchronize()
        return {"capturable": False, "capture_error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    step.reset()
    graph.replay()
    torch.cuda.synchronize()
    fixed = slice(1, None)  # the top-k columns; column 0 is the (random) sampled token in V1
    first = slice(0, None) if step.setting.path == "v2_topk" else fixed
    same = torch.equal(ids[:, first], eager_ids[:, first]) and _same_bits(lp[:, first], eager_lp[:, first])
    result = {"capturable": True, "replay_same_bits_as_eager": same}
    if patched:
        result["replay_first_column_equals_rl_logp"] = _same_bits(lp[:, 0], step.expected_first_column(ids[:, 0].long()))
    return result


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def settings(paths: list[str]) -> list[Setting]:
    found = [
        Setting(path, mode, n, dtype, t)
        for path in paths
        for mode in ("raw_logprobs", "processed_logprobs")
        for n in (0, 20)
        for dtype in ("bfloat16", "float32")
        for t in (1.0, 0.7)
    ]
    if "v1_sampler" in paths:
        found.append(Setting("v1_sampler", "processed_logprobs", 0, "bfloat16", 0.7, top_k=50, top_p=0.9))
    return found


def available_paths(device: torch.device) -> tuple[list[str], dict[str, str]]:
    paths, missing = [], {}
    if adapter.try_import(adapter.V1_SAMPLER) is not None:
        paths.append("v1_sampler")
    else:
        missing["v1_sampler"] = f"vllm {vllm.__version__} has no V1 sampler"
    if device.type != "cuda":
        missing["v2_topk"] = "the V2 GPU worker's logprob functions are Triton kernels: CUDA only"
    elif adapter.try_import(adapter.V2_GPU_LOGPROB) is None:
        missing["v2_topk"] = f"vllm {vllm.__version__} has no V2 GPU worker"
    else:
        paths.append("v2_topk")
    return paths, missing


def measure(setting: Setting, batch: int, args, device: torch.device, patched: bool, checks: bool) -> dict:
    step = Step(setting, batch, args.vocab, device, seed=batch)
    cuda_ms, wall_ms = median_times(step, args.reps, device)
    row = {"setting": setting.name, **dataclasses.asdict(setting), "batch": batch, "vocab": args.vocab,
           "patched": patched, "cuda_ms": cuda_ms, "wall_ms": wall_ms}
    if checks:
        row["host_syncs"] = host_syncs(step)
        row["cuda_graph"] = graph_replay(step, patched)
    return row


def run(args, device: torch.device, paths: list[str]) -> list[dict]:
    rows = []
    for setting in settings(paths):
        for batch in args.batches:
            checks = device.type == "cuda" and batch == args.check_batch
            rows.append(measure(setting, batch, args, device, False, checks))
            with adapter.patched(backend=args.backend):
                rows.append(measure(setting, batch, args, device, True, checks))
            print(f"{setting.name:52s} B={batch:5d} unpatched {_ms(rows[-2])}  patched {_ms(rows[-1])}", flush=True)
    return rows


def _ms(row: dict) -> str:
    cuda = "" if row["cuda_ms"] is None else f"cuda {row['cuda_ms']:8.3f} ms "
    return f"{cuda}wall {row['wall_ms']:8.3f} ms"


def print_table(rows: list[dict], batches: list[int]) -> None:
    """Patched / unpatched time per setting and batch (CUDA time on a GPU, wall time on the CPU)."""
    key = "cuda_ms" if rows and rows[0]["cuda_ms"] is not None else "wall_ms"
    by = {(r["setting"], r["batch"], r["patched"]): r for r in rows}
    print(f"\npatched / unpatched {key} per decode step (vllm {vllm.__version__})")
    print(f"{'setting':56s} " + " ".join(f"{'B=' + str(b):>8s}" for b in batches))
    for name in dict.fromkeys(r["setting"] for r in rows):
        pairs = [(by.get((name, b, True)), by.get((name, b, False))) for b in batches]
        print(f"{name:56s} " + " ".join(f"{p[key] / u[key]:8.2f}" if p and u else f"{'-':>8s}" for p, u in pairs))
    checked = [(r, by[(r["setting"], r["batch"], False)]) for r in rows if "host_syncs" in r and r["patched"]]
    for path in dict.fromkeys(r["path"] for r, _ in checked):
        pairs = [(p, u) for p, u in checked if p["path"] == path]
        added = max(p["host_syncs"]["syncs"] - u["host_syncs"]["syncs"] for p, u in pairs)
        raised = sum(bool(p["host_syncs"]["error_mode_raised"]) for p, _ in pairs)
        replayed = sum(all(v for k, v in p["cuda_graph"].items() if k != "capture_error") for p, _ in pairs)
        stock = sum(bool(u["cuda_graph"].get("capturable")) for _, u in pairs)
        print(f"{path} patched, B={pairs[0][0]['batch']}: host syncs added (max) {added}; sync error mode raised in "
              f"{raised}/{len(pairs)}; CUDA graph captured, replayed, same bits in {replayed}/{len(pairs)} "
              f"(unpatched captured in {stock}/{len(pairs)})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--check-batch", type=int, default=64, help="batch size of the sync and CUDA-graph checks")
    parser.add_argument("--backend", default="auto", help="rl-logp backend of the patch (auto: fused on CUDA)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, eager (no torch.compile)")
    parser.add_argument("--out", default="benchmarks/results/rollout.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.batches, args.vocab, args.reps = [1, 8], 1031, 2
        torch.compiler.set_stance("force_eager")  # vLLM's compiled helpers take 10-20 s to compile on the CPU
    paths, missing = available_paths(device)
    for path, why in missing.items():
        print(f"{path}: not run ({why})", file=sys.stderr)
    rows = run(args, device, paths)
    report = {
        "vllm": vllm.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "not_run": missing,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_table(rows, args.batches)
    print(f"\nreport written to {args.out}")


if __name__ == "__main__":
    main()
