"""vLLM's own sampler code per decode step, with and without the rl-logp patch, and the top-k / top-p
kept set alone.

Whatever `import vllm` finds is measured (the device bundle carries vLLM's Python sources only, no
compiled `vllm._C`: `PYTHONPATH=/tmp/vllm-<version>`, see benchmarks/device_run.sh), so the script runs
once per vLLM version. Paths (`--paths`):
- `v1_sampler` (vLLM 0.2x): `vllm.v1.sample.sampler.Sampler.forward` with logprobs requested
  (`max_num_logprobs` 0 and 20) in `raw_logprobs` and `processed_logprobs` modes, and one
  `processed_logprobs` setting sampling with top-k 50 / top-p 0.9.
- `v2_worker` (the V2 GPU worker, 0.24 and 0.3x): `compute_topk_logprobs` / `compute_topk_scores` on the
  raw logits, or (processed) on the fp32 copy the worker makes, divided by its `apply_temperature` and,
  in the top-k 50 / top-p 0.9 setting, masked by `apply_top_k_top_p`.
- `kept_set`: `vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p` alone, as every sampler calls it,
  on fp32 logits divided by T = 0.7 (top-k 50 with top-p 0.9, top-k 50 alone, top-p 0.9 alone):
  unpatched vLLM's own rule (its Triton kernel from 8 rows on, a sort below) against the patched one
  (rl-logp's kept-set kernel on CUDA, `rl_logp.kernels.kept_set`).
- `draw`: a token drawn from top-k / top-p logits (divided by T = 0.7, the same three settings), what V1's
  `TopKTopPSampler` does when no processed logprobs are asked for: unpatched, vLLM's native rule
  (`apply_top_k_top_p`, softmax, `random_sample`: its path without FlashInfer, which is not carried to the
  device); patched, the adapter's `flashinfer_sample` (the kept-set kernel drawing in its last pass).
For batch 1, 8, 64, 256, 1024 x 151936, bf16 and fp32 logits, T 1.0 and 0.7, each step is timed
unpatched and patched: CUDA time (events), wall time (synchronised before and after) and host time
(until the step returns, not synchronised after), medians of --reps, taken in --rounds rounds that
alternate unpatched and patched (a noisy host's drift hits both sides alike); with --behind-forward-ms F
also the step's time behind a forward: issued right after a GPU kernel of F ms (`torch.cuda._sleep`,
standing in for the model's forward, which vLLM's engine queues before its sampler), from that kernel's
end to the step's end, where the host work the step's issue overlaps with the forward is not counted; with --driver a third side
in the same rounds, the patched step with the plans' launches through the CUDA driver (`LaunchConfig.driver`,
rows '<setting> [driver]'). Every row checks its outputs (the
same check patched and unpatched; unpatched rows are the control: vLLM's own bits differ):
`first_column_equals_rl_logp`, the sampled token's logprob (column 0) against `rl_logp.logprobs` of the
token ids the step returned, with the patch's backend; for `v1_sampler` rows also `ranks_equal_count`, the
sampled tokens' ranks against the count of the row's logprobs (`rl_logp.full_logprobs`, every column) >=
the reported column 0, vLLM's rule; for `kept_set` rows `kept_set_equals_contract`,
the masked logits against the pure-torch contract (`rl_logp.sampling_mask.reference_thresholds`), and,
patched, `kernel_equals_contract`, the kernel called directly; for `draw` rows `draw_in_kept_set`, every
drawn token inside the contract's kept set. At --check-batch on CUDA each step also
runs under `torch.cuda.set_sync_debug_mode` ("warn": synchronisations counted; "error": whether it
raised) and is captured in a CUDA graph and replayed (the replay against the eager step and the check
on the replay's outputs). The JSON (--out) is rewritten after every row, so a time limit loses nothing
that ran; the table of patched / unpatched times is printed last.

    PYTHONPATH=/tmp/vllm-0.24.0 python benchmarks/bench_rollout.py --out /tmp/out/h200_rollout_0.24.0.json
    python benchmarks/bench_rollout.py --smoke --out /tmp/rollout_smoke.json      # CPU, tiny shapes

--smoke runs on the CPU with tiny shapes, every path included: the V2 worker's and rl-logp's Triton
kernels under Triton's interpreter (TRITON_INTERPRET=1; CUDA_VISIBLE_DEVICES="" makes vLLM accept Triton
with no GPU driver), the patch with the `fused` backend so the check scores with the kernels it checks
on a GPU, batches below 8 (vLLM's own top-k / top-p takes its sort path there; its Triton kernel asks
for the GPU's SM count).
"""

