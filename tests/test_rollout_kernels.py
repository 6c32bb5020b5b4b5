"""The rollout's Triton kernels against the pure-torch code they replace on CUDA: the kept-set kernel
(`rl_logp.kernels.kept_set`) against the contract's reference (`rl_logp.sampling_mask.reference_thresholds`):
the same kept tokens, the same bits. On the CPU the kernels run under Triton's interpreter, whose exp is
numpy's, not torch's: these rows have no top-p cut that an ulp of exp moves (a fixed seed, so the result
is the same on every run); on CUDA both sides use the same exp."""

import pytest
import torch
from helpers import INTERPRET, mismatches, model_like_logits, needs_cuda

from rl_logp.config import LogpConfig
from rl_logp.sampling_mask import NEG_INF, mask_logits_, reference_thresholds

DEVICES = [
    pytest.param("cpu", id="interpret-cpu", marks=pytest.mark.skipif(not INTERPRET, reason="TRITON_INTERPRET is off")),
    pytest.param("cuda", id="cuda", marks=needs_cuda),
]


def kernel_mask(z: torch.Tensor, k, p, bits: int = 40, **launch) -> tuple[torch.Tensor, torch.Tensor]:
    """(z masked in place by the kernel, the kernel's thresholds)."""
    from rl_logp.kernels.kept_set import KeptSetLaunch, kept_set

    out, threshold = z.clone(), torch.empty(z.shape[0], device=z.device)
    kept_set(out, k, p, bits, threshold, write=True, launch=KeptSetLaunch(**launch))
    return out, threshold


def contract_mask(z: torch.Tensor, k, p, bits: int = 40) -> torch.Tensor:
    return z.masked_fill(z < reference_thresholds(z, k, p, bits, 2**28).unsqueeze(1), NEG_INF)


