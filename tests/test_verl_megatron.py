"""verl 0.9.1's Megatron path with real megatron-core 0.18.0 on gloo: spawned worlds of 2 and 3 ranks with
Megatron's `parallel_state` at TP = 2 and 3.

Patched by `rl_logp.integrations.verl.apply()`, verl's own `vocab_parallel_log_probs_from_logits`,
`vocab_parallel_entropy` and `vocab_parallel_entropy_with_chunking` (verl/utils/megatron/tensor_parallel.py,
called through verl's module) and the Megatron engine's step (`MegatronEngineWithLMHead.forward_step` on a
megatron-core `GPTModel`, benchmarks/bench_verl_step.py's `build_megatron_engine`, with its
`_lm_head_logits_processor` inside) give the TP=1 bits of `rl_logp.logprobs` / `entropy` (values and
gradients, T = 1 and 0.7), and the vLLM sampler's bits (`rl_logp.check.rollout.rollout_provider`: vLLM
0.24.0's V1 sampler under rl-logp's patch) on the gathered logits. Stock verl / Megatron give other bits
(the control).

Vocabulary splits: Megatron's vocab-parallel layers split the vocabulary evenly (their `divide()` asserts
it; Megatron pads the vocabulary to a multiple of TP), so the engine runs even splits; the patched
functions also run uneven ones (rl-logp's TP slices may have any widths). verl's `torch.compile`d entropy
helper runs eagerly here (`force_eager`: no CPU compile time); nothing rl-logp runs is compiled.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import types
from collections.abc import Callable
from pathlib import Path

import megatron.core  # noqa: F401  (plain imports: a broken install fails here instead of skipping)
import pytest
import torch
import verl  # noqa: F401
from helpers import mismatches

import rl_logp
from rl_logp.check.cases import Sampling
from rl_logp.check.rollout import rollout_provider

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 1002  # a multiple of 2 and 3
HIDDEN = 24
ROWS = 256  # rows of the function checks
UNEVEN = {2: [0, 437, VOCAB], 3: [0, 1, 998, VOCAB]}
LENGTHS = [7, 9, 5, 3]  # the packed sequences of the engine step
MEGATRON_SITES = (
    "verl.utils.megatron.tensor_parallel.vocab_parallel_log_probs_from_logits",
    "verl.utils.megatron.tensor_parallel.vocab_parallel_entropy",
    "verl.utils.megatron.tensor_parallel.vocab_parallel_entropy_with_chunking",
    "MegatronEngineWithLMHead._lm_head_logits_processor",
)


def load_bench() -> types.ModuleType:
    """benchmarks/bench_verl_step.py: the Megatron engine the benchmark times is the one checked here."""
    spec = importlib.util.spec_from_file_location("bench_verl_step", ROOT / "benchmarks" / "bench_verl_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spawn_tp_world(world: int, fn: Callable, *args) -> list:
    """`fn(rank, world, *args)` on `world` spawned ranks, each in a gloo process group with Megatron's
    parallel state initialised at TP = world; returns what each rank returned."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"rl_logp_megatron_{os.getpid()}_{port}")
    torch.multiprocessing.spawn(_tp_rank, args=(world, port, path, fn, args), nprocs=world, join=True)
    found = [torch.load(f"{path}.{rank}", weights_only=False) for rank in range(world)]
    for rank in range(world):
        os.remove(f"{path}.{rank}")
    return found


def _tp_rank(rank: int, world: int, port: int, path: str, fn: Callable, args: tuple) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mpu.initialize_model_parallel(tensor_model_parallel_size=world)
    assert mpu.get_tensor_model_parallel_world_size() == world
    with torch.compiler.set_stance("force_eager"):
        torch.save(fn(rank, world, *args), f"{path}.{rank}")
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


def _logits() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(1, ROWS, VOCAB, generator=gen) * 3).to(torch.bfloat16)
    return x, torch.randint(0, VOCAB, (1, ROWS), generator=gen)


