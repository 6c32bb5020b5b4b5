"""The vLLM adapter against the real vLLM package, on the CPU and (where CUDA is present) the GPU.

scripts/test.sh runs this file twice: against vLLM 0.24.0 (installed; the version verl 0.9.1 pins: V1
sampler and V2 GPU worker) and against the latest release's sources (scripts/vllm_latest.sh: no V1
sampler; V2 GPU and CPU workers). vLLM is imported plainly: a broken install fails the file. Each test
needs one runner layout and skips, naming it, on the other.
"""

import importlib
import importlib.util
import json

import numpy as np
import pytest
import torch
import vllm
from helpers import bits, mismatches

import rl_logp
from rl_logp.check.cases import Sampling
from rl_logp.integrations import vllm as adapter
from rl_logp.integrations.vllm_rollout import VllmRollout
from rl_logp.sampling_mask import apply_top_k_top_p


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


layout = f"vLLM {vllm.__version__} has no"
needs_v1 = pytest.mark.skipif(not _has(adapter.V1_SAMPLER), reason=f"{layout} V1 sampler (removed after 0.2x)")
needs_cpu_worker = pytest.mark.skipif(not _has(adapter.V2_CPU_LOGPROB), reason=f"{layout} V2 CPU worker (0.3x on)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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


def _v1_metadata(batch: int, temperature: float, logprobs: int, device: str = "cpu",
                 top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    def full(value: float) -> torch.Tensor:
        return torch.full((batch,), value, device=device)

    return SamplingMetadata(
        temperature=full(temperature), all_greedy=False, all_random=True, top_p=top_p, top_k=top_k,
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


def _top_k_top_p(batch: int, which: str, gen: torch.Generator, device: str = "cpu"):
    """vLLM's per-row sampling tensors: top_k int32 in [1, 200), top_p fp32 in [0.05, 0.95)."""
    k = torch.randint(1, 200, (batch,), generator=gen, dtype=torch.int32).to(device) if "k" in which else None
    p = (torch.rand(batch, generator=gen) * 0.9 + 0.05).to(device) if "p" in which else None
    return k, p


@needs_v1
@pytest.mark.parametrize("which", ["top_k", "top_p", "top_k+top_p"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_v1_sampler_processed_logprobs_under_top_k_top_p_equal_the_trainer(patched, which, dtype, temperature):
    """V1 `Sampler.forward` in processed_logprobs mode with per-row top-k / top-p: the sampled token lies in
    the contract's kept set, and its logprob (and the top-3's) are the bits the trainer gets from
    `rl_logp.logprobs(apply_top_k_top_p(logits, temperature=T, top_k=k, top_p=p), tokens)`."""
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler(logprobs_mode="processed_logprobs")
    vocab, differing, checked, cut = 1031, 0, 0, 0
    for batch in range(1, 65):
        gen = torch.Generator().manual_seed(batch)
        logits = (torch.randn(batch, vocab, generator=gen) * 3).to(dtype)
        k, p = _top_k_top_p(batch, which, gen)
        out = sampler.forward(logits.clone(), _v1_metadata(batch, temperature, 3, top_k=k, top_p=p))
        masked = apply_top_k_top_p(logits, temperature=temperature, top_k=k, top_p=p)
        tokens = out.logprobs_tensors.logprob_token_ids.long()
        assert torch.equal(tokens[:, 0], out.sampled_token_ids[:, 0].long())
        assert torch.isfinite(masked.gather(1, tokens[:, :1])).all()
        for col in range(4):
            want = rl_logp.logprobs(masked, tokens[:, col], backend="chunked")
            differing += mismatches(out.logprobs_tensors.logprobs[:, col], want)
        checked += batch
        cut += int(torch.isneginf(masked).any(dim=1).sum())
    assert checked == 64 * 65 // 2 and differing == 0 and cut == checked


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_patched_apply_top_k_top_p_is_the_contract_for_every_caller(patched, dtype):
    """The function every vLLM sampler calls (V1, its rejection sampler, the V2 GPU and CPU workers),
    called as they call it on processed fp32 logits, masks exactly the contract's set, in place."""
    from vllm.v1.sample.ops import topk_topp_sampler

    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(37, 1500, generator=gen) * 3).to(dtype)
    k, p = _top_k_top_p(37, "top_k+top_p", gen)
    for which in ("top_k", "top_p", "top_k+top_p"):
        kk, pp = (k if "k" in which else None), (p if "p" in which else None)
        z = logits.float() / torch.tensor(0.7)
        out = topk_topp_sampler.apply_top_k_top_p(z, kk, pp, has_topp_only_rows="k" not in which)
        assert out.data_ptr() == z.data_ptr()
        assert mismatches(out, apply_top_k_top_p(logits, temperature=0.7, top_k=kk, top_p=pp)) == 0


def test_vllm_own_top_p_is_the_contract_rule_up_to_ties():
    """The control for the patch: vLLM's own PyTorch top-k/top-p (unpatched) keeps the same set as the
    contract on continuous logits, but on bf16 logits (many ties) it splits tied tokens at the top-p
    boundary by sort order, where the contract keeps the whole tie group."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    differing = {"float32": 0, "bfloat16": 0}
    for batch in range(1, 65):
        gen = torch.Generator().manual_seed(batch)
        for name in differing:
            x = (torch.randn(batch, 1031, generator=gen) * 3).to(getattr(torch, name)).float()
            k, p = _top_k_top_p(batch, "top_k+top_p" if batch % 2 else "top_p", gen)
            ours = ~torch.isneginf(apply_top_k_top_p(x, top_k=k, top_p=p))
            theirs = ~torch.isneginf(apply_top_k_top_p_pytorch(x.clone(), k, p))
            for row in torch.nonzero((ours != theirs).any(dim=1)).flatten():
                extra = ours[row] & ~theirs[row]
                assert not (theirs[row] & ~ours[row]).any()  # vLLM never keeps a token the contract drops
                assert (x[row][extra] == x[row][theirs[row]].min()).all()  # the extra ones tie vLLM's last
                differing[name] += 1
    print(f"vllm {vllm.__version__} own top-k/top-p vs the contract, rows whose kept set differs: {differing}")
    assert differing["float32"] == 0 and differing["bfloat16"] > 0


def test_flashinfer_sample_replacement_draws_from_the_kept_set(patched):
    """FlashInfer's sampler (V1 forward_cuda, V2 GPU worker) is replaced: tokens come from the contract's
    kept set, the logits are left as they were, and a request's own generator makes its draw repeatable."""
    from vllm.v1.sample.ops import topk_topp_sampler

    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(50, 900, generator=gen) * 3
    k, p = _top_k_top_p(50, "top_k+top_p", gen)
    before = logits.clone()
    draws = [topk_topp_sampler.flashinfer_sample(logits, k, p, {3: torch.Generator().manual_seed(7)})
             for _ in range(2)]
    assert torch.equal(logits, before)
    kept = torch.isfinite(apply_top_k_top_p(logits, top_k=k, top_p=p))
    for tokens in draws:
        assert tokens.shape == (50,) and kept.gather(1, tokens.unsqueeze(1)).all()
    assert draws[0][3] == draws[1][3]


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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_v2_cpu_worker_processed_scores_under_top_k_top_p_equal_the_trainer(patched, dtype):
    """The CPU worker's own request state (SamplingParams with T, top-k, top-p per request) masks with the
    patched `apply_top_k_top_p`; `compute_topk_scores` on the result equals the trainer's masked logp."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.cpu.logprob import compute_topk_scores
    from vllm.v1.worker.cpu.sampler import CPUSamplingStates

    vocab, differing, checked = 1031, 0, 0
    for batch in range(1, 65, 3):
        gen = torch.Generator().manual_seed(batch)
        logits = (torch.randn(batch, vocab, generator=gen) * 3).to(dtype)
        k, p = _top_k_top_p(batch, "top_k+top_p", gen)
        t = torch.tensor([0.7, 1.0, 1.3])[torch.arange(batch) % 3]
        states = CPUSamplingStates(batch, vocab, logits.device)
        for row in range(batch):
            states.add_request(row, SamplingParams(temperature=float(t[row]), top_k=int(k[row]),
                                                   top_p=float(p[row]), logprobs=3))
        rows, rows_np = torch.arange(batch), np.arange(batch)
        x = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        states.apply_temperature(x, rows, rows_np)
        x = states.apply_top_k_top_p(x, rows, rows_np)
        masked = apply_top_k_top_p(logits, temperature=t, top_k=k, top_p=p)
        sampled = torch.multinomial(masked.softmax(dim=-1), 1, generator=gen).squeeze(1)
        out = compute_topk_scores(x, 3, sampled)
        for col in range(4):
            want = rl_logp.logprobs(masked, out.logprob_token_ids[:, col], backend="chunked")
            differing += mismatches(out.logprobs[:, col], want)
        checked += batch
    assert checked == sum(range(1, 65, 3)) and differing == 0


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


def _columns_differing(logprobs: torch.Tensor, ids: torch.Tensor, scored: torch.Tensor,
                       temperature: torch.Tensor | None = None, backend: str = "chunked") -> int:
    """Entries of a [B, 1 + n] logprob block whose bits are not `rl_logp.logprobs` of the same token ids
    (given as a contiguous copy: a column of vLLM's token-id matrix is a strided view)."""
    cols = ids.shape[1]
    t = None if temperature is None else temperature.unsqueeze(1).expand(-1, cols)
    want = rl_logp.logprobs(scored.unsqueeze(1).expand(-1, cols, -1), ids.to(torch.int64, copy=True),
                            temperature=t, backend=backend)
    return mismatches(logprobs, want)


def _sampling_batch(batch: int, vocab: int, seed: int):
    """bf16 logits, per-row T, top-k (int32) and top-p, the contract's kept set and a token drawn from it."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(torch.bfloat16)
    t = torch.tensor([0.7, 1.0, 1.3])[torch.arange(batch) % 3]
    k, p = _top_k_top_p(batch, "top_k+top_p", gen)
    masked = apply_top_k_top_p(logits, temperature=t, top_k=k, top_p=p)
    sampled = torch.multinomial(masked.softmax(dim=-1), 1, generator=gen).squeeze(1)
    return logits, t, k, p, masked, sampled


@needs_v1
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "processed_logprobs+top_k+top_p"])
def test_v1_sampler_top_20_logprobs_are_rl_logp_bits_in_every_column(patched, mode):
    """Regression for n > 0 (the benchmark once reported column 0 wrong there): `Sampler.forward` with 20
    top logprobs; the sampled token's and all 20 others' logprobs are the trainer's bits."""
    from vllm.v1.sample.sampler import Sampler

    logits, t, k, p, masked, _ = _sampling_batch(37, 1031, 4)
    masks = mode.endswith("top_p")
    metadata = _v1_metadata(37, 1.0, 20, top_k=k if masks else None, top_p=p if masks else None)
    metadata.temperature.copy_(t)
    out = Sampler(logprobs_mode=mode.split("+")[0]).forward(logits.clone(), metadata)
    ids, logprobs = out.logprobs_tensors.logprob_token_ids, out.logprobs_tensors.logprobs
    assert logprobs.shape == (37, 21) and torch.equal(ids[:, 0].long(), out.sampled_token_ids[:, 0].long())
    if mode == "raw_logprobs":
        assert _columns_differing(logprobs, ids, logits) == 0
    elif masks:
        assert _columns_differing(logprobs, ids, masked) == 0
    else:
        assert _columns_differing(logprobs, ids, logits, temperature=t) == 0


GATHER_DEVICES = [pytest.param("cpu", id="interpret-cpu", marks=pytest.mark.skipif(
                      not rl_logp.fused_runs_on(torch.device("cpu")), reason="needs Triton's interpreter (TRITON_INTERPRET=1)")),
                  pytest.param("cuda", id="cuda", marks=needs_cuda)]


def _gather_logprobs(batch: int, vocab: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logprobs of bf16 logits (many tied values per row: the count of entries >= a token's logprob
    counts ties) with a NaN row, a row of -inf, a row with -inf and NaN entries; and tokens, some on ties."""
    gen = torch.Generator().manual_seed(seed)
    logprobs = (torch.randn(batch, vocab, generator=gen) * 3).to(torch.bfloat16).float().log_softmax(dim=-1)
    tokens = torch.randint(0, vocab, (batch,), generator=gen)
    if batch >= 4:
        logprobs[1] = float("nan")
        logprobs[2] = float("-inf")
        logprobs[3, ::3], logprobs[3, 1::7] = float("-inf"), float("nan")
        tokens[3] = 0  # a -inf token: every -inf entry counts
    return logprobs.to(device), tokens.to(device)


def _same_logprobs_tensors(got, want) -> bool:
    return (type(got) is type(want) and torch.equal(got.logprob_token_ids, want.logprob_token_ids)
            and got.logprob_token_ids.dtype == want.logprob_token_ids.dtype == torch.int32
            and torch.equal(bits(got.logprobs), bits(want.logprobs))
            and torch.equal(got.selected_token_ranks, want.selected_token_ranks)
            and got.selected_token_ranks.dtype == want.selected_token_ranks.dtype)


@needs_v1
@pytest.mark.parametrize("device", GATHER_DEVICES)
def test_v1_gather_logprobs_patched_is_vllms_own_bit_for_bit(device, monkeypatch):
    """The patched V1 `Sampler.gather_logprobs` (vLLM's top-k, then one launch of
    `kernels.sampled_rank`): vLLM's own function's ids, logprobs and ranks, bit for bit and of its dtypes,
    for n = 0, 1, 5, 20 over rows with ties, NaN and -inf, a vocabulary of several kernel blocks; the
    calls after a signature's first run its plan (no launch set up again), another n binds anew, and a
    plan whose launch declines (logprobs off a 16-byte boundary) gives way to the ordinary path, which a
    call without a signature takes too."""
    from vllm.v1.sample.sampler import LogprobsTensors, Sampler

    from rl_logp import rollout_calls
    from rl_logp.kernels import sampled_rank as module

    original = Sampler.gather_logprobs
    gather = adapter.make_gather_logprobs(original, LogprobsTensors)
    ordinary, launch = [], module.sampled_rank
    monkeypatch.setattr(module, "sampled_rank", lambda *args: (ordinary.append(1), launch(*args)))
    rollout_calls.clear()
    vocab = module.BLOCK * 2 + 77 if device == "cuda" else 1000
    try:
        for n in (0, 1, 5, 20):
            for seed, batch in enumerate((9, 9, 1)):
                logprobs, tokens = _gather_logprobs(batch, vocab, device, seed)
                want = original(logprobs, n, tokens)
                assert _same_logprobs_tensors(gather(logprobs, n, tokens), want), (n, batch)
        assert len(ordinary) == 8 and len(rollout_calls._plans) == 8  # per n: the 9-row and 1-row signatures
        logprobs, tokens = _gather_logprobs(9, vocab + 1, device, 7)
        base = logprobs.flatten()[: 9 * vocab + 1]
        for x in (base[:-1].view(9, vocab), base[1:].view(9, vocab)):  # the n = 20 plan's signature, then off 16 bytes
            t = tokens % vocab
            assert _same_logprobs_tensors(gather(x, 20, t), original(x, 20, t))
        assert len(ordinary) == 9  # the plan ran on the aligned logprobs and declined the shifted ones
        with rollout_calls.ordinary_path():  # no signature (a call while a CUDA graph is captured): the kernel
            assert _same_logprobs_tensors(gather(logprobs, 5, tokens), original(logprobs, 5, tokens))
        assert len(ordinary) == 10
    finally:
        rollout_calls.clear()


@needs_v1
@pytest.mark.parametrize("device", GATHER_DEVICES)
def test_v1_gather_logprobs_patched_token_outside_the_row_is_nan_and_rank_minus_1(device):
    """A token id outside [0, V) reads nothing outside the row: a NaN logprob and the rank -1 (vLLM's own
    gather raises there); the other rows are vLLM's."""
    from vllm.v1.sample.sampler import LogprobsTensors, Sampler

    gather = adapter.make_gather_logprobs(Sampler.gather_logprobs, LogprobsTensors)
    logprobs, tokens = _gather_logprobs(5, 300, device, 3)
    inside = tokens.clone()
    tokens[[0, 4]] = torch.tensor([300, -1], device=device)
    got, want = gather(logprobs, 2, tokens), Sampler.gather_logprobs(logprobs, 2, inside)
    assert torch.isnan(got.logprobs[[0, 4], 0]).all() and got.selected_token_ranks[[0, 4]].tolist() == [-1, -1]
    assert got.logprob_token_ids[[0, 4], 0].tolist() == [300, -1]
    assert torch.equal(bits(got.logprobs[1:4]), bits(want.logprobs[1:4]))
    assert torch.equal(got.selected_token_ranks[1:4], want.selected_token_ranks[1:4])
    assert torch.equal(bits(got.logprobs[:, 1:]), bits(want.logprobs[:, 1:]))


@needs_v1
def test_v1_gather_logprobs_patched_leaves_other_layouts_to_vllm(monkeypatch):
    """Logprobs the kernel does not take (fp16, a strided view, int32 token ids, no rows) go to vLLM's own
    function, with its result (and its errors: int32 ids, no rows)."""
    from vllm.v1.sample.sampler import LogprobsTensors, Sampler

    from rl_logp.kernels import sampled_rank as module

    monkeypatch.setattr(module, "sampled_rank", lambda *args: pytest.fail("the kernel ran"))
    gather = adapter.make_gather_logprobs(Sampler.gather_logprobs, LogprobsTensors)
    logprobs, tokens = _gather_logprobs(6, 400, "cpu", 4)
    for x in (logprobs.half(), logprobs[:, ::2]):
        t = tokens % x.shape[1]
        assert _same_logprobs_tensors(gather(x, 3, t), Sampler.gather_logprobs(x, 3, t))
    with pytest.raises(AssertionError):
        gather(logprobs, 3, tokens.int())
    with pytest.raises(RuntimeError):
        gather(logprobs[:0], 3, tokens[:0])


@needs_cpu_worker
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "processed_logprobs+top_k+top_p"])
def test_v2_cpu_worker_top_20_logprobs_are_rl_logp_bits_in_every_column(patched, mode):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.cpu.logprob import compute_topk_scores
    from vllm.v1.worker.cpu.sampler import CPUSamplingStates

    logits, t, k, p, masked, sampled = _sampling_batch(37, 1031, 5)
    masks = mode.endswith("top_p")
    x = logits
    if mode != "raw_logprobs":
        states = CPUSamplingStates(37, 1031, logits.device)
        for row in range(37):
            states.add_request(row, SamplingParams(temperature=float(t[row]), top_k=int(k[row]) if masks else 0,
                                                   top_p=float(p[row]) if masks else 1.0, logprobs=20))
        rows, rows_np = torch.arange(37), np.arange(37)
        x = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        states.apply_temperature(x, rows, rows_np)
        x = states.apply_top_k_top_p(x, rows, rows_np)
    out = compute_topk_scores(x, 20, sampled)
    assert out.logprobs.shape == (37, 21) and torch.equal(out.logprob_token_ids[:, 0], sampled)
    if mode == "raw_logprobs":
        assert _columns_differing(out.logprobs, out.logprob_token_ids, logits) == 0
    elif masks:
        assert _columns_differing(out.logprobs, out.logprob_token_ids, masked) == 0
    else:
        assert _columns_differing(out.logprobs, out.logprob_token_ids, logits, temperature=t) == 0


V2_GPU_WORKER_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import test_vllm_adapter as t
from rl_logp.integrations import vllm as adapter
from vllm.v1.sample.ops import topk_topp_sampler
from vllm.v1.worker.gpu.sample import gumbel, logprob

device = {device!r}
topk = next(getattr(logprob, name) for name in adapter.V2_TOPK_NAMES if hasattr(logprob, name))
logits, temps, k, p, masked, sampled = (v.to(device) for v in t._sampling_batch(9, 1031, 6))
differing = {{}}
with adapter.patched(backend="fused"):
    for mode in ("raw_logprobs", "processed_logprobs", "processed_logprobs+top_k+top_p"):
        x = logits
        if mode != "raw_logprobs":
            x = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
            gumbel.apply_temperature(x, torch.arange(9, device=device, dtype=torch.int32), temps)
        if mode.endswith("top_p"):
            x = topk_topp_sampler.apply_top_k_top_p(x, k, p)
        out = topk(x, 20, sampled)
        scored, temperature = {{"raw_logprobs": (logits, None), "processed_logprobs": (logits, temps)}}.get(
            mode, (masked, None))
        differing[mode] = t._columns_differing(out.logprobs, out.logprob_token_ids, scored, temperature, "fused")
print("DIFFERING", json.dumps(differing))
"""


def test_v2_gpu_worker_top_20_logprobs_are_rl_logp_bits_in_every_column(tmp_path):
    """The V2 GPU worker's own Triton code (`compute_topk_logprobs` / `compute_topk_scores`, its top-k, its
    ranks kernel) with 20 top logprobs, raw, after its `apply_temperature` and after `apply_top_k_top_p`
    (both patched), scored with the fused kernels. Without a GPU it runs under Triton's interpreter in a
    fresh interpreter: vLLM turns Triton off when no driver is active, unless CUDA_VISIBLE_DEVICES is
    set (to "": no GPU)."""
    import os
    import subprocess
    import sys

    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    if device == "cpu":
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    script = V2_GPU_WORKER_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), device=device)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("DIFFERING"))
    assert json.loads(line.split(" ", 1)[1]) == {
        "raw_logprobs": 0, "processed_logprobs": 0, "processed_logprobs+top_k+top_p": 0}


@pytest.mark.parametrize("sampling_mask", [True, False])
def test_apply_patches_every_runner_this_vllm_has_and_revert_restores_it(sampling_mask):
    from importlib import import_module
    from importlib.metadata import entry_points

    targets = [(adapter.V2_GPU_LOGPROB, "compute_token_logprobs"), (adapter.V2_GPU_TEMPERATURE, "apply_temperature")]
    if _has(adapter.V2_CPU_LOGPROB):
        targets.append((adapter.V2_CPU_LOGPROB, "compute_token_logprobs"))
    sampling = [(adapter.V1_TOPK_TOPP, "apply_top_k_top_p"), (adapter.V1_TOPK_TOPP, "flashinfer_sample")]
    originals = {(m, a): getattr(import_module(m), a) for m, a in targets + sampling}
    v1 = import_module(adapter.V1_SAMPLER) if _has(adapter.V1_SAMPLER) else None
    v1_sites = ("compute_logprobs", "gather_logprobs")
    v1_originals = {a: v1.Sampler.__dict__[a] for a in v1_sites} if v1 else {}
    names = adapter.apply(backend="chunked", sampling_mask=sampling_mask)
    for (m, a), original in originals.items():
        replaced = (m, a) in targets or sampling_mask
        assert (f"{m}.{a}" in names) == replaced and (getattr(import_module(m), a) is not original) == replaced
    for a in v1_sites:
        assert (f"{adapter.V1_SAMPLER}.Sampler.{a}" in names) == (v1 is not None)
    assert adapter.active_patches() == names
    adapter.revert()
    for (m, a), original in originals.items():
        assert getattr(import_module(m), a) is original
    for a, original in v1_originals.items():
        assert v1.Sampler.__dict__[a] is original
    assert adapter.active_config() is None and adapter.active_patches() == []
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("rl_logp") == "rl_logp.integrations.vllm_hook:load"


def test_patched_scope_restores_what_was_there():
    from vllm.v1.sample.ops import topk_topp_sampler

    original = topk_topp_sampler.apply_top_k_top_p
    with adapter.patched(backend="chunked"):
        assert topk_topp_sampler.apply_top_k_top_p is not original
    assert topk_topp_sampler.apply_top_k_top_p is original and adapter.active_config() is None
    adapter.apply(backend="chunked", sampling_mask=False)
    try:
        with adapter.patched(backend="auto"):
            assert adapter.active_config().backend == "auto"
        assert adapter.active_config().backend == "chunked" and topk_topp_sampler.apply_top_k_top_p is original
    finally:
        adapter.revert()


@pytest.mark.parametrize("value,masked", [("0", False), ("off", False), ("1", True), (None, True)])
def test_hook_reads_the_sampling_mask_switch(monkeypatch, value, masked):
    from rl_logp.integrations import vllm_hook

    monkeypatch.setenv("RL_LOGP_BACKEND", "chunked")
    if value is None:
        monkeypatch.delenv("RL_LOGP_VLLM_SAMPLING_MASK", raising=False)
    else:
        monkeypatch.setenv("RL_LOGP_VLLM_SAMPLING_MASK", value)
    vllm_hook.load()
    try:
        assert adapter.active_config().backend == "chunked"
        assert (f"{adapter.V1_TOPK_TOPP}.apply_top_k_top_p" in adapter.active_patches()) == masked
    finally:
        adapter.revert()


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rollout_provider_runs_vllm_code_on_a_copy_and_matches_the_trainer(dtype):
    """The check's rollout side: vLLM's sampler steps (which divide and mask in place) run on the
    provider's own copy, so the caller's logits keep their bits (fp32 input included: `.to(float32)` would
    alias it); the patch lasts for the call only; every sampling setting matches the trainer."""
    provider = VllmRollout(backend="chunked")
    gen = torch.Generator().manual_seed(8)
    logits = (torch.randn(33, 500, generator=gen) * 3).to(dtype)
    before = logits.clone()
    top = Sampling(temperature=0.7, top_k=40, top_p=0.9)
    masked = apply_top_k_top_p(logits, temperature=0.7, top_k=40, top_p=0.9)
    sampled = torch.multinomial(masked.softmax(dim=-1), 1, generator=gen).squeeze(1)
    random = torch.randint(0, 500, (33,), generator=gen)
    random[0], sampled[1] = -100, 600
    for sampling, labels in ((Sampling(), random), (Sampling(temperature=0.7), random), (top, sampled)):
        got = provider(logits, labels, sampling)
        if sampling.masks:
            want = rl_logp.logprobs(masked, labels, backend="chunked")
        else:
            want = rl_logp.logprobs(logits, labels, backend="chunked", temperature=sampling.temperature)
        assert torch.equal(bits(got), bits(want))
        assert torch.equal(bits(logits), bits(before))
        assert adapter.active_config() is None
    assert got[1] == 0 and torch.isfinite(got).all()
    runner = "V1 Sampler" if _has(adapter.V1_SAMPLER) else "V2 worker"
    assert runner in provider.description and vllm.__version__ in provider.description


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_verl_trainer_logp_equals_vllm_rollout_logp(temperature):
    """Both adapters on: verl 0.9.1's FSDP-engine temperature step and logprobs_from_logits (the trainer)
    and this vLLM's sampler code in processed_logprobs mode (the rollout) give the same bits."""
    from verl.workers.engine.fsdp import transformer_impl as engine

    from rl_logp.integrations import verl as verl_adapter

    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(64, 1031, generator=gen) * 3).to(torch.bfloat16)
    tokens = torch.randint(0, 1031, (64,), generator=gen)
    rolled = VllmRollout(backend="chunked")(logits, tokens, Sampling(temperature=temperature))
    verl_adapter.apply(backend="chunked")
    try:
        z = engine._scale_logits_by_temperature(logits, torch.full((64, 1), temperature),
                                                is_unit_temperature=temperature == 1.0)
        trainer = engine.logprobs_from_logits(logits=z, labels=tokens, inplace_backward=True)
    finally:
        verl_adapter.revert()
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
    assert _columns_differing(got.logprobs, got.logprob_token_ids, logits, backend="fused") == 0
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


@needs_cuda
@needs_v1
def test_cuda_v1_sampler_top_k_top_p_processed_equal_fused(monkeypatch):
    """On the GPU vLLM would mask with its Triton pivot kernel (batch >= 8) or a sort (smaller batches):
    patched, every batch samples from the contract's kept set and reports the trainer's bits."""
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "0")
    adapter.apply(backend="fused")
    try:
        from vllm.v1.sample.sampler import Sampler

        sampler = Sampler(logprobs_mode="processed_logprobs")
        differing = 0
        for batch in (1, 7, 64, 129):
            gen = torch.Generator().manual_seed(batch)
            logits = (torch.randn(batch, 151936, generator=gen) * 3).to(torch.bfloat16).cuda()
            k, p = _top_k_top_p(batch, "top_k+top_p", gen, device="cuda")
            out = sampler.forward(logits.clone(), _v1_metadata(batch, 0.7, 2, device="cuda", top_k=k, top_p=p))
            masked = apply_top_k_top_p(logits, temperature=0.7, top_k=k, top_p=p)
            tokens = out.sampled_token_ids[:, 0].long()
            assert torch.isfinite(masked.gather(1, tokens.unsqueeze(1))).all()
            differing += mismatches(out.logprobs_tensors.logprobs[:, 0], rl_logp.logprobs(masked, tokens, backend="fused"))
        assert differing == 0
    finally:
        adapter.revert()


@needs_cuda
def test_cuda_v2_top_k_top_p_processed_equal_fused():
    """The V2 GPU worker's processed path: its fp32 copy, `apply_temperature` and `apply_top_k_top_p`
    (both patched), then `compute_topk_scores`/`compute_topk_logprobs`: the trainer's masked bits."""
    from vllm.v1.sample.ops import topk_topp_sampler
    from vllm.v1.worker.gpu.sample import gumbel, logprob

    topk = next(getattr(logprob, name) for name in adapter.V2_TOPK_NAMES if hasattr(logprob, name))
    batch = 129
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(batch, 151936, generator=gen) * 3).to(torch.bfloat16).cuda()
    k, p = _top_k_top_p(batch, "top_k+top_p", gen, device="cuda")
    temps = torch.full((batch,), 0.7, device="cuda")
    masked = apply_top_k_top_p(logits, temperature=temps, top_k=k, top_p=p)
    sampled = torch.multinomial(masked.softmax(dim=-1), 1).squeeze(1)
    with adapter.patched(backend="fused"):
        x = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        gumbel.apply_temperature(x, torch.arange(batch, device="cuda"), temps)
        x = topk_topp_sampler.apply_top_k_top_p(x, k, p)
        got = topk(x, 3, sampled)
    assert mismatches(x, masked) == 0
    assert _columns_differing(got.logprobs, got.logprob_token_ids, masked, backend="fused") == 0
