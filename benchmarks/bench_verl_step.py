"""verl 0.9.1's logits step, unpatched vs rl-logp's verl adapter, side by side in one run.

The step is verl's own `FSDPEngineWithLMHead.prepare_model_outputs` (remove-padding branch, as verl's
actor runs it): its temperature step `_scale_logits_by_temperature`, `compute_entropy_from_logits`
(`verl_F.entropy_from_logits` under `torch.compile(dynamic=True)`, bound on the engine as
`FSDPEngine.__init__` does) and `logprobs_from_logits` (flash-attn's Triton cross entropy when
`flash_attn.ops.triton.cross_entropy` imports, as on verl's GPUs; else verl's torch path), on a stand-in
engine object that holds the attributes the method reads. Patched = the same call after
`rl_logp.integrations.verl.apply()` (temperature handed to rl-logp, logp and entropy from one read,
in-place backward where safe). Logits come from a matmul like the lm_head (hidden 1024, non-leaf bf16).

For N in {8192, 32768} x V = 151936, T in {1.0, 0.7}, entropy off/on, it records forward+backward time
(logits -> logp [+ entropy] -> d loss / d logits; CUDA events, warm-up, median, two rotated input sets),
peak memory above the live inputs (`torch.cuda.max_memory_allocated`) and, for each patched row, how far
its logp, entropy and gradient are from the unpatched row's on the same logits (max |difference|, share
of values that differ). Then the first call
(compile included) of compiled entropy/logp at 512, 8192, 32768 rows and dynamo's graph count: verl's
compiled torch entropy beside `torch.compile(rl_logp.entropy)` and `torch.compile(rl_logp.logprobs)`,
with the compiled-vs-eager bit mismatches.

Then the same cells through verl 0.9.1's Megatron engine step at TP=1 (megatron-core 0.18.0): a
`MegatronEngineWithLMHead` holding what `MegatronEngine.__init__`/`initialize` leave for the step (verl's
`McoreEngineConfig`, Megatron's parallel state, a megatron-core `GPTModel`: vocab-parallel embedding and
output layer, no transformer layers), run as verl's actor runs it: `engine.forward_backward_batch(data,
loss, forward_only=False)` (Megatron's no-pipelining schedule -> verl's `forward_step` -> verl's thd
pre/post-processing -> `_lm_head_logits_processor` -> the loss -> backward), timed on the host
(synchronised: verl's step does host work of its own) from the batch to the weight gradients; the loss is
the FSDP table's (sum logp + 0.01 sum entropy). Peak memory is above the model and the batch; the patched
rows' distances are for logp, entropy and the output layer's gradient.
The engine cannot be built by `initialize()` here: it asserts `use_mbridge`, and megatron-bridge / mbridge
load a Hugging Face checkpoint; the layers are left out because thd attention without transformer-engine
does not exist in megatron-core (its local `DotProductAttention` asserts `packed_seq_params is None`).
On the CPU (`--smoke`) Megatron's schedule cannot run (megatron-core 0.18.0 allocates its token counter
with device="cuda", pipeline_parallel/schedules.py:669), so the step is verl's `forward_step` and the
loss/backward the schedule would run, on a gloo world of one.

Where the GPU image lacks a module verl imports but this step never calls (`ray`, `datasets`, `PIL`,
`pandas`), a stub module stands in; the JSON lists them (`stubbed_modules`). Prints a table last; writes
JSON (--out) after every row. `--smoke`: tiny shapes on the CPU (CI).

    python benchmarks/bench_verl_step.py --out benchmarks/results/h200_verl_step.json
    python benchmarks/bench_verl_step.py --suites megatron --out benchmarks/results/h200_megatron_step.json
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.machinery
import json
import os
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling modules, also under `python -P`
from bench_report import Report

STUBBABLE = ("ray", "datasets", "PIL", "pandas")


class _StubClass(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubClass(name, (), {})

    def __call__(cls, *args, **kwargs):
        return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubClass(name, (), {})


def stub_missing_modules() -> list[str]:
    """Stand-ins for modules verl imports at module level but this step never calls, where absent."""
    stubbed = []
    for name in STUBBABLE:
        try:
            importlib.import_module(name)
        except ImportError:
            module = _StubModule(name)
            module.__path__ = []
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            sys.modules[name] = module
            stubbed.append(name)
    return stubbed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class StepBench:
    """Fresh lm_head logits per call, timed from the logits to d loss / d logits."""

    def __init__(self, rows: int, vocab: int, hidden: int, device: torch.device, seq: int) -> None:
        gen = torch.Generator(device="cpu").manual_seed(rows)
        self.device = device
        self.weight = (torch.randn(hidden, vocab, generator=gen) / hidden**0.5).to(torch.bfloat16).to(device)
        self.hiddens = [(torch.randn(rows, hidden, generator=gen) * 2).to(torch.bfloat16).to(device) for _ in range(2)]
        lengths = [seq] * (rows // seq) + ([rows % seq] if rows % seq else [])
        ids = torch.randint(0, vocab, (rows,), generator=gen).to(device)
        self.input_ids = torch.nested.nested_tensor_from_jagged(
            ids, torch.tensor([0, *lengths], device=device).cumsum(0)
        )
        self.labels = torch.roll(ids, shifts=-1)
        self.rows = rows

    def fsdp_call(self, engine, temperature: float, entropy: bool) -> Callable[[torch.Tensor], dict]:
        """verl's FSDP `prepare_model_outputs` (remove-padding) on [1, N, V] logits."""
        from verl.utils import tensordict_utils as tu

        micro_batch = tu.get_tensordict(tensor_dict={"input_ids": self.input_ids},
                                        non_tensor_dict={"use_remove_padding": True, "calculate_entropy": entropy})
        output_args = {"input_ids_rmpad_rolled": self.labels, "pad_size": 0,
                       "temperature_rmpad": torch.full((self.rows,), temperature, device=self.device),
                       "temperature_is_one": temperature == 1.0}

        def call(logits: torch.Tensor) -> dict:
            out = engine.prepare_model_outputs(types.SimpleNamespace(logits=logits), output_args, micro_batch, None)
            return {k: v.values() for k, v in out.items()}

        return call

    def megatron_call(self, engine, temperature: float, entropy: bool) -> Callable[[torch.Tensor], dict]:
        """verl's Megatron `_lm_head_logits_processor` (TP=1) on [1, N, V] logits."""

        def call(logits: torch.Tensor) -> dict:
            return engine._lm_head_logits_processor(
                logits, self.labels.unsqueeze(0), torch.full((1, self.rows), temperature, device=self.device),
                calculate_sum_pi_squared=False, calculate_entropy=entropy, distillation_use_topk=False,
                distillation_only=False, logits_processor_func=None, batch=None, data_format="thd",
            )

        return call

    def measure(self, call: Callable[[torch.Tensor], dict], i: int) -> tuple[float, int]:
        """One call: (forward+backward ms, peak bytes above the inputs and the logits)."""
        logits = (self.hiddens[i % 2].requires_grad_(True) @ self.weight).unsqueeze(0)
        _sync(self.device)
        base = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = call(logits)
        loss = out["log_probs"].sum() + (0.01 * out["entropy"].sum() if "entropy" in out else 0.0)
        torch.autograd.grad(loss, logits)
        if self.device.type == "cuda":
            stop.record()
            torch.cuda.synchronize()
            return start.elapsed_time(stop), torch.cuda.max_memory_allocated() - base
        return (time.perf_counter() - t0) * 1e3, 0

    def run(self, call: Callable[[torch.Tensor], dict], warmup: int, reps: int) -> dict:
        times, peaks = [], []
        for i in range(warmup + reps):
            ms, peak = self.measure(call, i)
            if i >= warmup:
                times.append(ms)
                peaks.append(peak)
        return {"fwd_bwd_ms": statistics.median(times), "peak_extra_gib": max(peaks) / 2**30}

    def outputs(self, call: Callable[[torch.Tensor], dict]) -> dict[str, torch.Tensor]:
        """logp, entropy (when computed) and d loss / d logits of the first input set, detached, in their own
        dtypes."""
        logits = (self.hiddens[0].requires_grad_(True) @ self.weight).unsqueeze(0)
        out = call(logits)
        loss = out["log_probs"].sum() + (0.01 * out["entropy"].sum() if "entropy" in out else 0.0)
        (grad,) = torch.autograd.grad(loss, logits)
        found = {"logp": out["log_probs"], "grad": grad}
        if "entropy" in out:
            found["entropy"] = out["entropy"]
        return {k: v.detach() for k, v in found.items()}