def _functions(tp_module, x: torch.Tensor, y: torch.Tensor, start: int, stop: int, grads: bool = True) -> dict:
    """verl's three vocab-parallel functions on this rank's slice: values and, with `grads`, d(sum)/d slice."""
    out = {}
    calls = {"logp": lambda v: tp_module.vocab_parallel_log_probs_from_logits(v, y),
             "entropy": tp_module.vocab_parallel_entropy,
             "entropy_chunked": lambda v: tp_module.vocab_parallel_entropy_with_chunking(v, chunk_size=5)}
    for name, call in calls.items():
        leaf = x[..., start:stop].clone().requires_grad_(grads)
        value = call(leaf)
        if grads:
            value.sum().backward()
            out[f"{name}_grad"] = leaf.grad
        out[name] = value.detach()
    return out


def _engine_step(bench: types.ModuleType, engine, temperature: float, entropy: bool, grads: bool) -> dict:
    """One engine step (verl's `forward_step`, the loss, backward); records what the logits processor was
    given (this rank's logits, labels, temperatures), what it returned and, with `grads`, the gradient
    that reached its logits and the gradient its outputs received."""
    seen: dict = {}
    cls = type(engine)

    def processor(self, logits, label, temperature, **kwargs):
        seen.update(logits=logits.detach().clone(), label=label.clone(), temperature=temperature.clone())
        if grads:
            logits.register_hook(lambda g: seen.__setitem__("logits_grad", g.clone()))
        out = cls._lm_head_logits_processor(self, logits, label, temperature, **kwargs)  # the class's: patched or not
        for key, value in out.items():
            seen[key] = value.detach().clone()
            if grads:
                value.register_hook(lambda g, key=key: seen.__setitem__(f"{key}_upstream", g.clone()))
        return out

    engine._lm_head_logits_processor = types.MethodType(processor, engine)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=gen)
    input_ids = torch.nested.nested_tensor_from_jagged(ids, torch.tensor([0, *LENGTHS]).cumsum(0))
    bench.megatron_step(engine, bench.megatron_batch(input_ids, temperature, entropy, torch.device("cpu")))
    del engine._lm_head_logits_processor
    return seen


def _megatron_rank(rank: int, world: int, uneven: list[int]) -> dict:
    import verl.utils.megatron.tensor_parallel as tp_module

    from rl_logp.integrations import verl as adapter

    bench = load_bench()
    bench.use_cpu_platform()
    engine = bench.build_megatron_engine(VOCAB, HIDDEN, torch.device("cpu"))
    x, y = _logits()
    width = VOCAB // world
    even = (rank * width, (rank + 1) * width)
    out = {"stock": _functions(tp_module, x, y, *even, grads=False),
           "stock_step": _engine_step(bench, engine, 0.7, entropy=True, grads=False)}
    adapter.apply(backend="chunked")
    try:
        out["patched"] = list(adapter.report().patched)
        out["not_patched"] = dict(adapter.report().not_patched)
        out["even"] = _functions(tp_module, x, y, *even)
        out["uneven"] = _functions(tp_module, x, y, uneven[rank], uneven[rank + 1])
        out["steps"] = {(t, e): _engine_step(bench, engine, t, e, grads=True) for t in (1.0, 0.7) for e in (True, False)}
    finally:
        adapter.revert()
    return out


def _tp1(fn: Callable, x: torch.Tensor, upstream: tuple[torch.Tensor, ...] | None = None):
    """rl-logp's TP=1 values of `fn(leaf)` and the gradient at `x` (of the sum, or of `upstream`)."""
    leaf = x.clone().requires_grad_(True)
    value = fn(leaf)
    values = value if isinstance(value, tuple) else (value,)
    grads = upstream or tuple(torch.ones_like(v) for v in values)
    (grad,) = torch.autograd.grad(values, leaf, grads)
    return tuple(v.detach() for v in values), grad


