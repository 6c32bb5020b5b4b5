"""Accuracy of the invariant paths against an fp64 log_softmax reference, for logp and dlogits."""

import pytest
import torch
from helpers import invariant_targets, logp_and_grad, model_like_logits, random_labels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fp64_reference(logits, labels, temperature=1.0):
    x = logits.detach().double().requires_grad_(True)
    logp = torch.log_softmax(x / temperature, dim=-1).gather(1, labels.unsqueeze(1)).squeeze(1)
    logp.sum().backward()
    return logp.detach(), x.grad


def _check(backend, device, n, vocab, dtype, temperature=None):
    logits = model_like_logits(n, vocab, dtype, device, seed=vocab)
    labels = random_labels(n, vocab, device, seed=vocab)
    logp, grad = logp_and_grad(logits, labels, backend=backend, temperature=temperature)
    ref_logp, ref_grad = fp64_reference(logits, labels, temperature or 1.0)
    assert logp.dtype == torch.float32 and grad.dtype == dtype
    lse_scale = ref_logp.abs().max().item() + (logits.double().abs().max().item() / (temperature or 1.0))
    # fp32 rounding of the inputs' scale, a few ulps: the contract's fixed point sits far below it.
    assert (logp.double() - ref_logp).abs().max().item() <= 8 * 2**-24 * max(1.0, lse_scale)
    # dlogits = onehot - exp(z - lse): exp carries lse's fp32 rounding (relative error ~ ulp(lse)), then
    # the result is rounded to the logits' dtype (half an ulp of that dtype, subnormals included).
    info = torch.finfo(dtype)
    rel = info.eps + 8 * 2**-24 * max(1.0, lse_scale)
    tol = rel * ref_grad.abs() + info.smallest_normal * info.eps / 2
    assert bool(((grad.double() - ref_grad).abs() <= tol).all())
    return (logp.double() - ref_logp).abs().max().item(), (grad.double() - ref_grad).abs().max().item()


@pytest.mark.parametrize("backend,device", invariant_targets())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [1, 255, 1031])
def test_small_vocabularies_match_fp64(backend, device, dtype, vocab):
    _check(backend, device, 6, vocab, dtype)


@pytest.mark.parametrize("backend,device", invariant_targets())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qwen_vocabulary_matches_fp64(backend, device, dtype):
    _check(backend, device, 2, 151936, dtype)


@pytest.mark.parametrize("backend,device", invariant_targets())
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_temperature_matches_fp64(backend, device, temperature):
    _check(backend, device, 5, 1031, torch.bfloat16, temperature=temperature)