DISTANCE_CHUNK = 1 << 26  # values compared at a time (256 MiB in fp32)


def distance(patched: dict[str, torch.Tensor], unpatched: dict[str, torch.Tensor]) -> dict:
    """How far the patched outputs are from verl's own (wherever those are kept): max |difference| and the
    share of values that differ, compared in fp32 on the patched outputs' device a chunk at a time."""
    found = {}
    for name, ref in unpatched.items():
        got, ref = patched[name].reshape(-1), ref.reshape(-1)
        largest, differing = 0.0, 0
        for start in range(0, ref.numel(), DISTANCE_CHUNK):
            a = got[start:start + DISTANCE_CHUNK].float()
            diff = (a - ref[start:start + DISTANCE_CHUNK].to(a.device).float()).abs()
            largest = max(largest, float(diff.max()))
            differing += int((diff > 0).sum())
        found[f"{name}_max_abs_diff"] = largest
        found[f"{name}_differing_fraction"] = differing / max(1, ref.numel())
    return found


def make_engine(fsdp_engine, verl_f):
    """What `FSDPEngine.__init__` leaves for prepare_model_outputs (transformer_impl.py:178-187)."""
    engine = object.__new__(fsdp_engine.FSDPEngineWithLMHead)
    engine.engine_config = types.SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False,
                                                 entropy_from_logits_chunk_size=2048)
    engine.compute_entropy_from_logits = torch.compile(verl_f.entropy_from_logits, dynamic=True)
    engine.model_config = types.SimpleNamespace(use_fused_kernels=False)
    engine.use_ulysses_sp = False
    return engine