def _check_step(steps: list[dict], temperature: float, entropy: bool, rollout) -> None:
    """One patched engine step seen on every rank (`_engine_step`) against rl-logp at TP=1 on the gathered
    logits (same labels, temperatures and upstream gradients) and against the vLLM sampler."""
    first = steps[0]
    keys = ("log_probs", "entropy") if entropy else ("log_probs",)
    for step in steps[1:]:
        for key in ("label", "temperature", *(f"{k}_upstream" for k in keys)):
            assert torch.equal(step[key], first[key]), key
    full = torch.cat([step["logits"] for step in steps], dim=-1)
    label, t = first["label"], first["temperature"]
    t_contract = torch.where(t <= 0, torch.full_like(t, 1e-8), t)  # verl's guard for padding rows
    assert full.shape == (1, label.shape[1], VOCAB) and bool((t == temperature).any())
    if entropy:
        values, grad = _tp1(lambda v: rl_logp.logprobs_and_entropy(v, label, temperature=t_contract), full,
                            (first["log_probs_upstream"], first["entropy_upstream"]))
    else:
        values, grad = _tp1(lambda v: rl_logp.logprobs(v, label, temperature=t_contract), full,
                            (first["log_probs_upstream"],))
    for step in steps:
        for key, value in zip(keys, values, strict=True):
            assert mismatches(step[key], value) == 0, (temperature, entropy, key)
    assert mismatches(torch.cat([step["logits_grad"] for step in steps], dim=-1), grad) == 0
    rows = (t == temperature)[0]
    vllm = rollout(full[0, rows], label[0, rows], Sampling(temperature=temperature))
    assert mismatches(first["log_probs"][0, rows], vllm) == 0, (temperature, entropy)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3], ids=["tp2", "tp3"])
def test_verl_megatron_path_at_tp_gives_the_tp1_and_vllm_bits(world):
    ranks = spawn_tp_world(world, _megatron_rank, UNEVEN[world])
    x, y = _logits()

    # verl's vocab-parallel functions, patched, even and uneven splits: TP=1 values and gradients
    (logp,), logp_grad = _tp1(lambda v: rl_logp.logprobs(v, y), x)
    (h,), h_grad = _tp1(rl_logp.entropy, x)
    for layout in ("even", "uneven"):
        for r in ranks:
            assert mismatches(r[layout]["logp"], logp) == 0, layout
            assert mismatches(r[layout]["entropy"], h) == 0, layout
            assert mismatches(r[layout]["entropy_chunked"], h) == 0, layout
        for name, grad in (("logp", logp_grad), ("entropy", h_grad), ("entropy_chunked", h_grad)):
            assert mismatches(torch.cat([r[layout][f"{name}_grad"] for r in ranks], dim=-1), grad) == 0, (layout, name)

    # the engine step, patched: the processor's outputs and gradient are rl-logp's TP=1 bits on the gathered
    # logits, and its logp the vLLM sampler's on the same logits
    rollout = rollout_provider(backend="chunked")
    assert rollout.description.startswith("vLLM"), rollout.description
    for temperature, entropy in ranks[0]["steps"]:
        _check_step([r["steps"][temperature, entropy] for r in ranks], temperature, entropy, rollout)

    # the control: stock verl / Megatron at the same TP differ from rl-logp's bits
    stock = ranks[0]["stock"]
    assert mismatches(stock["logp"], logp) > 0  # Megatron's fp32 cross entropy: a few rows off by an ulp
    assert mismatches(stock["entropy"].float(), h) > ROWS // 2  # verl's entropy, in the logits' dtype
    step = ranks[0]["stock_step"]
    full = torch.cat([r["stock_step"]["logits"] for r in ranks], dim=-1)
    t = torch.where(step["temperature"] <= 0, torch.full_like(step["temperature"], 1e-8), step["temperature"])
    assert mismatches(step["log_probs"], rl_logp.logprobs(full, step["label"], temperature=t)) > full.shape[1] // 2

    # every rank's report lists the Megatron sites as patched
    for r in ranks:
        for site in MEGATRON_SITES:
            assert any(site in p for p in r["patched"]), (site, r["patched"])
            assert not any(site in k for k in r["not_patched"]), r["not_patched"]


def test_report_lists_the_megatron_sites_as_patched_on_the_cpu():
    from rl_logp.integrations import verl as adapter

    adapter.apply(backend="chunked")
    try:
        report = adapter.report()
        for site in MEGATRON_SITES:
            assert any(site in p for p in report.patched), (site, report.patched)
            assert not any(site in k for k in report.not_patched), report.not_patched
    finally:
        adapter.revert()
