"""The vLLM adapter against the real vLLM package, on the CPU and (where CUDA is present) the GPU.

scripts/test.sh runs this file twice: against vLLM 0.24.0 (installed; the version verl 0.9.1 pins: V1
sampler and V2 GPU worker) and against the latest release's sources (scripts/vllm_latest.sh: no V1
sampler; V2 GPU and CPU workers). Each test needs one runner layout and skips, naming it, on the other.
"""

import importlib
import importlib.util

import numpy as np
import pytest
import torch
from helpers import bits, mismatches

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (see scripts/setup.sh)")

from rl_logp.integrations import vllm as adapter  # noqa: E402

import rl_logp  # noqa: E402


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


layout = f"vLLM {vllm.__version__} has no"
needs_v1 = pytest.mark.skipif(not _has(adapter.V1_SAMPLER), reason=f"{layout} V1 sampler (removed after 0.2x)")
needs_cpu_worker = pytest.mark.skipif(not _has(adapter.V2_CPU_LOGPROB), reason=f"{layout} V2 CPU worker (0.3x on)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")


@pytest.fixture(autouse=True)
def eager():
    # vLLM's logprob helpers are torch.compile'd; on the CPU the first compile takes 13-22 s.
    with torch.compiler.set_stance("force_eager"):
        yield


@pytest.fixture
def patched():
    adapter.apply(backend="chunked")
    yield
    adapter.revert()