from __future__ import annotations

import os
import re
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not carried to the device

import argparse
import contextlib
import dataclasses
import importlib
import json
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator

import torch
import vllm

import rl_logp
from rl_logp.config import LogpConfig
from rl_logp.integrations import vllm as adapter
from rl_logp.sampling_mask import NEG_INF, apply_top_k_top_p, reference_thresholds

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling modules, also under `python -P`
from bench_report import Report

PATHS = ("v1_sampler", "v2_worker", "kept_set", "draw")
CHECKS = ("first_column_equals_rl_logp", "ranks_equal_count", "kept_set_equals_contract", "kernel_equals_contract",
          "draw_in_kept_set")
LOGITS_PATHS = ("kept_set", "draw")  # paths given fp32 logits already divided by T
Outputs = tuple[torch.Tensor, ...]  # (token ids [B, 1 + n], logprobs [B, 1 + n][, V1: ranks [B]]) or (masked logits,)


@dataclasses.dataclass(frozen=True)
class Setting:
    path: str  # one of PATHS
    mode: str  # "raw_logprobs" | "processed_logprobs"
    num_logprobs: int
    dtype: str
    temperature: float
    top_k: int | None = None
    top_p: float | None = None

    @property
    def name(self) -> str:
        mask = f" k{self.top_k or '-'}/p{self.top_p or '-'}" if self.top_k or self.top_p else ""
        if self.path in LOGITS_PATHS:
            return f"{self.path} fp32 T={self.temperature}{mask}"
        mode = self.mode.split("_")[0]
        return f"{self.path} {mode} n={self.num_logprobs} {self.dtype} T={self.temperature}{mask}"