def side_by_side(args, device, suite: str, make_bench: Callable, make_call: Callable, report: Report) -> None:
    """Every (N, T, entropy) cell, unpatched then patched (`apply()` for that row only); each patched row
    says how far its logp, entropy and gradient are from the unpatched ones on the same inputs."""
    from rl_logp.integrations import verl as adapter

    for rows in args.rows:
        bench = make_bench(rows)
        for temperature in (1.0, 0.7):
            for entropy in (False, True):
                reference = None
                for mode in ("unpatched", "patched"):
                    row = {"suite": suite, "mode": mode, "rows": rows, "vocab": args.vocab,
                           "temperature": temperature, "entropy": entropy}
                    try:
                        if mode == "patched":
                            adapter.apply(backend=args.backend)
                        call = make_call(bench, mode, temperature, entropy)
                        row.update(bench.run(call, args.warmup, args.reps))
                        if mode == "unpatched":  # kept on the CPU while the patched side runs: on the GPU its
                            # logits-sized gradient would take memory neither side's step needs
                            reference = {k: v.to("cpu") for k, v in bench.outputs(call).items()}
                        elif reference is not None:
                            row.update(distance(bench.outputs(call), reference))
                    except Exception as err:  # a cell that cannot run says why; the others still run
                        row["error"] = f"{type(err).__name__}: {err}"
                    finally:
                        adapter.revert()
                    report.add(row)
                reference = None
        del bench
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_fsdp(args, device, report: Report) -> None:
    import verl.utils.torch_functional as verl_f
    import verl.workers.engine.fsdp.transformer_impl as fsdp_engine

    engines = {mode: make_engine(fsdp_engine, verl_f) for mode in ("unpatched", "patched")}
    side_by_side(args, device, "fsdp step", lambda rows: StepBench(rows, args.vocab, args.hidden, device, args.seq),
                 lambda bench, mode, t, entropy: bench.fsdp_call(engines[mode], t, entropy), report)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_compile(args, device, report: Report) -> None:
    """First call (compile included) of each compiled function at growing row counts, and graph counts."""
    import verl.utils.torch_functional as verl_f

    import rl_logp

    def rl_entropy(x):
        return rl_logp.entropy(x, backend=args.backend)

    def rl_logprobs(x):
        return rl_logp.logprobs(x, torch.zeros(x.shape[0], dtype=torch.int64, device=x.device), backend=args.backend)

    functions: dict[str, Callable] = {
        "verl entropy_from_logits (torch)": verl_f.entropy_from_logits,
        "rl_logp.entropy": rl_entropy,
        "rl_logp.logprobs": rl_logprobs,
    }
    gen = torch.Generator(device="cpu").manual_seed(1)
    for name, fn in functions.items():
        torch._dynamo.reset()
        compiled = torch.compile(fn, dynamic=True)
        before = _graphs()
        for rows in args.compile_rows:
            x = (torch.randn(rows, args.vocab, generator=gen) * 3).to(torch.bfloat16).to(device)
            _sync(device)
            t0 = time.perf_counter()
            got = compiled(x)
            _sync(device)
            first = time.perf_counter() - t0
            eager = fn(x)
            row = {"suite": "compile", "provider": name, "rows": rows, "first_call_s": first,
                   "graphs_so_far": _graphs() - before,
                   "compiled_vs_eager_mismatches": int((got.float() != eager.float()).sum())}
            report.add(row)
            del x, got, eager