def _v1_metadata(batch: int, temperature: float, logprobs: int, device: str = "cpu"):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    def full(value: float) -> torch.Tensor:
        return torch.full((batch,), value, device=device)

    return SamplingMetadata(
        temperature=full(temperature), all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators={}, max_num_logprobs=logprobs, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=full(0.0), presence_penalties=full(0.0), repetition_penalties=full(1.0),
        output_token_ids=[[] for _ in range(batch)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


@needs_v1
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_v1_real_sampler_forward_returns_rl_logp_bits(patched, mode, dtype, temperature):
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler(logprobs_mode=mode)
    vocab, differing, checked = 1031, 0, 0
    for batch in range(1, 65):
        gen = torch.Generator().manual_seed(batch)
        logits = (torch.randn(batch, vocab, generator=gen) * 3).to(dtype)
        out = sampler.forward(logits.clone(), _v1_metadata(batch, temperature, 3))
        tokens = out.sampled_token_ids[:, 0].long()
        got = out.logprobs_tensors.logprobs[:, 0]
        want = rl_logp.logprobs(logits, tokens, backend="chunked",
                                temperature=temperature if mode == "processed_logprobs" else None)
        differing += mismatches(got, want)
        checked += batch
        assert out.logprobs_tensors.logprobs.shape == (batch, 4)
        assert torch.equal(out.logprobs_tensors.logprob_token_ids[:, 0].long(), tokens)
    assert checked == 64 * 65 // 2 and differing == 0


def _cpu_worker_processed(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """What the V2 CPU worker's `apply_sampling_params` makes of the logits: an fp32 copy, divided by T
    by its own `CPUSamplingStates` fed with the requests' SamplingParams."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.cpu.sampler import CPUSamplingStates

    batch, vocab = logits.shape
    states = CPUSamplingStates(batch, vocab, logits.device)
    for row in range(batch):
        states.add_request(row, SamplingParams(temperature=temperature, logprobs=3))
    x = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
    states.apply_temperature(x, torch.arange(batch), np.arange(batch))
    return x


@needs_cpu_worker
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_v2_cpu_worker_topk_scores_return_rl_logp_bits(patched, mode, dtype, temperature):
    """The CPU worker's Sampler calls `compute_topk_scores` on the raw or processed logits; its own
    sampling kernel is compiled (vllm._C) and absent from the Python sources, so tokens are drawn here."""
    from vllm.v1.worker.cpu.logprob import compute_topk_scores

    vocab, differing, checked = 1031, 0, 0
    for batch in range(1, 65):
        gen = torch.Generator().manual_seed(batch)
        logits = (torch.randn(batch, vocab, generator=gen) * 3).to(dtype)
        sampled = torch.randint(0, vocab, (batch,), generator=gen)
        scored = _cpu_worker_processed(logits, temperature) if mode == "processed_logprobs" else logits
        out = compute_topk_scores(scored, 3, sampled)
        assert out.logprobs.shape == (batch, 4) and out.logprobs.dtype == torch.float32
        assert torch.equal(out.logprob_token_ids[:, 0], sampled)
        t = temperature if mode == "processed_logprobs" else None
        for k in range(4):
            want = rl_logp.logprobs(logits, out.logprob_token_ids[:, k], backend="chunked", temperature=t)
            differing += mismatches(out.logprobs[:, k], want)
        checked += batch
    assert checked == 64 * 65 // 2 and differing == 0


@needs_cpu_worker
def test_v2_cpu_worker_stock_logprobs_differ_from_rl_logp():
    """The control for the test above: the same sweep through vLLM's own torch.logsumexp, unpatched."""
    from vllm.v1.worker.cpu.logprob import compute_topk_scores

    differing = 0
    for batch in range(1, 65):
        gen = torch.Generator().manual_seed(batch)
        logits = (torch.randn(batch, 1031, generator=gen) * 3).to(torch.bfloat16)
        sampled = torch.randint(0, 1031, (batch,), generator=gen)
        out = compute_topk_scores(logits, 3, sampled)
        differing += mismatches(out.logprobs[:, 0], rl_logp.logprobs(logits, sampled, backend="chunked"))
    print(f"vllm {vllm.__version__} CPU worker, unpatched: {differing}/2080 sampled-token rows differ")
    assert differing > 0


@needs_cpu_worker
def test_v2_cpu_worker_custom_token_ids_keep_vllm_masking(patched):
    """Per-request `logprob_token_ids`: the patched lse fills the valid columns, vLLM's -inf the rest."""
    from vllm.v1.worker.cpu.logprob import compute_topk_scores

    batch, vocab = 6, 600
    logits = torch.randn(batch, vocab).to(torch.bfloat16)
    sampled = torch.randint(0, vocab, (batch,))
    per_req = torch.randint(0, vocab, (batch, 5), dtype=torch.int32)
    counts = torch.tensor([0, 1, 5, 2, 0, 3], dtype=torch.int32)
    out = compute_topk_scores(logits, 2, sampled, num_per_req_token_ids=counts, per_req_token_ids=per_req,
                              expanded_idx_mapping=torch.arange(batch), max_per_req_token_ids=5)
    for row in range(batch):
        n = int(counts[row]) or 2
        ids = out.logprob_token_ids[row, : 1 + n]
        want = rl_logp.logprobs(logits[row].expand(1 + n, vocab), ids, backend="chunked")
        assert torch.equal(bits(out.logprobs[row, : 1 + n]), bits(want))
        assert torch.isneginf(out.logprobs[row, 1 + n:]).all()


@needs_cpu_worker
def test_v2_cpu_worker_prompt_logprobs_are_chunk_invariant(patched):
    """Prompt logprobs run in 1024-row chunks through the patched function: the same bits as one call."""
    from vllm.v1.worker.cpu.logprob import compute_prompt_logprobs_with_chunking

    rows, hidden, vocab = 2500, 16, 700
    gen = torch.Generator().manual_seed(5)
    hidden_states = torch.randn(rows, hidden, generator=gen)
    head = torch.randn(hidden, vocab, generator=gen)
    prompt = torch.randint(0, vocab, (rows,), generator=gen)

    def logits_fn(h: torch.Tensor) -> torch.Tensor:
        return (h @ head).to(torch.bfloat16)

    ids, scores, _ = compute_prompt_logprobs_with_chunking(prompt, hidden_states, logits_fn, 0)
    want = rl_logp.logprobs(logits_fn(hidden_states), prompt, backend="chunked")
    assert torch.equal(ids[:, 0], prompt) and torch.equal(bits(scores[:, 0]), bits(want))


def test_v2_gpu_compute_token_logprobs_patched_entry(patched):
    from vllm.v1.worker.gpu.sample import logprob

    logits = torch.randn(9, 777)
    tokens = torch.randint(0, 777, (9, 4))
    got = logprob.compute_token_logprobs(logits, tokens)
    assert got.shape == (9, 4) and got.dtype == torch.float32
    for k in range(4):
        want = rl_logp.logprobs(logits, tokens[:, k], backend="chunked")
        assert torch.equal(bits(got[:, k]), bits(want))


def test_v2_gpu_apply_temperature_patch_is_ieee_division_and_keeps_0_and_1(patched):
    from vllm.v1.worker.gpu.sample import gumbel

    logits = torch.randn(4, 300)
    x = logits.clone()
    gumbel.apply_temperature(x, torch.tensor([3, 1, 2, 0]), torch.tensor([0.7, 1.0, 0.0, 1.3]))
    assert torch.equal(x[0], logits[0] / torch.tensor(1.3)) and torch.equal(x[3], logits[3] / torch.tensor(0.7))
    assert torch.equal(x[1:3], logits[1:3])


def test_apply_patches_every_runner_this_vllm_has_and_revert_restores_it():
    from importlib import import_module
    from importlib.metadata import entry_points

    targets = [(adapter.V2_GPU_LOGPROB, "compute_token_logprobs"), (adapter.V2_GPU_TEMPERATURE, "apply_temperature")]
    if _has(adapter.V2_CPU_LOGPROB):
        targets.append((adapter.V2_CPU_LOGPROB, "compute_token_logprobs"))
    originals = {(m, a): getattr(import_module(m), a) for m, a in targets}
    v1 = import_module(adapter.V1_SAMPLER) if _has(adapter.V1_SAMPLER) else None
    v1_original = v1.Sampler.__dict__["compute_logprobs"] if v1 else None
    names = adapter.apply(backend="chunked")
    for (m, a), original in originals.items():
        assert f"{m}.{a}" in names and getattr(import_module(m), a) is not original
    assert (f"{adapter.V1_SAMPLER}.Sampler.compute_logprobs" in names) == (v1 is not None)
    adapter.revert()
    for (m, a), original in originals.items():
        assert getattr(import_module(m), a) is original
    if v1 is not None:
        assert v1.Sampler.__dict__["compute_logprobs"] is v1_original
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("rl_logp") == "rl_logp.integrations.vllm_hook:load"


@pytest.mark.parametrize("backend", ["chunked", ""])
def test_vllm_plugin_loader_applies_the_patch_from_the_environment(backend):
    """vLLM's own `load_general_plugins` (what every vLLM process runs) in a fresh interpreter."""
    import os
    import subprocess
    import sys

    script = (
        "from vllm.plugins import load_general_plugins\n"
        "from rl_logp.integrations import vllm as adapter\n"
        "load_general_plugins()\n"
        "cfg = adapter.active_config()\n"
        "print('ACTIVE', cfg.backend if cfg else None)\n"
    )
    env = dict(os.environ, RL_LOGP_BACKEND=backend, VLLM_PLUGINS="rl_logp", TORCHDYNAMO_DISABLE="1")
    done = subprocess.run([sys.executable, "-P", "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"ACTIVE {backend or None}" in done.stdout


def test_rollout_provider_runs_vllm_code_and_matches_the_trainer():
    provider = adapter.VllmRolloutProvider(backend="chunked")
    try:
        logits = torch.randn(33, 500).to(torch.bfloat16)
        labels = torch.randint(0, 500, (33,))
        labels[0] = -100
        for temperature in (None, 0.7):
            got = provider(logits, labels, temperature)
            want = rl_logp.logprobs(logits, labels, backend="chunked", temperature=temperature)
            assert torch.equal(bits(got), bits(want))
        runner = "V1 Sampler" if _has(adapter.V1_SAMPLER) else "V2 worker"
        assert runner in provider.description and vllm.__version__ in provider.description
    finally:
        adapter.revert()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_verl_trainer_logp_equals_vllm_rollout_logp(temperature):
    """Both adapters on: verl 0.9.1's FSDP-engine temperature step and logprobs_from_logits (the trainer)
    and this vLLM's sampler code in processed_logprobs mode (the rollout) give the same bits."""
    engine = pytest.importorskip("verl.workers.engine.fsdp.transformer_impl", reason="verl is not installed")
    from rl_logp.integrations import verl as verl_adapter

    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(64, 1031, generator=gen) * 3).to(torch.bfloat16)
    tokens = torch.randint(0, 1031, (64,), generator=gen)
    rollout = adapter.VllmRolloutProvider(backend="chunked")
    verl_adapter.apply(backend="chunked")
    try:
        z = engine._scale_logits_by_temperature(logits, torch.full((64, 1), temperature),
                                                is_unit_temperature=temperature == 1.0)
        trainer = engine.logprobs_from_logits(logits=z, labels=tokens, inplace_backward=True)
        rolled = rollout(logits, tokens, temperature)
    finally:
        verl_adapter.revert()
        adapter.revert()
    assert torch.equal(bits(trainer), bits(rolled))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_v2_topk_logprobs_patched_equal_fused(dtype):
    from vllm.v1.worker.gpu.sample import logprob

    topk = next(getattr(logprob, name) for name in adapter.V2_TOPK_NAMES if hasattr(logprob, name))
    logits = (torch.randn(257, 151936, device="cuda") * 3).to(dtype)
    sampled = torch.randint(0, 151936, (257,), device="cuda")
    stock = topk(logits, 5, sampled)
    want = rl_logp.logprobs(logits, sampled, backend="fused")
    stock_differing = mismatches(stock.logprobs[:, 0], want)
    print(f"vllm {vllm.__version__} stock V2 Triton logprobs vs rl-logp fused ({dtype}): "
          f"{stock_differing}/257 rows differ")
    adapter.apply(backend="fused")
    try:
        got = topk(logits, 5, sampled)
    finally:
        adapter.revert()
    assert torch.equal(bits(got.logprobs[:, 0]), bits(want))
    for k in range(1, 6):
        assert torch.equal(bits(got.logprobs[:, k]), bits(rl_logp.logprobs(logits, got.logprob_token_ids[:, k],
                                                                         backend="fused")))
    assert torch.equal(got.selected_token_ranks, stock.selected_token_ranks)
    assert torch.equal(got.logprob_token_ids, stock.logprob_token_ids)


@needs_cuda
def test_cuda_v2_processed_logprobs_equal_fused_with_temperature():
    """V2 processed mode: vLLM's temperature step then compute_topk_scores, patched, equal the trainer's
    `rl_logp.logprobs(logits, tokens, temperature=T)`; the stock Triton division is measured beside it."""
    from vllm.v1.worker.gpu.sample import gumbel, logprob

    topk = next(getattr(logprob, name) for name in adapter.V2_TOPK_NAMES if hasattr(logprob, name))
    batch, vocab = 129, 151936
    logits = (torch.randn(batch, vocab, device="cuda") * 3).to(torch.bfloat16)
    sampled = torch.randint(0, vocab, (batch,), device="cuda")
    temps = torch.full((batch,), 0.7, device="cuda")
    rows = torch.arange(batch, device="cuda")
    stock = logits.float()
    gumbel.apply_temperature(stock, rows, temps)
    ieee = logits.float() / temps.unsqueeze(1)
    print(f"vllm {vllm.__version__} stock Triton temperature vs IEEE division: "
          f"{mismatches(stock, ieee)}/{batch * vocab} logits differ")
    adapter.apply(backend="fused")
    try:
        x = logits.float()
        gumbel.apply_temperature(x, rows, temps)
        got = topk(x, 0, sampled)
    finally:
        adapter.revert()
    assert torch.equal(bits(x), bits(ieee))
    want = rl_logp.logprobs(logits, sampled, backend="fused", temperature=0.7)
    assert torch.equal(bits(got.logprobs[:, 0]), bits(want))


@needs_cuda
@needs_v1
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_cuda_v1_sampler_patched_equal_fused(mode, monkeypatch):
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not carried to the device
    adapter.apply(backend="fused")
    try:
        from vllm.v1.sample.sampler import Sampler

        sampler = Sampler(logprobs_mode=mode)
        differing = 0
        for batch in (1, 7, 64, 129):
            logits = (torch.randn(batch, 151936, device="cuda") * 3).to(torch.bfloat16)
            out = sampler.forward(logits.clone(), _v1_metadata(batch, 0.7, 2, device="cuda"))
            tokens = out.sampled_token_ids[:, 0].long()
            want = rl_logp.logprobs(logits, tokens, backend="fused",
                                    temperature=0.7 if mode == "processed_logprobs" else None)
            differing += mismatches(out.logprobs_tensors.logprobs[:, 0], want)
        assert differing == 0
    finally:
        adapter.revert()
