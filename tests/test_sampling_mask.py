"""The top-k / top-p kept-set contract (`rl_logp.sampling_mask`): the definition checked in Python integers,
its invariances (batch, row order, chunking, column order), the temperature, and what the trainer gets
from masked logits. vLLM's side (its sampler using this set) is tested in tests/test_vllm_adapter.py."""

import math
from fractions import Fraction

import pytest
import torch
from helpers import bits, logp_and_grad, mismatches, model_like_logits, needs_cuda

import rl_logp
from rl_logp.config import LogpConfig
from rl_logp.sampling_mask import apply_top_k_top_p, ceil_times, mask_logits_

NEG_INF = float("-inf")


def kept_by_definition(z: torch.Tensor, k: int | None, p: float | None, bits_f: int = 40) -> set[int]:
    """The module docstring's rule for one fp32 row, in Python integers (q from torch's exp, as defined)."""
    values = z.tolist()
    v = len(values)
    if k is not None and 0 < k < v:
        tau = sorted(values, reverse=True)[k - 1]
        kept = [j for j in range(v) if values[j] >= tau]
    else:
        kept = list(range(v))
    if p is None or p >= 1:
        return set(kept)
    q = (torch.exp(z - max(values)) * 2.0**bits_f).to(torch.int64).tolist()
    target = math.ceil(Fraction(float(torch.tensor(p, dtype=torch.float32))) * sum(q[j] for j in kept))
    mass_above, running = {}, 0  # for each value of q: the mass of the kept tokens with a larger q
    for value in sorted({q[j] for j in kept}, reverse=True):
        mass_above[value] = running
        running += value * sum(1 for j in kept if q[j] == value)
    return {j for j in kept if mass_above[q[j]] < target}


def kept_columns(masked: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row != NEG_INF).flatten().tolist()) for row in masked]


@pytest.mark.parametrize("kind", ["integers (many ties)", "bf16-rounded", "continuous"])
def test_kept_set_is_the_definition(kind):
    gen = torch.Generator().manual_seed(3)
    checked = differing = 0
    for vocab in (1, 2, 7, 64, 300):
        for k in (None, -1, 0, 1, 2, 5, vocab - 1, vocab, vocab + 3):
            for p in (None, 1.0, 0.999, 0.9, 0.5, 0.3, 1e-6):
                x = {"integers (many ties)": torch.randint(-3, 4, (3, vocab), generator=gen).float(),
                     "bf16-rounded": (torch.randn(3, vocab, generator=gen) * 3).bfloat16().float(),
                     "continuous": torch.randn(3, vocab, generator=gen) * 5}[kind]
                got = kept_columns(apply_top_k_top_p(x, top_k=k, top_p=p))
                for row in range(3):
                    differing += got[row] != kept_by_definition(x[row], k, p)
                    checked += 1
    assert checked == 3 * 5 * 9 * 7 and differing == 0


def test_ceil_times_is_exact():
    gen = torch.Generator().manual_seed(0)
    specials = [0.0, 1.0, 0.5, 0.9, 1e-7, 1e-30, 1e-40, float(torch.finfo(torch.float32).tiny)]
    p = torch.cat([torch.tensor(specials), torch.rand(3000, generator=gen)]).to(torch.float32)
    s_values = [0, 1, 3, 2**31 - 1, 2**31, 2**40 + 1, 2**57 + 12345, 2**62 + 7, 2**63 - 1]
    s = torch.cat([torch.tensor(s_values), torch.randint(0, 2**62, (p.numel() - len(s_values),), generator=gen)])
    got = ceil_times(p, s).tolist()
    want = [math.ceil(Fraction(a) * b) for a, b in zip(p.tolist(), s.tolist(), strict=True)]
    assert sum(g != w for g, w in zip(got, want, strict=True)) == 0


