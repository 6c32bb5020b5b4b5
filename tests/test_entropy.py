"""rl_logp.entropy: fp64 accuracy, masked columns and rows, batch and chunk invariance, verl's patch."""

import pytest
import torch
from helpers import HAS_CUDA, INTERPRET, batch_sizes, mismatches, model_like_logits

from rl_logp import entropy

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))]


def entropy_and_grad(x, **kw):
    leaf = x.detach().clone().requires_grad_(True)
    h = entropy(leaf, **kw)
    h.sum().backward()
    return h.detach(), leaf.grad


def analytic_fp64(x, temperature=1.0):
    z = x.double() / temperature
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
    h = -plogp.sum(-1)
    grad = -torch.where(p > 0, p * (logp + h.unsqueeze(-1)), torch.zeros_like(p)) / temperature
    return torch.nan_to_num(h), torch.nan_to_num(grad), torch.nan_to_num(p)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [None, 0.7])
def test_entropy_matches_fp64_with_masked_tails_and_rows(device, dtype, temperature):
    x = model_like_logits(8, 3001, dtype, device)
    x[2, 1500:] = float("-inf")
    x[5] = float("-inf")
    h, g = entropy_and_grad(x, temperature=temperature)
    ref_h, ref_g, ref_p = analytic_fp64(x, temperature or 1.0)
    assert h[5] == 0 and (g[5] == 0).all() and torch.isfinite(g.float()).all()
    assert (h.double() - ref_h).abs().max() < 2e-6
    # p * (log p + H) cancels where log p ~ -H: the error is bounded by p times fp32 rounding of the
    # logit scale, plus the dtype's rounding of the result.
    eps = torch.finfo(dtype).eps
    assert ((g.double() - ref_g).abs() <= eps * ref_g.abs() + 1e-5 * ref_p + 1e-7).all()


@pytest.mark.parametrize("device", DEVICES)
def test_entropy_is_batch_and_chunk_invariant(device):
    vocab = 1031 if device == "cpu" else 151936
    pool = model_like_logits(130, vocab, torch.bfloat16, device, seed=3)
    alone = [entropy_and_grad(pool[i : i + 1]) for i in (0, 64, 129)]
    bad = 0
    for size in batch_sizes(129):
        h, g = entropy_and_grad(pool[:size])
        for j, i in enumerate((0, 64, 129)):
            if i < size:
                bad += mismatches(h[i : i + 1], alone[j][0]) + mismatches(g[i : i + 1], alone[j][1])
    small = entropy_and_grad(pool[:40], chunk_bytes=12 * (vocab // 3))
    whole = entropy_and_grad(pool[:40])
    bad += mismatches(small[0], whole[0]) + mismatches(small[1], whole[1])
    assert bad == 0


@pytest.mark.parametrize("backend", ["chunked", pytest.param("fused", marks=pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="the fused kernel cannot run here"))])
@pytest.mark.parametrize("temperature", [None, 0.7])
def test_entropy_inplace_backward_writes_the_same_gradient_into_the_logits(backend, temperature):
    """With `inplace_backward` the entropy's gradient is written over a non-leaf copy of the logits and
    handed to the leaf as its .grad (no logits-sized buffer), with the bits of the ordinary backward; the
    leaf itself is never overwritten."""
    device = "cuda" if backend == "fused" and HAS_CUDA else "cpu"
    leaf = model_like_logits(6, 1031, torch.float32, device, seed=5).requires_grad_(True)
    want = entropy_and_grad(leaf, backend=backend, temperature=temperature)[1]
    before = leaf.detach().clone()
    x = leaf.clone()
    entropy(x, backend=backend, temperature=temperature, inplace_backward=True).sum().backward()
    assert leaf.grad.data_ptr() == x.data_ptr() and mismatches(leaf.grad, want) == 0
    leaf.grad = None
    entropy(leaf, backend=backend, temperature=temperature, inplace_backward=True).sum().backward()
    assert mismatches(leaf.detach(), before) == 0 and leaf.grad.data_ptr() != leaf.data_ptr()
    assert mismatches(leaf.grad, want) == 0