def use_cpu_platform() -> None:
    """verl 0.9.1 has CUDA and NPU platforms only; its Megatron step moves each micro-batch to the
    platform's `current_device()`. On the CPU: the CUDA platform with "cpu" as its device."""
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class PlatformCPU(PlatformCUDA):
        device_name = "cpu"

        def current_device(self) -> str:
            return "cpu"

    platform_manager.set_platform(PlatformCPU())


def build_megatron_engine(vocab: int, hidden: int, device: torch.device, seed: int = 0):
    """A `MegatronEngineWithLMHead` with what `MegatronEngine.__init__`/`initialize()` leave for the step,
    on Megatron's parallel state (initialised by the caller; TP = its tensor-parallel size): verl's
    `McoreEngineConfig` and a bf16 megatron-core `GPTModel` whose decoder has no layers (embedding ->
    vocab-parallel output layer, weights N(0, (2/sqrt(hidden))^2): logits of std ~2, as in the FSDP table).
    The same seed gives every TP layout the same full weights (built on the CPU, then split)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from verl.workers.config import McoreEngineConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    from verl.workers.engine.megatron.utils import set_random_seed

    tp = mpu.get_tensor_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=tp, tensor_model_parallel_size=tp,  # the spec: none
        params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=True, init_method_std=2 / hidden**0.5,
        hidden_dropout=0.0, attention_dropout=0.0,  # as Qwen's config: deterministic logits
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",  # as verl's provider sets them
    )
    set_random_seed(seed)  # as MegatronEngine.__init__ does (torch's and, on CUDA, Megatron's RNG tracker)
    model = GPTModel(config=config, transformer_layer_spec=TransformerBlockSubmodules(layer_specs=[]),
                     vocab_size=vocab, max_sequence_length=1 << 20, position_embedding_type="none",
                     parallel_output=True).to(device)
    engine = object.__new__(MegatronEngineWithLMHead)
    engine.engine_config = McoreEngineConfig(tensor_model_parallel_size=tp)
    engine.model_config = types.SimpleNamespace(
        mtp=types.SimpleNamespace(enable=False, enable_train=False),
        hf_config=types.SimpleNamespace(architectures=["Qwen2ForCausalLM"]),
        tokenizer=types.SimpleNamespace(pad_token_id=0),
    )
    engine.tf_config, engine.module, engine.enable_routing_replay = config, [model], False
    return engine


def megatron_batch(input_ids: torch.Tensor, temperature: float, entropy: bool, device: torch.device):
    """The actor's micro-batch as `TrainingWorker.train_batch` hands it to the engine: packed (nested)
    input ids, the loss mask, one temperature per sequence, and the engine keys it fills in."""
    from verl.utils import tensordict_utils as tu

    ones = torch.nested.nested_tensor_from_jagged(torch.ones_like(input_ids.values()), input_ids.offsets())
    sequences = input_ids.offsets().numel() - 1
    return tu.get_tensordict(
        tensor_dict={"input_ids": input_ids, "loss_mask": ones,
                     "temperature": torch.full((sequences,), temperature, device=device)},
        non_tensor_dict={"calculate_entropy": entropy, "use_remove_padding": True, "use_dynamic_bsz": False,
                         "micro_batch_size_per_gpu": sequences, "max_token_len_per_gpu": 1 << 30,
                         "use_fused_kernels": False},
    )


def step_loss(model_output: dict, data, dp_group=None) -> tuple[torch.Tensor, dict]:
    """verl's loss-function signature; the FSDP table's loss: sum logp + 0.01 sum entropy."""
    loss = model_output["log_probs"].values().sum()
    if "entropy" in model_output:
        loss = loss + 0.01 * model_output["entropy"].values().float().sum()
    return loss, {}


def megatron_step(engine, data, forward_only: bool = False) -> dict:
    """One engine step with `step_loss`: `forward_backward_batch` on CUDA; on the CPU verl's `forward_step`
    and the loss and backward Megatron's schedule runs around it (see the module docstring)."""
    from verl.utils import tensordict_utils as tu

    if torch.cuda.is_available():
        return engine.forward_backward_batch(data, step_loss, forward_only=forward_only)
    model = engine.module[0]
    tu.assign_non_tensor(data, batch_num_tokens=int(data["loss_mask"].values().sum()), dp_size=1, num_micro_batch=1)
    post = functools.partial(engine.postprocess_micro_batch_func, forward_only=forward_only, loss_function=step_loss)
    output, finish = engine.forward_step(iter([data]), model, step_loss, post)
    loss, result = finish(output)
    if not forward_only:
        loss.backward()
    return result