def test_kept_set_is_batch_order_chunk_and_column_invariant():
    x = model_like_logits(40, 3001, torch.bfloat16, "cpu", seed=5)
    gen = torch.Generator().manual_seed(1)
    k = torch.randint(1, 400, (40,), generator=gen)
    p = torch.rand(40, generator=gen) * 0.95 + 0.02
    options = {"temperature": 0.7, "top_k": k, "top_p": p}
    full = apply_top_k_top_p(x, **options)
    alone = torch.cat([apply_top_k_top_p(x[i : i + 1], temperature=0.7, top_k=k[i : i + 1], top_p=p[i : i + 1])
                       for i in range(40)])
    perm = torch.randperm(40, generator=gen)
    permuted = apply_top_k_top_p(x[perm], temperature=0.7, top_k=k[perm], top_p=p[perm])
    one_row_chunks = apply_top_k_top_p(x, **options, config=LogpConfig(chunk_bytes=4096))
    cols = torch.randperm(3001, generator=gen)
    by_columns = apply_top_k_top_p(x[:, cols], **options)
    assert mismatches(alone, full) == 0 and mismatches(permuted, full[perm]) == 0
    assert mismatches(one_row_chunks, full) == 0 and mismatches(by_columns, full[:, cols]) == 0
    kept = (full != NEG_INF).sum(dim=1)
    assert (kept >= 1).all() and (kept < 3001).all()  # the parameters do cut every row


def test_values_are_the_contracts_ieee_division_by_t():
    x = model_like_logits(6, 500, torch.bfloat16, "cpu", seed=2)
    t = torch.tensor([0.7, 1.0, 1.3, 0.25, 2.0, 0.9])
    z = x.float() / t.unsqueeze(1)
    per_row = apply_top_k_top_p(x, temperature=t, top_p=0.95)
    kept = per_row != NEG_INF
    assert mismatches(per_row[kept], z[kept]) == 0
    scalar = apply_top_k_top_p(x[:1], temperature=0.7, top_p=0.95)
    assert mismatches(scalar, per_row[:1]) == 0