class Step:
    """One decode step of `setting` on a fixed batch; `reset()` restores the inputs vLLM's steps modify.
    Built inside the patch scope when patched (V1's `TopKTopPSampler` binds its forward when built)."""

    def __init__(self, setting: Setting, batch: int, vocab: int, device: torch.device, backend: str,
                 launch: dict | None = None) -> None:
        self.setting, self.backend, self.launch = setting, backend, launch
        gen = torch.Generator(device=device).manual_seed(batch)
        logits = torch.randn(batch, vocab, device=device, generator=gen) * 2.5 - 3
        if setting.path in LOGITS_PATHS:
            logits = logits.to(torch.bfloat16).float() / torch.tensor(setting.temperature, device=device)
        self.pristine = logits.to(getattr(torch, setting.dtype))
        self.logits = self.pristine.clone()
        self.temperature = torch.full((batch,), setting.temperature, device=device)
        self.rows = torch.arange(batch, device=device, dtype=torch.int32)
        k, p = setting.top_k, setting.top_p
        self.top_k = None if k is None else torch.full((batch,), k, dtype=torch.int32, device=device)
        self.top_p = None if p is None else torch.full((batch,), p, device=device)
        self.sampled = torch.randint(0, vocab, (batch,), device=device, generator=gen)
        if setting.path not in LOGITS_PATHS and setting.mode == "processed_logprobs" and (k or p):  # drawable
            self.sampled = torch.multinomial(self.scored().softmax(dim=-1), 1, generator=gen).squeeze(1)
        self.run = {"v1_sampler": self._v1, "v2_worker": self._v2, "kept_set": self._kept_set,
                    "draw": self._draw}[setting.path]()

    def reset(self) -> None:
        self.logits.copy_(self.pristine)

    def __call__(self) -> Outputs:
        return self.run()

    def _v1(self) -> Callable[[], Outputs]:
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
            return out.logprob_token_ids, out.logprobs, out.selected_token_ranks

        return run

    def _v2(self) -> Callable[[], Outputs]:
        """The worker's own calls; the functions are looked up when called, so a patch applies to them."""
        logprob = importlib.import_module(adapter.V2_GPU_LOGPROB)
        gumbel = importlib.import_module(adapter.V2_GPU_TEMPERATURE)
        topk_topp = importlib.import_module(adapter.V1_TOPK_TOPP)
        topk = next(name for name in adapter.V2_TOPK_NAMES if hasattr(logprob, name))
        processed = self.setting.mode == "processed_logprobs"
        divide = self.setting.temperature != 1.0  # the worker skips the kernel when every T is 0 or 1
        masks = self.top_k is not None or self.top_p is not None

        def run() -> Outputs:
            x = self.logits
            if processed:
                x = torch.empty_like(x, dtype=torch.float32).copy_(x)
                if divide:
                    gumbel.apply_temperature(x, self.rows, self.temperature)
                if masks:
                    x = topk_topp.apply_top_k_top_p(x, self.top_k, self.top_p)
            out = getattr(logprob, topk)(x, self.setting.num_logprobs, self.sampled)
            return out.logprob_token_ids, out.logprobs

        return run

    def _kept_set(self) -> Callable[[], Outputs]:
        """vLLM's function, or with `launch` the kept-set kernel called directly with those parameters."""
        topk_topp = importlib.import_module(adapter.V1_TOPK_TOPP)
        if self.launch is None:
            return lambda: (topk_topp.apply_top_k_top_p(self.logits, self.top_k, self.top_p),)
        from rl_logp.kernels.kept_set import KeptSetLaunch, kept_set

        threshold = torch.empty(self.logits.shape[0], device=self.logits.device)
        bits, launch = LogpConfig().fixed_point_bits, KeptSetLaunch(**self.launch)

        def run() -> Outputs:
            kept_set(self.logits, self.top_k, self.top_p, bits, threshold, write=True, launch=launch)
            return (self.logits,)

        return run

    def _draw(self) -> Callable[[], Outputs]:
        """Built under the patch: the adapter's `flashinfer_sample`; else vLLM's draw without FlashInfer."""
        topk_topp = importlib.import_module(adapter.V1_TOPK_TOPP)
        if adapter.active_config() is not None:
            return lambda: (topk_topp.flashinfer_sample(self.logits, self.top_k, self.top_p, {}),)

        def native() -> Outputs:
            probs = topk_topp.apply_top_k_top_p(self.logits, self.top_k, self.top_p).softmax(dim=-1, dtype=torch.float32)
            return (topk_topp.random_sample(probs, {}),)

        return native

    def scored(self) -> torch.Tensor:
        """The logits the trainer scores for this setting (the contract's kept set, with top-k / top-p)."""
        s = self.setting
        if s.top_k or s.top_p:
            t = None if s.path in LOGITS_PATHS else s.temperature
            return apply_top_k_top_p(self.pristine, temperature=t, top_k=self.top_k, top_p=self.top_p)
        return self.pristine

    def check(self, outputs: Outputs) -> dict:
        """The step's outputs against rl-logp's (see the module docstring)."""
        if self.setting.path == "kept_set":
            return {"kept_set_equals_contract": same_bits(outputs[0], self.contract_mask())}
        if self.setting.path == "draw":
            drawn = self.contract_mask().gather(1, outputs[0].reshape(-1, 1).to(torch.int64))
            return {"draw_in_kept_set": bool((drawn != NEG_INF).all())}
        ids, logprobs, *ranks = outputs
        checks = {"first_column_equals_rl_logp": first_column_matches(self, ids, logprobs)}
        if ranks:  # V1: vLLM's rule, the count of the row's logprobs >= the sampled token's
            checks["ranks_equal_count"] = same_bits(ranks[0], self.expected_ranks(logprobs[:, 0]))
        return checks

    def contract_mask(self) -> torch.Tensor:
        z = self.pristine
        threshold = reference_thresholds(z, self.top_k, self.top_p, LogpConfig().fixed_point_bits, 2**28)
        return z.masked_fill(z < threshold.unsqueeze(1), NEG_INF)

    def trainer_scores(self) -> tuple[torch.Tensor, float | None]:
        """The logits the trainer scores for this step's logprobs and the temperature it scores them at."""
        s = self.setting
        if s.mode == "raw_logprobs":
            return self.pristine, None
        if s.top_k or s.top_p:
            return self.scored(), None
        return self.pristine, s.temperature

    def expected_first_column(self, tokens: torch.Tensor) -> torch.Tensor:
        """What the patched step's sampled-token logprob must be: the trainer's call on the same logits."""
        logits, temperature = self.trainer_scores()
        return rl_logp.logprobs(logits, tokens, temperature=temperature, backend=self.backend)

    def expected_ranks(self, token_logprobs: torch.Tensor) -> torch.Tensor:
        """What the patched V1 step's ranks must be for the sampled tokens' reported logprobs: how many of the
        row's logprobs (the trainer's, every column: `rl_logp.full_logprobs`) are >= them, int64."""
        logits, temperature = self.trainer_scores()
        full = rl_logp.full_logprobs(logits, temperature=temperature, backend=self.backend)
        return (full >= token_logprobs.unsqueeze(1)).sum(-1)


