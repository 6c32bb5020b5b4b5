"""The vLLM adapter against the real vLLM package (0.24.0, the version verl 0.9.1 pins), on the CPU."""

import pytest
import torch

vllm = pytest.importorskip("vllm.v1.sample.sampler", reason="vLLM is not installed (see scripts/setup.sh)")

from rl_logp.integrations import vllm as adapter  # noqa: E402

import rl_logp  # noqa: E402


@pytest.fixture(autouse=True)
def no_dynamo():
    # vLLM's gather_logprobs is torch.compile'd; on the CPU the first compile takes 13-22 s.
    with torch._dynamo.config.patch(disable=True):
        yield


@pytest.fixture
def patched():
    adapter.apply(backend="chunked")
    yield
    adapter.revert()


def _metadata(batch: int, temperature: float, logprobs: int):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.full((batch,), temperature), all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators={}, max_num_logprobs=logprobs, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_real_sampler_forward_returns_rl_logp_bits(patched, mode, dtype, temperature):
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler(logprobs_mode=mode)
    vocab, differing, checked = 1031, 0, 0
    for batch in range(1, 65):
        gen = torch.Generator().manual_seed(batch)
        logits = (torch.randn(batch, vocab, generator=gen) * 3).to(dtype)
        out = sampler.forward(logits.clone(), _metadata(batch, temperature, 3))
        tokens = out.sampled_token_ids[:, 0].long()
        got = out.logprobs_tensors.logprobs[:, 0]
        want = rl_logp.logprobs(logits, tokens, backend="chunked",
                                temperature=temperature if mode == "processed_logprobs" else None)
        differing += int((got.view(torch.int32) != want.view(torch.int32)).sum())
        checked += batch
        assert out.logprobs_tensors.logprobs.shape == (batch, 4)
        assert torch.equal(out.logprobs_tensors.logprob_token_ids[:, 0].long(), tokens)
    assert checked == 64 * 65 // 2 and differing == 0


def test_v2_compute_token_logprobs_patched_entry(patched):
    from vllm.v1.worker.gpu.sample import logprob

    logits = torch.randn(9, 777)
    tokens = torch.randint(0, 777, (9, 4))
    got = logprob.compute_token_logprobs(logits, tokens)
    assert got.shape == (9, 4) and got.dtype == torch.float32
    for k in range(4):
        want = rl_logp.logprobs(logits, tokens[:, k], backend="chunked")
        assert torch.equal(got[:, k].view(torch.int32), want.view(torch.int32))


def test_revert_restores_vllm_and_entry_point_is_registered():
    from importlib.metadata import entry_points

    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu.sample import logprob

    before = (Sampler.__dict__["compute_logprobs"], logprob.compute_token_logprobs)
    adapter.apply(backend="chunked")
    assert logprob.compute_token_logprobs is not before[1]
    adapter.revert()
    assert (Sampler.__dict__["compute_logprobs"], logprob.compute_token_logprobs) == before
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("rl_logp") == "rl_logp.integrations.vllm_hook:load"


def test_rollout_provider_runs_vllm_code_and_matches_the_trainer():
    provider = adapter.VllmRolloutProvider(backend="chunked")
    try:
        logits = torch.randn(33, 500).to(torch.bfloat16)
        labels = torch.randint(0, 500, (33,))
        labels[0] = -100
        for temperature in (None, 0.7):
            got = provider(logits, labels, temperature)
            want = rl_logp.logprobs(logits, labels, backend="chunked", temperature=temperature)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert "vLLM V1 Sampler" in provider.description
    finally:
        adapter.revert()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_v2_topk_logprobs_patched_equal_fused(dtype):
    from vllm.v1.worker.gpu.sample import logprob

    logits = (torch.randn(257, 151936, device="cuda") * 3).to(dtype)
    sampled = torch.randint(0, 151936, (257,), device="cuda")
    stock = logprob.compute_topk_logprobs(logits, 5, sampled)
    want = rl_logp.logprobs(logits, sampled, backend="fused")
    stock_differing = int((stock.logprobs[:, 0].view(torch.int32) != want.view(torch.int32)).sum())
    print(f"stock vLLM V2 Triton logprobs vs rl-logp fused: {stock_differing}/257 rows differ")
    adapter.apply(backend="fused")
    try:
        got = logprob.compute_topk_logprobs(logits, 5, sampled)
    finally:
        adapter.revert()
    assert torch.equal(got.logprobs[:, 0].view(torch.int32), want.view(torch.int32))
    assert torch.equal(got.selected_token_ranks, stock.selected_token_ranks)
    assert torch.equal(got.logprob_token_ids, stock.logprob_token_ids)


@needs_cuda
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_cuda_v1_sampler_patched_equal_fused(mode):
    adapter.apply(backend="fused")
    try:
        from vllm.v1.sample.sampler import Sampler

        sampler = Sampler(logprobs_mode=mode)
        differing = 0
        for batch in (1, 7, 64, 129):
            logits = (torch.randn(batch, 151936, device="cuda") * 3).to(torch.bfloat16)
            md = _metadata(batch, 0.7, 2)
            md.temperature = md.temperature.cuda()
            md.frequency_penalties, md.presence_penalties, md.repetition_penalties = (
                md.frequency_penalties.cuda(), md.presence_penalties.cuda(), md.repetition_penalties.cuda())
            out = sampler.forward(logits.clone(), md)
            tokens = out.sampled_token_ids[:, 0].long()
            want = rl_logp.logprobs(logits, tokens, backend="fused",
                                    temperature=0.7 if mode == "processed_logprobs" else None)
            differing += int((out.logprobs_tensors.logprobs[:, 0].view(torch.int32) != want.view(torch.int32)).sum())
        assert differing == 0
    finally:
        adapter.revert()
