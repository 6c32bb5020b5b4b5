"""The rollout's Triton kernels against the pure-torch code they replace on CUDA: the kept-set kernel
(`rl_logp.kernels.kept_set`) against the contract's reference (`rl_logp.sampling_mask.reference_thresholds`):
the same kept tokens, the same bits. On the CPU the kernels run under Triton's interpreter, whose exp is
numpy's, not torch's: these rows have no top-p cut that an ulp of exp moves (a fixed seed, so the result
is the same on every run); on CUDA both sides use the same exp."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from helpers import INTERPRET, mismatches, model_like_logits, needs_cuda

from rl_logp.config import LogpConfig
from rl_logp.kernels import kept_set_select
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
    launch = {"sample": 1} if device == "cpu" else {}  # the top-k pivot's path for k up to 155 of 1500
    for top_k, top_p in ((k, None), (None, p), (k, p)):
        masked, threshold = kernel_mask(z, top_k, top_p, **launch)
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


def order_keys(z: torch.Tensor) -> torch.Tensor:
    """The kernels' order-preserving int32 keys of fp32 z (-0.0 counted as +0.0)."""
    b = (z + 0.0).view(torch.int32)
    return torch.where(b >= 0, b, b ^ 0x7FFFFFFF)


def pivot_sample(vocab: int, chunk: int, chunks: int) -> torch.Tensor:
    """The columns of `pivot_key`'s sample, [256 groups, chunk * chunks]: group g's adjacent columns from
    g * max(V // 256, chunk * chunks) (past V where V < 256 * chunk * chunks)."""
    spread = max(vocab // 256, chunk * chunks)
    return torch.arange(256)[:, None] * spread + torch.arange(chunk * chunks)[None, :]


def reference_pivot(z: torch.Tensor, k: torch.Tensor, chunk: int, chunks: int, big: int) -> torch.Tensor:
    """`pivot_key` in torch: the r-th largest of the 256 sample groups' max keys, r = ceil((2k + 64)
    sampled / V), where top-k is on, 2k + 64 <= big / 2 and r <= 64; else 2^31 - 1."""
    n, vocab = z.shape
    cols = pivot_sample(vocab, chunk, chunks).to(z.device)
    padded = torch.cat([z, torch.full((n, int(cols.max()) + 1), NEG_INF, device=z.device)], dim=1)
    groups = order_keys(padded[:, cols]).amax(dim=2)
    ranked = groups.sort(dim=1, descending=True).values
    kk = k.long()
    target = 2 * kk + 64
    rank = (target * min(vocab, 256 * chunk * chunks) + vocab - 1) // vocab
    on = (kk > 0) & (kk < vocab) & (target <= big // 2) & (rank <= 64)
    picked = ranked.gather(1, (rank.clamp(1, 64) - 1)[:, None])[:, 0]
    return torch.where(on, picked, torch.full_like(picked, 2**31 - 1))


@triton.jit
def _pivot_probe(Z, stride, TOP_K, PIVOT, COUNT, MAX, SCRATCH, vocab, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                 BLOCK: tl.constexpr, BIG_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.load(TOP_K + row).to(tl.int64)
    pivot = kept_set_select.pivot_key(Z + row * stride, vocab, k, (k > 0) & (k < vocab), CHUNK, CHUNKS, BIG_)
    row_max, count = kept_set_select.max_and_compact_above(Z + row * stride, vocab, pivot, SCRATCH + row * BIG_,
                                                           BLOCK, BIG_)
    tl.store(PIVOT + row, pivot)
    tl.store(COUNT + row, count)
    tl.store(MAX + row, row_max)


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_pivot_compacts_every_key_at_or_above_it(device):
    """The fused plan's top-k pivot (`pivot_key`) and its pass (`max_and_compact_above`) against torch: the
    pivot of `reference_pivot`, the row's max (NaN where a NaN is), the count of keys >= the pivot and the
    first `big` of them in column order; and on logits with an LLM's spread most rows with top-k on take
    the pivot's path (k <= count <= big), the others (k off, k too large for the sample) none; a row whose
    sample holds its smallest keys has more than `big` keys above its pivot (the bucket path)."""
    cpu = device == "cpu"
    vocab, n, (chunk, chunks), block, big = (1500, 24, (1, 1), 512, 512) if cpu else (151936, 256, (16, 4), 4096, 4096)
    gen = torch.Generator().manual_seed(5)
    z = rows("model-like", n, vocab, device, gen)
    sample = pivot_sample(vocab, chunk, chunks).flatten()
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[sample] = False
    ordered = z[10].sort().values  # the sample holds the row's smallest keys: more than big above the pivot
    z[10, sample.to(device)], z[10, rest.to(device)] = ordered[: sample.numel()], ordered[sample.numel():]
    k = torch.randint(1, 96 if cpu else 260, (n,), generator=gen, dtype=torch.int32)
    k[4:10] = torch.tensor([1, vocab, vocab - 1, 0, -1, 2000], dtype=torch.int32)
    k = k.to(device)
    pivot, count = torch.empty(n, dtype=torch.int32, device=device), torch.empty(n, dtype=torch.int32, device=device)
    row_max = torch.empty(n, device=device)
    scratch = torch.full((n, big), -1, dtype=torch.int32, device=device)
    _pivot_probe[(n,)](z, z.stride(0), k, pivot, count, row_max, scratch, vocab, CHUNK=chunk, CHUNKS=chunks,
                       BLOCK=block, BIG_=big)
    assert torch.equal(pivot, reference_pivot(z, k, chunk, chunks, big))
    keys = order_keys(z)
    assert torch.equal(count, (keys >= pivot[:, None]).sum(dim=1).int())
    nan = z.isnan().any(dim=1)  # a NaN row's max is a NaN, its payload the kernel's
    assert torch.equal(row_max.isnan(), nan) and mismatches(row_max[~nan], z[~nan].amax(dim=1)) == 0
    for row in range(n):
        above = keys[row][keys[row] >= pivot[row]][:big]
        assert torch.equal(scratch[row, : above.numel()], above)
    on = (k > 0) & (k < vocab)
    pivoted = on & (count >= k) & (count <= big)
    assert not pivoted[~on].any() and bool((pivot[~on] == 2**31 - 1).all())
    assert count[10] > big and int(pivoted[11:].sum()) >= 0.9 * (n - 11), (k, count)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,split,block,buckets,big",
                         [(1, 5, 64, 32, 4096), (3, 3, 64, 128, 64), (7, 2, 64, 64, 16), (4, 8, 32, 128, 256)],
                         ids=["one-row", "three-rows-large-sort", "seven-rows-bisection", "four-rows-split-8"])
def test_kept_set_split_plan_is_the_contract(device, batch, split, block, buckets, big):
    """The split plan (column ranges on several programs per row, four launches) on small shapes: tiles of
    32 or 64 so that every row is cut into `split` ranges, the last one shorter (split 5: [384, 400) and an
    empty one), edge rows included (at batch 7: part -inf, all -inf, NaN, +inf), rows left alone (k <= 0
    with top-k alone), k in the hundreds (a bracket above `big` is bisected) and p's special values."""
    from rl_logp.kernels.kept_set import KeptSetLaunch, split_count

    gen = torch.Generator().manual_seed(batch)
    vocab, launch = 400, {"block": block, "split": split, "buckets": buckets, "small": 16, "big": big}
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


@pytest.mark.skipif(not INTERPRET, reason="TRITON_INTERPRET is off")
def test_kept_set_split_plan_in_any_arrival_order(shuffled_programs):
    """The split plan with its programs run in shuffled orders (rows interleaved, a row's ranges in any
    order): the last arrival of each row, whichever program it is, finds the row's cut and threshold. Four
    rows on split 3 (not a power of two; the last range shorter), one row all -inf and one with k <= 0 and
    p = 1 (left alone), with and without `write`; the same bits as the contract and the fused plan."""
    from rl_logp.kernels.kept_set import KeptSetLaunch, kept_set, split_count

    gen = torch.Generator().manual_seed(11)
    z = rows("integers (many ties)", 6, 400, "cpu", gen)[[4, 1, 5, 0]]  # random, all -inf, random, half -inf
    k = torch.tensor([250, 3, 0, 40], dtype=torch.int32)
    p = torch.tensor([0.9, 0.5, 1.0, 0.3])
    launch = {"block": 64, "split": 3, "small": 16, "big": 256}
    assert split_count(z, KeptSetLaunch(**launch)) == 3
    differing = 0
    for top_k, top_p in ((k, None), (None, p), (k, p)):
        masked, threshold = kernel_mask(z, top_k, top_p, **launch)
        want = contract_mask(z, top_k, top_p)
        differing += mismatches(masked, want) + mismatches(contract_mask_by(z, threshold), want)
        fused, fused_threshold = kernel_mask(z, top_k, top_p, **{**launch, "split_rows": 0})
        differing += mismatches(fused, masked) + mismatches(fused_threshold, threshold)
        assert torch.isneginf(threshold[1:3]).all() and not torch.isneginf(threshold[[0, 3]]).any()
    left, threshold_only = z.clone(), torch.empty(4)
    kept_set(left, k, p, 40, threshold_only, write=False, launch=KeptSetLaunch(**launch))
    differing += mismatches(left, z) + mismatches(threshold_only, threshold)
    assert differing == 0
    split_orders = [order for order in shuffled_programs if len(order) == 4 * 3]  # launches of the split plan
    assert len(split_orders) == 4 * 4  # four launches in each of the four calls
    last = {max((order.index(row * 3 + r), r) for r in range(3))[1] for order in split_orders for row in range(4)}
    assert last == {0, 1, 2}  # each range was the last of its row to run in some launch


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
    k = torch.randint(1, 2000, (batch,), generator=gen, dtype=torch.int32)
    k[::2] = torch.randint(1, 260, (batch - batch // 2,), generator=gen, dtype=torch.int32)  # the top-k pivot's
    k, p = k.cuda(), (torch.rand(batch, generator=gen) * 0.9 + 0.05).cuda()
    for top_k, top_p in ((k, None), (None, p), (k, p)):
        got = mask_logits_(z.clone(), top_k, top_p, LogpConfig())
        assert mismatches(got, contract_mask(z, top_k, top_p)) == 0


@needs_cuda
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("launch", [{"split_rows": 0}, {}, {"split": 7, "buckets": 1024}, {"split": 8},
                                    {"split": 64, "block": 1024}],
                         ids=["fused", "default", "split-7", "split-8", "split-64"])
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


@needs_cuda
@pytest.mark.parametrize("launch", [{}, {"split": 8}], ids=["default", "split-8"])
def test_cuda_split_plan_replays_in_a_cuda_graph(launch):
    """The split plan at one and eight rows, eager without a host sync, and captured once in a CUDA graph
    then replayed on two inputs: launch 1 zeroes the arrival counters again at each replay, so every
    replay gives the eager bits."""
    from rl_logp.kernels.kept_set import KeptSetLaunch, kept_set, split_count

    for batch in (1, 8):
        inputs = [model_like_logits(batch, 151936, torch.bfloat16, "cuda", seed=s).float() / 0.7 for s in (1, 2)]
        k = torch.full((batch,), 50, dtype=torch.int32, device="cuda")
        p = torch.full((batch,), 0.9, device="cuda")
        cfg = KeptSetLaunch(**launch)
        assert split_count(inputs[0], cfg) > 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = [kernel_mask(x, k, p, **launch) for x in inputs]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        static, threshold = inputs[0].clone(), torch.empty(batch, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kept_set(static, k, p, 40, threshold, write=True, launch=cfg)
        for x, (masked, want_threshold) in zip(inputs, eager, strict=True):
            static.copy_(x)
            graph.replay()
            assert mismatches(static, masked) == 0 and mismatches(threshold, want_threshold) == 0


def test_automatic_split_is_a_power_of_two(monkeypatch):
    """The split is a constexpr of the kernels: over every batch size a decode loop passes through (1 to 64
    rows on a 132-SM GPU's 264 slots) the automatic choice takes a handful of values, each a power of two,
    so a batch size seen for the first time does not compile the kernels again."""
    from rl_logp.kernels import kept_set as module

    monkeypatch.setattr(module, "_slots", lambda z, cfg: 264)
    cfg = module.KeptSetLaunch()
    splits = {n: module.split_count(torch.empty((n, 151936), device="meta"), cfg) for n in range(1, 129)}
    assert all(s & (s - 1) == 0 for s in splits.values())
    assert set(splits.values()) == {1, 4, 8, 16, 32}
    assert splits[1] == 32 and splits[64] == 4 and splits[65] == 1  # 38 tiles of 4096; past split_rows: fused


def _special_parameters(vocab: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Six rows' top-k and top-p: the special values of `parameters`."""
    k, p = parameters(10, vocab, device, gen)
    return k[4:], p[4:]


# The bound calls' launch plans: fused and split, through Triton's launcher and (GPU, "driver": `direct`)
# through the driver.
LAUNCH_PLANS = [pytest.param({"block": 64, "split_rows": 0}, id="fused"),
                pytest.param({"block": 64, "split": 3}, id="split-3"),
                pytest.param({"block": 64, "split_rows": 0, "driver": True}, id="fused-driver", marks=needs_cuda),
                pytest.param({"block": 64, "split": 3, "driver": True}, id="split-3-driver", marks=needs_cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("launch", LAUNCH_PLANS)
def test_bound_kept_set_gives_the_bits_of_kept_set(device, launch):
    """`bind_kept_set` (what `rollout_calls` keeps for a decode step's top-k / top-p): the call repeated on
    new logits and parameters gives `kept_set`'s mask and thresholds, in both launch plans and modes."""
    from rl_logp.kernels.kept_set import KeptSetLaunch, bind_kept_set, kept_set

    gen = torch.Generator().manual_seed(11)
    direct = launch.get("driver", False)
    cfg = KeptSetLaunch(**{key: value for key, value in launch.items() if key != "driver"})
    for write in (True, False):
        for which in ("k", "p", "kp"):
            first, (k, p) = rows("bf16-rounded", 6, 300, device, gen), _special_parameters(300, device, gen)
            k, p = (k if "k" in which else None), (p if "p" in which else None)
            threshold = torch.empty(6, device=device)
            kept_set(first, k, p, 40, threshold, write=write, launch=cfg)
            bound = bind_kept_set(first, k, p, 40, threshold, write=write, launch=cfg, direct=direct)
            for kind in ("integers (many ties)", "continuous"):
                z, (k2, p2) = rows(kind, 6, 300, device, gen), _special_parameters(300, device, gen)
                k2, p2 = (k2 if k is not None else None), (p2 if p is not None else None)
                got_z, got = z.clone(), torch.full((6,), 7.0, device=device)
                assert bound([t for t in (got_z, k2, p2, got) if t is not None])
                want_z, want = z.clone(), torch.empty(6, device=device)
                kept_set(want_z, k2, p2, 40, want, write=write, launch=cfg)
                assert mismatches(got, want) == 0 and mismatches(got_z, want_z) == 0
                assert write or mismatches(got_z, z) == 0
    assert bind_kept_set(first, None, None, 40, threshold, write=True, launch=cfg) is None


@pytest.mark.parametrize("device", DEVICES)
def test_kept_set_calls_keep_a_plan(device, monkeypatch):
    """The kernel path of `rl_logp.sampling_mask` (CUDA, here called directly): the second call of a
    signature runs its plan, another signature takes the ordinary path, both with `kept_set`'s bits."""
    from rl_logp import rollout_calls, sampling_mask
    from rl_logp.kernels import kept_set as module

    rollout_calls.clear()
    ordinary, kept_set = [], module.kept_set
    monkeypatch.setattr(module, "kept_set", lambda *args, **kwargs: (ordinary.append(1), kept_set(*args, **kwargs)))
    gen = torch.Generator().manual_seed(12)
    try:
        for batch in (4, 4, 2):
            z = rows("continuous", batch + 4, 300, device, gen)[4:]
            k, p = parameters(10, 300, device, gen)
            k, p = k[:batch], p[:batch]
            for write in (True, False):
                got_z = z.clone()
                got = sampling_mask._kernel(got_z, k, p, 40, write=write)
                want_z, want = z.clone(), torch.empty(batch, device=device)
                kept_set(want_z, k, p, 40, want, write=write)
                assert mismatches(got, want) == 0 and mismatches(got_z, want_z) == 0
            noise = torch.empty(batch, 300).exponential_(generator=gen).to(device)
            got = sampling_mask._kernel(z, k, p, 40, write=False, noise=noise)
            want = torch.empty(batch, dtype=torch.int64, device=device)
            kept_set(z, k, p, 40, None, write=False, draw=(noise, want))
            assert got.dtype == torch.int64 and torch.equal(got, want)
        assert len(ordinary) == 6  # the first call of each signature: (4 rows, 2 rows) x (write, not, draw)
        assert len(rollout_calls._plans) == 6
    finally:
        rollout_calls.clear()


def _draw_reference(z: torch.Tensor, noise: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """The kept column with the largest z - log(q), the first on a tie; `log` as the kernel's: numpy's
    under the interpreter, torch's (libdevice's) on CUDA."""
    log_q = torch.from_numpy(np.log(noise.numpy())) if INTERPRET else noise.log()
    return torch.where(z >= threshold.unsqueeze(1), z - log_q, NEG_INF).argmax(dim=-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("launch", [{"block": 64, "split_rows": 0}, {"block": 64, "split": 3}],
                         ids=["fused", "split-3"])
def test_kept_set_draws_the_largest_kept_key(device, launch):
    """The kept set's draw (`draw=(noise, tokens)`, the patched FlashInfer sampler's) in both launch plans:
    the edge rows (part -inf, all -inf, NaN, +inf), rows with top-k / top-p and rows left alone, two tiles
    per range, exact ties (noise of 1 everywhere), k and p each alone and neither; the thresholds and z as
    `kept_set` without a draw gives them, and the same draw without a threshold asked for."""
    from rl_logp.kernels.kept_set import KeptSetLaunch, kept_set

    gen = torch.Generator().manual_seed(13)
    cfg = KeptSetLaunch(**launch)
    vocab = 300  # three ranges of two tiles, the last range shorter
    z = rows("integers (many ties)", 10, vocab, device, gen)
    k_all, p_all = parameters(10, vocab, device, gen)
    random_noise = torch.empty(10, vocab).exponential_(generator=gen).to(device)
    ties = torch.ones(10, vocab, device=device)
    for k, p, noises in ((k_all, p_all, (random_noise, ties)), (k_all, None, (random_noise,)),
                         (None, p_all, (random_noise,)), (None, None, (ties,))):
        threshold = reference_thresholds(z, k, p, 40, 2**28)
        want_threshold = torch.empty(10, device=device)
        kept_set(z.clone(), k, p, 40, want_threshold, write=False, launch=cfg)
        for noise in noises:
            got, got_threshold, got_z = (torch.full((10,), -1, dtype=torch.int64, device=device),
                                         torch.full((10,), 7.0, device=device), z.clone())
            kept_set(got_z, k, p, 40, got_threshold, write=False, draw=(noise, got), launch=cfg)
            assert torch.equal(got, _draw_reference(z, noise, threshold))
            assert (z.gather(1, got.unsqueeze(1)).squeeze(1)[4:] >= threshold[4:]).all()  # drawn from the kept set
            assert mismatches(got_threshold, want_threshold) == 0 and mismatches(got_z, z) == 0
    tokens = torch.full((10,), -1, dtype=torch.int64, device=device)
    kept_set(z.clone(), k_all, p_all, 40, None, write=False, draw=(random_noise, tokens), launch=cfg)
    assert torch.equal(tokens, _draw_reference(z, random_noise, reference_thresholds(z, k_all, p_all, 40, 2**28)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("launch", LAUNCH_PLANS)
def test_bound_kept_set_draws_as_kept_set(device, launch):
    """`bind_kept_set` with a draw (the plan of the patched FlashInfer sampler's call) draws on new logits,
    parameters and noise what `kept_set` draws."""
    from rl_logp.kernels.kept_set import KeptSetLaunch, bind_kept_set, kept_set

    gen = torch.Generator().manual_seed(14)
    direct = launch.get("driver", False)
    cfg = KeptSetLaunch(**{key: value for key, value in launch.items() if key != "driver"})
    first, (k, p) = rows("continuous", 6, 300, device, gen), _special_parameters(300, device, gen)
    noise = torch.empty(6, 300).exponential_(generator=gen).to(device)
    tokens = torch.empty(6, dtype=torch.int64, device=device)
    kept_set(first, k, p, 40, None, write=False, draw=(noise, tokens), launch=cfg)
    bound = bind_kept_set(first, k, p, 40, None, write=False, draw=(noise, tokens), launch=cfg, direct=direct)
    for kind in ("integers (many ties)", "bf16-rounded"):
        z, (k2, p2) = rows(kind, 6, 300, device, gen), _special_parameters(300, device, gen)
        noise2 = torch.empty(6, 300).exponential_(generator=gen).to(device)
        got = torch.full((6,), -1, dtype=torch.int64, device=device)
        assert bound([z, k2, p2, noise2, got])
        want = torch.empty(6, dtype=torch.int64, device=device)
        kept_set(z, k2, p2, 40, None, write=False, draw=(noise2, want), launch=cfg)
        assert torch.equal(got, want)


@needs_cuda
@pytest.mark.parametrize("batch", [1, 8, 256])
def test_cuda_sample_kept_is_the_torch_draw(batch):
    """`sample_kept` on CUDA (the kept-set kernel drawing in its last pass) draws what its torch form draws
    on the same noise, at rollout size."""
    from rl_logp.sampling_mask import sample_kept

    z = model_like_logits(batch, 151936, torch.bfloat16, "cuda", seed=batch).float() / 0.7
    gen = torch.Generator(device="cuda").manual_seed(batch)
    k = torch.full((batch,), 50, dtype=torch.int32, device="cuda")
    p = torch.full((batch,), 0.9, device="cuda")
    noise = torch.empty_like(z).exponential_(generator=gen)
    before = z.clone()
    got = sample_kept(z, k, p, noise, LogpConfig())
    assert torch.equal(z, before)
    threshold = reference_thresholds(z, k, p, 40, 2**28)
    assert torch.equal(got, _draw_reference(z, noise, threshold))
