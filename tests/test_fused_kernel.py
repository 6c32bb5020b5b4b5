"""The fused Triton kernel: equality with the chunked path, edge rows, 64-bit offsets, device guard,
workspace. GPU tests skip on CPU; the logic tests also run under TRITON_INTERPRET=1 on the CPU."""

import pytest
import torch
from helpers import (
    HAS_CUDA,
    INTERPRET,
    logp_and_grad,
    make_engine,
    mismatches,
    model_like_logits,
    needs_cuda,
    random_labels,
)

from rl_logp import logprobs, resolve_backend

FUSED_DEVICES = [
    pytest.param("cpu", id="interpret-cpu", marks=pytest.mark.skipif(not INTERPRET, reason="TRITON_INTERPRET is off")),
    pytest.param("cuda", id="cuda", marks=needs_cuda),
]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("vocab", [1, 255, 1031, 151936])
@pytest.mark.parametrize("temperature", [None, 0.7])
def test_fused_equals_chunked_bitwise_on_gpu(dtype, vocab, temperature):
    logits = model_like_logits(33, vocab, dtype, "cuda", seed=vocab)
    labels = random_labels(33, vocab, "cuda", seed=vocab)
    labels[3] = -100
    fused = logp_and_grad(logits, labels, backend="fused", temperature=temperature)
    chunked = logp_and_grad(logits, labels, backend="chunked", temperature=temperature)
    assert mismatches(fused[0], chunked[0]) == 0
    assert mismatches(fused[1], chunked[1]) == 0


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_split_and_cast_quantisations_agree(device):
    from rl_logp.kernels.fused_logp import QUANT_CAST, QUANT_SPLIT, FusedConfig, FusedEngine

    vocab = 151936 if device == "cuda" else 3001
    x = model_like_logits(9, vocab, torch.bfloat16, device, seed=2)
    a = FusedEngine(FusedConfig(quant=QUANT_SPLIT)).row_stats(x, None, 40)
    b = FusedEngine(FusedConfig(quant=QUANT_CAST)).row_stats(x, None, 40)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_ignored_and_out_of_range_rows_give_zero_and_zero_grad(device):
    vocab = 300
    logits = model_like_logits(6, vocab, torch.bfloat16, device)
    labels = torch.tensor([-100, -1, vocab, vocab + 7, 5, 2**40], device=device)
    logp, grad = logp_and_grad(logits, labels, backend="fused")
    assert torch.equal(logp[[0, 1, 2, 3, 5]], torch.zeros(5, device=device))
    assert mismatches(grad[[0, 1, 2, 3, 5]], torch.zeros_like(grad[[0, 1, 2, 3, 5]])) == 0
    assert logp[4] < 0 and grad[4].abs().sum() > 0


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_masked_tails_and_fully_masked_rows(device):
    vocab = 500
    logits = model_like_logits(3, vocab, torch.float32, device)
    logits[0, 400:] = float("-inf")
    logits[1, :] = float("-inf")
    labels = torch.tensor([3, 3, 3], device=device)
    logp, grad = logp_and_grad(logits, labels, backend="fused")
    assert torch.isfinite(logp).all() and torch.isfinite(grad).all()
    assert logp[1] == 0 and grad[1].abs().sum() == 0
    assert (grad[0, 400:] == 0).all()
    chunked = logp_and_grad(logits, labels, backend="chunked")
    if device == "cuda":
        assert mismatches(logp, chunked[0]) == 0 and mismatches(grad, chunked[1]) == 0


@needs_cuda
def test_rows_past_int32_offsets():
    # 16384 x 151936 elements: rows beyond 14134 start past 2^31 elements.
    n, vocab = 16384, 151936
    x = torch.empty(n, vocab, dtype=torch.bfloat16, device="cuda").normal_(0, 2)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    assert (n - 1) * vocab > 2**31
    x.requires_grad_(True)
    logp = logprobs(x, labels, backend="fused")
    logp.sum().backward()
    tail = slice(n - 3, n)
    alone = logp_and_grad(x.detach()[tail], labels[tail], backend="fused")
    assert mismatches(logp.detach()[tail], alone[0]) == 0
    assert mismatches(x.grad[tail], alone[1]) == 0
    assert torch.isfinite(x.grad[-1]).all() and x.grad[-1].abs().sum() > 0