def first_column_matches(step: Step, ids: torch.Tensor, logprobs: torch.Tensor) -> bool:
    """Whether column 0 of the step's logprobs has the bits `rl_logp.logprobs` gives for column 0 of its
    token ids. The ids are copied to a contiguous int64 tensor first: with top-n logprobs (n > 0) column 0
    is a strided view of vLLM's [B, 1 + n] matrix (int64 in the V2 worker), which rl-logp's kernels read
    as if it were contiguous (the earlier check passed the view and reported V2 n > 0 wrong)."""
    tokens = ids[:, 0].to(torch.int64, copy=True)
    return same_bits(logprobs[:, 0], step.expected_first_column(tokens))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values and dtypes; fp32 compared by bit pattern (NaN == NaN, -0.0 != +0.0)."""
    def exact(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(exact(a), exact(b))


def passed(row: dict) -> bool:
    """Whether every check the row holds passed."""
    return all(row[key] for key in CHECKS if key in row)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def forward_cycles(ms: float) -> int:
    """GPU clock cycles of `torch.cuda._sleep` that take about `ms` milliseconds on this GPU."""
    probe = 10**6
    torch.cuda._sleep(probe)  # a first call, untimed
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    stop.record()
    torch.cuda.synchronize()
    return max(1, round(probe * ms / start.elapsed_time(stop)))


def cuda_ms(step: Step, forward: int = 0) -> float:
    """CUDA ms of one step on restored inputs; with `forward` (GPU cycles) the step is issued right behind a
    kernel that keeps the GPU busy that long and timed from that kernel's end."""
    step.reset()
    torch.cuda.synchronize()
    if forward:
        torch.cuda._sleep(forward)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop)