def rows(kind: str, n: int, vocab: int, device: str, gen: torch.Generator) -> torch.Tensor:
    """Logits divided by a temperature, with the edge rows first: part -inf, all -inf, a NaN, a +inf."""
    z = {"integers (many ties)": lambda: torch.randint(-3, 4, (n, vocab), generator=gen).float(),
         "bf16-rounded": lambda: (torch.randn(n, vocab, generator=gen) * 3).bfloat16().float() / 0.7,
         "model-like": lambda: model_like_logits(n, vocab, torch.bfloat16, "cpu", seed=vocab).float() / 0.7,
         "continuous": lambda: torch.randn(n, vocab, generator=gen) * 5}[kind]()
    z[0, : vocab // 2] = NEG_INF
    z[1] = NEG_INF
    z[2, vocab // 3] = float("nan")
    z[3, 1] = float("inf")
    return z.to(device)


def parameters(n: int, vocab: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row top-k (int32) and top-p, random, with every special value in the first rows: k of 1, V,
    V - 1, 0, -1 and beyond V; p of 1, NaN, 0, -0.5, 1e-7 and just below 1."""
    k = torch.randint(1, min(vocab, 300), (n,), generator=gen, dtype=torch.int32)
    p = torch.rand(n, generator=gen) * 0.98 + 0.01
    k[4:10] = torch.tensor([1, vocab, vocab - 1, 0, -1, vocab + 5], dtype=torch.int32)
    p[4:10] = torch.tensor([1.0, float("nan"), 0.0, -0.5, 1e-7, 0.99999994])
    return k.to(device), p.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["integers (many ties)", "bf16-rounded", "model-like", "continuous"])
def test_kept_set_kernel_is_the_contract(device, kind):
    gen = torch.Generator().manual_seed(len(kind))
    vocab = 1500 if device == "cpu" else 151936
    n = 12 if device == "cpu" else 64
    z = rows(kind, n, vocab, device, gen)
    k, p = parameters(n, vocab, device, gen)
    differing = 0
    for top_k, top_p in ((k, None), (None, p), (k, p)):
        masked, threshold = kernel_mask(z, top_k, top_p)
        want = contract_mask(z, top_k, top_p)
        differing += mismatches(masked, want) + mismatches(contract_mask_by(z, threshold), want)
        assert (torch.isneginf(want[10:]) & ~torch.isneginf(z[10:])).any(dim=1).all()  # random rows are cut
    assert differing == 0


def contract_mask_by(z: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return z.masked_fill(z < threshold.unsqueeze(1), NEG_INF)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("small,big", [(4, 16), (2, 64)], ids=["bisection", "large-sort"])
def test_kept_set_kernel_fallbacks_are_the_contract(device, small, big):
    """Scratch rows too small for the brackets: the large sort (big) and the bisection over keys (a
    bracket above big) give the same sets."""
    gen = torch.Generator().manual_seed(small)
    differing = 0
    for kind in ("integers (many ties)", "bf16-rounded"):
        z = rows(kind, 12, 300, device, gen)
        k, p = parameters(12, 300, device, gen)
        for top_k, top_p in ((k, None), (None, p), (k, p)):
            masked, _ = kernel_mask(z, top_k, top_p, small=small, big=big)
            differing += mismatches(masked, contract_mask(z, top_k, top_p))
    assert differing == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,split,buckets,big", [(1, 5, 32, 4096), (3, 3, 128, 64), (7, 2, 64, 16)],
                         ids=["one-row", "three-rows-large-sort", "seven-rows-bisection"])
def test_kept_set_split_plan_is_the_contract(device, batch, split, buckets, big):
    """The split plan (column ranges on several programs per row, four launches) on small shapes: tiles of
    64 so that every row is cut into `split` ranges, edge rows included (at batch 7: part -inf, all -inf,
    NaN, +inf), k in the hundreds (a bracket above `big` is bisected) and p's special values."""
    from rl_logp.kernels.kept_set import KeptSetLaunch, split_count

    gen = torch.Generator().manual_seed(batch)
    vocab, launch = 400, {"block": 64, "split": split, "buckets": buckets, "small": 16, "big": big}
    differing = 0
    for kind in ("integers (many ties)", "bf16-rounded"):
        z = rows(kind, batch + 4, vocab, device, gen)[4:] if batch < 7 else rows(kind, batch, vocab, device, gen)
        k, p = parameters(10, vocab, device, gen)
        k, p = k[-batch:], p[-batch:]
        k[-1] = 250  # the k-th key far below the max
        assert split_count(z, KeptSetLaunch(**launch)) == split
        for top_k, top_p in ((k, None), (None, p), (k, p)):
            masked, threshold = kernel_mask(z, top_k, top_p, **launch)
            assert top_k is None or (torch.isneginf(masked[-1]).any() and not torch.isneginf(masked[-1]).all())
            want = contract_mask(z, top_k, top_p)
            differing += mismatches(masked, want) + mismatches(contract_mask_by(z, threshold), want)
            fused, fused_threshold = kernel_mask(z, top_k, top_p, **{**launch, "split_rows": 0})
            differing += mismatches(fused, masked) + mismatches(fused_threshold, threshold)
    assert differing == 0


@pytest.mark.parametrize("device", DEVICES)
def test_kept_set_kernel_top_p_boundary_and_fixed_point_bits(device):
    """F = 20, a row whose top token holds exactly half the mass: p = 0.5 keeps it alone, the next float32
    above 0.5 keeps all three (the test_sampling_mask boundary row, through the kernel)."""
    c = torch.tensor(-0.6931472)
    while int(torch.exp(c) * 2.0**20) != 2**19:
        c = torch.nextafter(c, torch.tensor(0.0))
    row = torch.stack([torch.tensor(0.0), c, c]).unsqueeze(0).repeat(2, 1).to(device)
    above = float(torch.nextafter(torch.tensor(0.5), torch.tensor(1.0)))
    p = torch.tensor([0.5, above], device=device)
    masked, _ = kernel_mask(row, None, p, bits=20)
    assert (~torch.isneginf(masked)).tolist() == [[True, False, False], [True, True, True]]
    assert mismatches(masked, contract_mask(row, None, p, bits=20)) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_kept_set_kernel_threshold_mode_leaves_the_logits(device):
    gen = torch.Generator().manual_seed(9)
    z = rows("bf16-rounded", 12, 700, device, gen)
    k, p = parameters(12, 700, device, gen)
    from rl_logp.kernels.kept_set import kept_set

    before, threshold = z.clone(), torch.empty(12, device=device)
    kept_set(z, k, p, 40, threshold, write=False)
    assert mismatches(z, before) == 0
    assert mismatches(contract_mask_by(z, threshold), contract_mask(z, k, p)) == 0
    assert torch.isneginf(threshold[1:4]).all()  # rows whose max is not finite are left alone


@needs_cuda
@pytest.mark.parametrize("batch", [1, 8, 64, 256, 1024])
def test_cuda_mask_logits_is_the_contract_at_rollout_size(batch):
    """What the patched vLLM samplers run (`mask_logits_`, the kernel on CUDA) on [B, 151936]."""
    z = model_like_logits(batch, 151936, torch.bfloat16, "cuda", seed=batch).float() / 0.7
    gen = torch.Generator().manual_seed(batch)
    k = torch.randint(1, 2000, (batch,), generator=gen, dtype=torch.int32).cuda()
    p = (torch.rand(batch, generator=gen) * 0.9 + 0.05).cuda()
    for top_k, top_p in ((k, None), (None, p), (k, p)):
        got = mask_logits_(z.clone(), top_k, top_p, LogpConfig())
        assert mismatches(got, contract_mask(z, top_k, top_p)) == 0


@needs_cuda
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("launch", [{"split_rows": 0}, {}, {"split": 7, "buckets": 1024}, {"split": 64, "block": 1024}],
                         ids=["fused", "default", "split-7", "split-64"])
def test_cuda_kept_set_plans_are_the_contract(batch, launch):
    """Both launch plans at rollout size, with k up to thousands, against the contract and each other."""
    z = model_like_logits(batch, 151936, torch.bfloat16, "cuda", seed=batch + 1).float() / 0.7
    gen = torch.Generator().manual_seed(batch)
    k = torch.randint(1, 3000, (batch,), generator=gen, dtype=torch.int32).cuda()
    p = (torch.rand(batch, generator=gen) * 0.9 + 0.05).cuda()
    for top_k, top_p in ((k, None), (None, p), (k, p)):
        masked, threshold = kernel_mask(z, top_k, top_p, **launch)
        want = contract_mask(z, top_k, top_p)
        assert mismatches(masked, want) == 0 and mismatches(contract_mask_by(z, threshold), want) == 0