@pytest.mark.parametrize("temperature", [None, 0.7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_masking_is_dropping_the_columns(dtype, temperature):
    """logp of masked logits renormalises over the kept set: the same bits as scoring only the kept columns
    (masked columns add exactly 0 to S); the gradient is zero outside the set and, without a temperature
    (autograd divides the gradient by T where the kernel multiplies by 1/T), the same bits inside."""
    x = model_like_logits(8, 700, dtype, "cpu", seed=9)
    options = {"temperature": temperature, "top_k": 50, "top_p": 0.9}
    masked = apply_top_k_top_p(x, **options)
    gen = torch.Generator().manual_seed(4)
    labels = torch.multinomial(masked.softmax(dim=-1), 1, generator=gen).squeeze(1)
    leaf = x.detach().clone().requires_grad_(True)
    logp = rl_logp.logprobs(apply_top_k_top_p(leaf, **options), labels, backend="chunked")
    logp.sum().backward()
    for row in range(8):
        cols = torch.nonzero(masked[row] != NEG_INF).flatten()
        label = (cols == labels[row]).nonzero().flatten()
        want, want_grad = logp_and_grad(x[row : row + 1, cols], label, backend="chunked", temperature=temperature)
        assert torch.equal(bits(logp[row : row + 1].detach()), bits(want))
        if temperature is None:
            assert torch.equal(bits(leaf.grad[row, cols]), bits(want_grad[0]))
        outside = torch.ones(700, dtype=torch.bool)
        outside[cols] = False
        assert outside.any() and (leaf.grad[row, outside] == 0).all()


def test_rows_left_alone():
    x = torch.randn(5, 40)
    x[1] = NEG_INF
    x[2, 3] = float("nan")
    out = apply_top_k_top_p(x, top_k=torch.tensor([3, 3, 3, 0, 40]), top_p=torch.tensor([0.5, 0.5, 0.5, 1.0, 1.0]))
    assert torch.isneginf(out[1]).all() and torch.isnan(out[2, 3]) and not torch.isinf(out[2]).any()
    assert torch.equal(out[3:], x[3:])  # k <= 0 or k >= V and p = 1: no cut
    assert (out[0] != NEG_INF).sum() <= 3
    ties = torch.tensor([[2.0, 5.0, 5.0, 1.0, 5.0]])
    assert kept_columns(apply_top_k_top_p(ties, top_k=1)) == [{1, 2, 4}]  # the k-th value's ties are kept
    assert kept_columns(apply_top_k_top_p(ties, top_p=1e-6)) == [{1, 2, 4}]  # the top tie group, whole


def test_top_p_boundary_is_exact():
    """A row whose top token holds exactly half of the fixed-point mass (F = 20): p = 0.5 keeps it alone
    (the mass above the next tokens equals ceil(p S), not below it); the next float32 above 0.5 keeps all."""
    config = LogpConfig(fixed_point_bits=20)
    c = torch.tensor(-0.6931472)
    while int(torch.exp(c) * 2.0**20) != 2**19:  # a logit whose q is exactly 2^19 under this exp
        c = torch.nextafter(c, torch.tensor(0.0))
    row = torch.stack([torch.tensor(0.0), c, c]).unsqueeze(0)
    half = torch.tensor(0.5)
    assert kept_columns(apply_top_k_top_p(row, top_p=0.5, config=config)) == [{0}]
    above = float(torch.nextafter(half, torch.tensor(1.0)))
    assert kept_columns(apply_top_k_top_p(row, top_p=above, config=config)) == [{0, 1, 2}]


def test_mask_logits_in_place_is_the_same_set():
    x = model_like_logits(9, 800, torch.float32, "cpu", seed=3)
    k = torch.full((9,), 30, dtype=torch.int32)
    p = torch.full((9,), 0.8)
    z = x.clone()
    out = mask_logits_(z, k, p, LogpConfig())
    assert out.data_ptr() == z.data_ptr()
    assert mismatches(out, apply_top_k_top_p(x, top_k=30, top_p=0.8)) == 0


@pytest.mark.parametrize("kwargs,match", [
    ({"top_p": 0.0}, r"top_p=0.0 must be finite and in \(0, 1.0\]"),
    ({"top_p": 1.5}, "top_p=1.5"),
    ({"top_p": float("nan")}, "top_p=nan"),
    ({"temperature": 0.0}, "temperature=0.0"),
    ({"temperature": 1e-50}, "temperature=1e-50"),
    ({"temperature": float("inf")}, "temperature=inf"),
    ({"top_k": 2.5}, "top_k=2.5 must be an integer"),
    ({"top_k": "5"}, "top_k must be a number or a tensor"),
    ({"top_p": torch.full((3,), 0.5)}, r"top_p has shape \(3,\)"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        apply_top_k_top_p(torch.randn(2, 10), **kwargs)


@needs_cuda
def test_cuda_mask_has_no_host_sync_and_replays_in_a_cuda_graph():
    x = model_like_logits(64, 151936, torch.float32, "cuda", seed=1)
    k = torch.randint(1, 1000, (64,), device="cuda", dtype=torch.int32)
    p = torch.rand(64, device="cuda") * 0.9 + 0.05
    config = LogpConfig()
    want = mask_logits_(x.clone(), k, p, config)
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = mask_logits_(x.clone(), k, p, config)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mask_logits_(static.clone(), k, p, config)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mask_logits_(static, k, p, config)
    static.copy_(x)
    graph.replay()
    assert mismatches(eager, want) == 0 and mismatches(captured, want) == 0
    assert ((want != NEG_INF).sum(dim=1) < 151936).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_sample_kept_draws_from_the_softmax_of_the_kept_set(device):
    """`sample_kept` (the patched FlashInfer sampler's draw): over 40000 rows of the same logits and fresh
    noise, each kept token is drawn at its softmax probability among the kept ones (within 5 standard
    errors) and no other token is drawn; on CUDA through the kept-set kernel drawing in its last pass."""
    from rl_logp.sampling_mask import sample_kept

    rows = 40000
    z = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0], device=device).expand(rows, 5).contiguous()
    k = torch.full((rows,), 3, dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(3)
    noise = torch.empty_like(z).exponential_(generator=gen)
    frequency = torch.bincount(sample_kept(z, k, None, noise, LogpConfig()), minlength=5).double().cpu() / rows
    want = torch.softmax(torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64), 0)
    assert frequency[3:].sum() == 0
    assert ((frequency[:3] - want).abs() <= 5 * (want * (1 - want) / rows).sqrt()).all(), frequency