def time_samples(step: Step, reps: int, warmup: int, device: torch.device, forward: int = 0) -> dict[str, list[float]]:
    """CUDA ms (none on the CPU), wall ms and host ms of `reps` steps after `warmup` untimed ones; with
    `forward` (GPU cycles, CUDA only) also `behind_forward_ms`: the step issued right after a kernel that
    keeps the GPU busy that long (`torch.cuda._sleep`, standing in for the model's forward, which vLLM's
    engine queues before its sampler), from the end of that kernel to the end of the step's last op, so
    the host time the step's issue overlaps with the forward is not counted. The inputs are restored
    outside the timings."""
    samples: dict[str, list[float]] = {"cuda_ms": [], "wall_ms": [], "host_ms": [], "behind_forward_ms": []}
    for i in range(reps + warmup):
        if device.type == "cuda":
            timed = cuda_ms(step)
            behind = cuda_ms(step, forward) if forward else None
            if i >= warmup:
                samples["cuda_ms"].append(timed)
                if forward:
                    samples["behind_forward_ms"].append(behind)
        step.reset()
        sync(device)
        begin = time.perf_counter()
        step()
        returned = time.perf_counter()
        sync(device)
        if i >= warmup:
            samples["wall_ms"].append((time.perf_counter() - begin) * 1e3)
            samples["host_ms"].append((returned - begin) * 1e3)
    return samples


Side = bool | str  # False: unpatched; True: patched; "driver": patched, the plans launched through the driver


@contextlib.contextmanager
def side_scope(side: Side, args) -> Iterator[None]:
    """What a side runs under: nothing (False), the patch (True), or the patch with the fused kernels'
    plans launched through the CUDA driver ("driver": `LaunchConfig.driver` in the engine and in
    RL_LOGP_FUSED_CONFIG, which the kept set's plans read). With --driver every patched scope starts and
    ends with no plan, so that each side binds its own plans (in its round's warm-up steps)."""
    if not side:
        yield
        return
    from rl_logp import rollout_calls
    from rl_logp.engines import make_engine
    from rl_logp.engines.fused import TUNING_VARIABLE

    engine = make_engine("fused", rl_logp.resolve_config(None).chunk_bytes) if side == "driver" else None
    saved_env, saved_config = os.environ.get(TUNING_VARIABLE), engine and engine.config
    if engine is not None:
        os.environ[TUNING_VARIABLE] = json.dumps({**json.loads(saved_env or "{}"), "driver": True})
        engine.config = dataclasses.replace(saved_config, driver=True)
    if args.driver:
        rollout_calls.clear()
    try:
        with adapter.patched(backend=args.backend):
            yield
    finally:
        if engine is not None:
            engine.config = saved_config
            if saved_env is None:
                os.environ.pop(TUNING_VARIABLE, None)
            else:
                os.environ[TUNING_VARIABLE] = saved_env
        if args.driver:
            rollout_calls.clear()