@needs_cuda
def test_forward_allocates_only_outputs_and_backward_only_the_gradient():
    n, vocab = 4096, 151936
    x = torch.randn(n, vocab, device="cuda").to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    logprobs(x, labels, backend="fused").sum().backward()  # compile outside the measurement
    x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = logprobs(x, labels, backend="fused")
    fwd_peak = torch.cuda.max_memory_allocated() - base
    # outputs + per-row fp32/int64 statistics: a few dozen bytes per row, nothing per logit
    assert fwd_peak <= 64 * n, fwd_peak
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out.sum().backward()
    bwd_peak = torch.cuda.max_memory_allocated() - base
    assert bwd_peak <= x.numel() * 2 + 64 * n, bwd_peak
    x.grad = None
    y = x.detach().clone().requires_grad_(True)
    out = logprobs(y, labels, backend="fused", inplace_backward=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.sum().backward()
    assert torch.cuda.max_memory_allocated() - base <= 64 * n


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_inplace_backward_gives_the_same_gradient(device):
    vocab = 1031 if device == "cpu" else 151936
    logits = model_like_logits(7, vocab, torch.bfloat16, device)
    labels = random_labels(7, vocab, device)
    expected = logp_and_grad(logits, labels, backend="fused")[1]
    leaf = logits.clone().requires_grad_(True)
    scaled = leaf * 1.0  # a non-leaf the gradient can overwrite
    logprobs(scaled, labels, backend="fused", inplace_backward=True).sum().backward()
    assert mismatches(leaf.grad, expected) == 0


def test_inplace_backward_refuses_to_feed_a_later_reader():
    logits = model_like_logits(4, 64, torch.float32, "cpu").requires_grad_(True)
    labels = random_labels(4, 64, "cpu")
    scaled = logits * 2.0
    # Built first, so autograd runs its backward after ours: it saved `scaled`, which we overwrite.
    square = (scaled * scaled).sum()
    loss = logprobs(scaled, labels, backend="chunked", inplace_backward=True).sum() + square
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_second_gpu_while_first_is_current():
    torch.cuda.set_device(0)
    logits = model_like_logits(5, 151936, torch.bfloat16, "cuda:1")
    labels = random_labels(5, 151936, "cuda:1")
    on1 = logp_and_grad(logits, labels, backend="fused")
    on0 = logp_and_grad(logits.to("cuda:0"), labels.to("cuda:0"), backend="fused")
    assert on1[0].device == torch.device("cuda:1")
    assert mismatches(on1[0].cpu(), on0[0].cpu()) == 0 and mismatches(on1[1].cpu(), on0[1].cpu()) == 0


def test_auto_picks_fused_on_cuda_and_chunked_on_cpu():
    assert resolve_backend("auto", torch.device("cpu")) == "chunked"
    if HAS_CUDA:
        assert resolve_backend("auto", torch.device("cuda")) == "fused"


def test_fused_engine_shard_partials_are_given_a_global_max():
    engine = make_engine("fused") if (INTERPRET or HAS_CUDA) else None
    if engine is None:
        pytest.skip("the fused kernel cannot run here (no CUDA, TRITON_INTERPRET off)")
    device = "cuda" if HAS_CUDA else "cpu"
    x = model_like_logits(4, 700, torch.float32, device)
    global_max = x.amax(dim=1) + 1.5
    part = engine.fixed_sum(x[:, 100:350], None, global_max, 40)
    ref = (torch.exp(x[:, 100:350] - global_max[:, None]) * 2.0**40).to(torch.int64).sum(dim=1)
    if device == "cuda":
        assert torch.equal(part, ref)
    else:  # the interpreter's numpy exp is not torch's CPU exp: within a few ulps per term
        assert ((part - ref).abs().double() <= ref.double() * 2**-20 + 256).all()