class MegatronStepBench:
    """The engine step on N packed tokens (sequences of `seq`), timed from the batch to the weight
    gradients; outputs: logp, entropy and the output layer's gradient."""

    def __init__(self, rows: int, engine, vocab: int, device: torch.device, seq: int) -> None:
        gen = torch.Generator(device="cpu").manual_seed(rows)
        lengths = [seq] * (rows // seq) + ([rows % seq] if rows % seq else [])
        ids = torch.randint(0, vocab, (rows,), generator=gen).to(device)
        self.input_ids = torch.nested.nested_tensor_from_jagged(ids, torch.tensor([0, *lengths], device=device).cumsum(0))
        self.engine, self.device = engine, device

    def megatron_call(self, temperature: float, entropy: bool) -> Callable[[], dict]:
        def call() -> dict:
            return megatron_step(self.engine, megatron_batch(self.input_ids, temperature, entropy, self.device))

        return call

    def measure(self, call: Callable[[], dict]) -> tuple[float, int]:
        """One step: (host ms from the batch to the gradients, synchronised; peak bytes above the model and
        the batch). Host time, since verl's step does host work of its own around the kernels."""
        self.engine.module[0].zero_grad(set_to_none=True)
        _sync(self.device)
        base = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        call()
        _sync(self.device)
        ms = (time.perf_counter() - t0) * 1e3
        return ms, (torch.cuda.max_memory_allocated() - base if self.device.type == "cuda" else 0)

    def run(self, call: Callable[[], dict], warmup: int, reps: int) -> dict:
        found = [self.measure(call) for _ in range(warmup + reps)][warmup:]
        return {"fwd_bwd_ms": statistics.median(ms for ms, _ in found),
                "peak_extra_gib": max(peak for _, peak in found) / 2**30}

    def outputs(self, call: Callable[[], dict]) -> dict[str, torch.Tensor]:
        self.engine.module[0].zero_grad(set_to_none=True)
        out = call()["model_output"]
        found = {name: out[key].values() for name, key in (("logp", "log_probs"), ("entropy", "entropy")) if key in out}
        found["grad"] = self.engine.module[0].output_layer.weight.grad
        return {k: v.detach().float() for k, v in found.items()}


def run_megatron(args, device, report: Report) -> None:
    """The Megatron engine step at TP=1 (a world of one: NCCL on CUDA, gloo on the CPU)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    if device.type == "cpu":
        use_cpu_platform()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="tcp://127.0.0.1:29561",
                                rank=0, world_size=1)
    mpu.initialize_model_parallel(tensor_model_parallel_size=1)
    engine = build_megatron_engine(args.vocab, args.hidden, device)
    side_by_side(args, device, "megatron step",
                 lambda rows: MegatronStepBench(rows, engine, args.vocab, device, args.seq),
                 lambda bench, mode, t, entropy: bench.megatron_call(t, entropy), report)
    mpu.destroy_model_parallel()


def print_table(results: list[dict]) -> None:
    print(f"\n{'suite':14s} {'N':>6s} {'T':>4s} {'entropy':>7s} {'mode':>9s} {'f+b ms':>9s} {'peak GiB':>9s}")
    for r in results:
        if "mode" not in r:
            continue
        head = f"{r['suite']:14s} {r['rows']:6d} {r['temperature']:4.1f} {r['entropy']!s:>7s} {r['mode']:>9s}"
        if "error" in r:
            print(f"{head} error: {r['error'][:70]}")
        else:
            far = "".join(f" {k.split('_')[0]} {r[k]:.2g}" for k in r if k.endswith("_max_abs_diff"))
            print(f"{head} {r['fwd_bwd_ms']:9.2f} {r['peak_extra_gib']:9.2f}{far}")
    print(f"\n{'compiled':34s} {'rows':>6s} {'first s':>8s} {'graphs':>6s} {'mism':>5s}")
    for r in results:
        if r["suite"] == "compile":
            print(f"{r['provider']:34s} {r['rows']:6d} {r['first_call_s']:8.2f} {r['graphs_so_far']:6d} "
                  f"{r['compiled_vs_eager_mismatches']:5d}")
    for r in results:
        if "note" in r:
            print(f"\n{r['suite']}: {r['note']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024, help="tokens per packed sequence")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile-rows", type=int, nargs="+", default=[512, 8192, 32768])
    parser.add_argument("--backend", default="auto", help="rl-logp backend of the patched rows")
    parser.add_argument("--suites", nargs="+", default=["fsdp", "compile", "megatron"],
                        choices=["fsdp", "compile", "megatron"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", default="benchmarks/results/verl_step.json")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.vocab, args.hidden, args.seq, args.reps, args.warmup = [48], 1031, 32, 20, 2, 1
        args.compile_rows = [8, 24, 48]
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    stubbed = stub_missing_modules()
    import verl
    import verl.utils.torch_functional as verl_f

    report = Report(args.out, echo=lambda row: print(json.dumps(row), flush=True), header={
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "verl": verl.__version__,
        "python": platform.python_version(),
        "unpatched_logprobs": "flash-attn triton cross_entropy" if verl_f.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE
        else "verl torch path (logprobs_from_logits_v2)",
        "stubbed_modules": stubbed,
        "command": " ".join(sys.argv),
    })
    suites = {"fsdp": run_fsdp, "compile": run_compile, "megatron": run_megatron}
    for name in args.suites:
        suites[name](args, device, report)
    print_table(report.rows)


if __name__ == "__main__":
    main()