def interleaved_times(steps: dict[Side, Step], args, device: torch.device) -> dict[Side, dict]:
    """Medians of --reps timings of the unpatched (False), patched (True) and with --driver the patched
    step through the driver ("driver"), taken in --rounds alternating rounds (each side's scope,
    `side_scope`, around its rounds): drift of a noisy host hits every side alike. Each round starts with
    --warmup untimed steps."""
    samples = {side: {"cuda_ms": [], "wall_ms": [], "host_ms": [], "behind_forward_ms": []} for side in steps}
    per_round = max(1, -(-args.reps // args.rounds))
    for _ in range(args.rounds):
        for side, step in steps.items():
            with side_scope(side, args):
                for key, values in time_samples(step, per_round, args.warmup, device, args.forward_cycles).items():
                    samples[side][key] += values
    median = statistics.median
    return {side: {key: median(v) if v else None for key, v in found.items()} | {"timed_steps": len(found["wall_ms"])}
            for side, found in samples.items()}


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


def graph_replay(step: Step) -> dict:
    """Capture the step in a CUDA graph, replay it on restored inputs, compare with an eager step, and
    run the row's check on the replay's outputs."""
    step.reset()
    eager = [t.clone() for t in step()]
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
            captured = step()
    except Exception as err:  # capture is refused by whatever the step does (a sync, a CPU tensor...)
        torch.cuda.synchronize()
        return {"capturable": False, "capture_error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    step.reset()
    graph.replay()
    torch.cuda.synchronize()
    checks = {f"replay_{k}": v for k, v in step.check(captured).items()}
    if step.setting.path == "draw":  # a replay draws new noise: only its check applies
        return {"capturable": True, **checks}
    return {"capturable": True, "replay_same_bits_as_eager": replay_same_as_eager(step.setting.path, captured, eager),
            **checks}


def replay_same_as_eager(path: str, replayed: Outputs, eager: Outputs) -> bool:
    """Whether a replay's outputs are an eager step's bits, but for what V1 draws at random: the sampled
    token (column 0 of ids and logprobs) and its rank (V1's third output, one per row)."""
    if path != "v1_sampler":
        return all(same_bits(a, b) for a, b in zip(replayed, eager, strict=True))
    return all(same_bits(a[:, 1:], b[:, 1:]) for a, b in zip(replayed[:2], eager[:2], strict=True))


def kernel_matches_contract(step: Step) -> bool:
    """The kept-set kernel called directly (on the CPU: under Triton's interpreter) against the contract."""
    from rl_logp.kernels.kept_set import kept_set

    z = step.pristine.clone()
    kept_set(z, step.top_k, step.top_p, LogpConfig().fixed_point_bits,
             torch.empty(z.shape[0], device=z.device), write=True)
    return same_bits(z, step.contract_mask())


def settings(paths: list[str], dtypes: list[str]) -> list[Setting]:
    found = [
        Setting(path, mode, n, dtype, t)
        for path in paths if path not in LOGITS_PATHS
        for mode in ("raw_logprobs", "processed_logprobs")
        for n in (0, 20)
        for dtype in dtypes
        for t in (1.0, 0.7)
    ]
    found += [Setting(path, "processed_logprobs", 0, "bfloat16", 0.7, top_k=50, top_p=0.9)
              for path in paths if path not in LOGITS_PATHS]
    found += [Setting(path, "processed_logprobs", 0, "float32", 0.7, top_k=k, top_p=p)
              for path in paths if path in LOGITS_PATHS for k, p in ((50, 0.9), (50, None), (None, 0.9))]
    return found


# Per path: the vLLM module its steps call and, where a vLLM may have the module without it, the function
# its unpatched side needs with what that function is.
PATH_NEEDS = {"v1_sampler": (adapter.V1_SAMPLER, None), "v2_worker": (adapter.V2_GPU_LOGPROB, None),
              "kept_set": (adapter.V1_TOPK_TOPP, None),
              "draw": (adapter.V1_TOPK_TOPP, ("random_sample", "V1's draw without FlashInfer"))}


def available_paths(requested: list[str]) -> tuple[list[str], dict[str, str]]:
    """The requested paths the installed vLLM can run both sides of, and why each other one cannot."""
    paths, missing = [], {}
    for path in requested:
        module, function = PATH_NEEDS[path]
        found = adapter.try_import(module)
        if found is None:
            missing[path] = f"vllm {vllm.__version__} has no {module}"
        elif function is not None and not hasattr(found, function[0]):
            missing[path] = f"vllm {vllm.__version__}'s {module} has no {function[0]} ({function[1]})"
        else:
            paths.append(path)
    return paths, missing


def checked_row(step: Step, setting: Setting, batch: int, args, device: torch.device, side: Side, times: dict,
                launch: dict | None = None) -> dict:
    """A report row: the step's times, then its checks (run in the side's scope, `side_scope`)."""
    patched = bool(side)
    name = setting.name if launch is None else f"{setting.name} kernel {json.dumps(launch, sort_keys=True)}"
    name += " [driver]" if side == "driver" else ""
    row = {"setting": name, **dataclasses.asdict(setting), "batch": batch, "vocab": args.vocab, "patched": patched,
           **({} if launch is None else {"launch": launch}), **({"driver": True} if side == "driver" else {}),
           **({} if name == setting.name else {"compared_to": setting.name}), **times}
    with side_scope(side, args):
        step.reset()
        row.update(step.check(step()))
        if patched and setting.path == "kept_set" and launch is None and rl_logp.fused_runs_on(device):
            row["kernel_equals_contract"] = kernel_matches_contract(step)
        if device.type == "cuda" and batch == args.check_batch:
            row["host_syncs"] = host_syncs(step)
            row["cuda_graph"] = graph_replay(step)
    return row


def run(args, device: torch.device, paths: list[str], report: Report) -> None:
    for setting in [s for s in settings(paths, args.dtypes) if re.search(args.match, s.name)]:
        for batch in args.batches:
            steps = {}
            for side in (False, True, *(("driver",) if args.driver else ())):
                with side_scope(side, args):  # V1's sampler binds the patched forward when built
                    steps[side] = Step(setting, batch, args.vocab, device, args.backend)
            times = interleaved_times(steps, args, device)
            rows = [checked_row(steps[side], setting, batch, args, device, side, times[side]) for side in steps]
            for row in rows:
                report.add(row)
            print(f"{setting.name:52s} B={batch:5d} unpatched {_ms(rows[0])}  patched {_ms(rows[1])}"
                  + (f"  driver {_ms(rows[2])}" if args.driver else ""), flush=True)
            for launch in args.kept_set_variants if setting.path == "kept_set" else []:
                step = Step(setting, batch, args.vocab, device, args.backend, launch)
                times = interleaved_times({True: step}, args, device)[True]
                variant = checked_row(step, setting, batch, args, device, True, times, launch)
                report.add(variant)
                print(f"  kernel {json.dumps(launch):50s} B={batch:5d} {_ms(variant)}", flush=True)


def _ms(row: dict) -> str:
    cuda = "" if row["cuda_ms"] is None else f"cuda {row['cuda_ms']:8.3f} ms "
    if row.get("behind_forward_ms") is not None:
        cuda += f"behind a forward {row['behind_forward_ms']:8.3f} ms "
    return f"{cuda}wall {row['wall_ms']:8.3f} ms host {row['host_ms']:7.3f} ms {'same' if passed(row) else 'DIFFERS'}"


def print_table(rows: list[dict], batches: list[int], behind_forward: bool = False) -> None:
    """Patched / unpatched time per setting and batch (CUDA time on a GPU, wall time on the CPU; with
    `behind_forward` also the time behind a forward), then the checks of the patched rows."""
    keys = ["cuda_ms" if rows and rows[0]["cuda_ms"] is not None else "wall_ms"]
    if behind_forward:
        keys.append("behind_forward_ms")
    by = {(r["setting"], r["batch"], r["patched"]): r for r in rows}
    for key in keys:
        print(f"\npatched / unpatched {key} per decode step (vllm {vllm.__version__})")
        print(f"{'setting':56s} " + " ".join(f"{'B=' + str(b):>8s}" for b in batches))
        for name, base in dict.fromkeys((r["setting"], r.get("compared_to", r["setting"])) for r in rows):
            pairs = [(by.get((name, b, True)), by.get((base, b, False))) for b in batches]
            print(f"{name:56s} " + " ".join(f"{p[key] / u[key]:8.2f}" if p and u else f"{'-':>8s}" for p, u in pairs))
    patched = [r for r in rows if r["patched"]]
    failed = [f"{r['setting']} B={r['batch']}" for r in patched if not passed(r)]
    print(f"\npatched rows whose outputs are rl-logp's: {len(patched) - len(failed)}/{len(patched)}"
          + (f"; differing: {', '.join(failed)}" if failed else ""))
    controls = [r for r in rows if not r["patched"]]
    print(f"unpatched rows (the control) whose outputs differ from rl-logp's: "
          f"{sum(not passed(r) for r in controls)}/{len(controls)}")
    checked = [(r, by[(r.get("compared_to", r["setting"]), r["batch"], False)]) for r in patched if "host_syncs" in r]
    for path in dict.fromkeys(r["path"] for r, _ in checked):
        pairs = [(p, u) for p, u in checked if p["path"] == path]
        added = max(p["host_syncs"]["syncs"] - u["host_syncs"]["syncs"] for p, u in pairs)
        raised = sum(bool(p["host_syncs"]["error_mode_raised"]) for p, _ in pairs)
        replayed = sum(all(v for k, v in p["cuda_graph"].items() if k != "capture_error") for p, _ in pairs)
        stock = sum(bool(u["cuda_graph"].get("capturable")) for _, u in pairs)
        print(f"{path} patched, B={pairs[0][0]['batch']}: host syncs added (max) {added}; sync error mode raised in "
              f"{raised}/{len(pairs)}; CUDA graph captured, replayed, same bits and checks passed in "
              f"{replayed}/{len(pairs)} (unpatched captured in {stock}/{len(pairs)})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    parser.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float32"], default=["bfloat16", "float32"])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=40, help="timed steps per side (patched, unpatched)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="alternating unpatched / patched rounds the --reps are spread over")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each round")
    parser.add_argument("--match", default="", help="only the settings whose name this regular expression finds "
                        "(e.g. 'k50' for the top-k / top-p ones)")
    parser.add_argument("--check-batch", type=int, default=64, help="batch size of the sync and CUDA-graph checks")
    parser.add_argument("--backend", default="auto", help="rl-logp backend of the patch and of the checks")
    parser.add_argument("--kept-set-variants", type=json.loads, default=[],
                        help="JSON list of launch parameters of rl_logp.kernels.kept_set.kept_set, fields of its "
                             'KeptSetLaunch (e.g. \'[{"split_rows": 0}, {"split": 16, "buckets": 64}]\'): each is timed on the '
                             "kept_set settings beside vLLM's own rule")
    parser.add_argument("--driver", action="store_true",
                        help="also time each patched step with the plans launched through the CUDA driver "
                             "(LaunchConfig.driver), a third side in the same alternating rounds: rows named "
                             "'<setting> [driver]'")
    parser.add_argument("--behind-forward-ms", type=float, default=0.0,
                        help="also time each step issued right behind a GPU kernel of this many ms (a model's "
                             "forward, as vLLM's engine queues it before the sampler): behind_forward_ms, from the "
                             "end of that kernel to the end of the step (CUDA only; 0: off)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (see above)")
    parser.add_argument("--out", default="benchmarks/results/rollout.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.behind_forward_ms < 0 or (args.behind_forward_ms and device.type != "cuda"):
        parser.error(f"--behind-forward-ms {args.behind_forward_ms} needs CUDA and a value >= 0 (0 turns it off)")
    args.forward_cycles = forward_cycles(args.behind_forward_ms) if args.behind_forward_ms else 0
    torch.manual_seed(0)  # V1 draws its sampled tokens from the global generator
    if args.smoke:
        args.batches, args.vocab, args.reps, args.rounds, args.warmup, args.backend = [1, 4], 1031, 2, 2, 1, "fused"
        torch.compiler.set_stance("force_eager")  # vLLM's compiled helpers take 10-20 s to compile on the CPU
    paths, missing = available_paths(args.paths)
    for path, why in missing.items():
        print(f"{path}: not run ({why})", file=sys.stderr)
    report = Report(args.out, key="rows", header={
        "vllm": vllm.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "backend": args.backend,
        "fused_config": os.environ.get("RL_LOGP_FUSED_CONFIG", ""),
        "behind_forward_ms": args.behind_forward_ms,
        "not_run": missing,
    })
    run(args, device, paths, report)
    print_table(report.data["rows"], args.batches, bool(args.behind_forward_ms))
    print(f"\nreport written to {args.out}")


if __name__ == "__main__":
    main()
