"""The fused Triton kernels: equality with the chunked path and between their own launch variants, edge
rows, 64-bit offsets, workspace, host syncs, CUDA graphs. GPU tests skip on CPU; the logic tests also
run under TRITON_INTERPRET=1 on the CPU (where the interpreter's numpy exp is not torch's, so CPU twins
compare the kernel's variants with each other, and with chunked only within a few ulps)."""

import dataclasses
import functools

import pytest
import torch
from helpers import (
    HAS_CUDA,
    INTERPRET,
    PAIR_MISSING_T,
    engine_request,
    logp_and_grad,
    make_engine,
    mismatches,
    model_like_logits,
    needs_cuda,
    pair_misses,
    random_labels,
)

from rl_logp import entropy, full_logprobs, logprobs, logprobs_and_entropy, resolve_backend
from rl_logp.engines import RowStats
from rl_logp.temperature import Temperature

try:
    import triton
    import triton.language as tl

    from rl_logp.kernels import fixed_point
except ImportError:  # no Triton: the fused kernels' tests skip, the chunked ones run
    triton = None

FUSED_DEVICES = [
    pytest.param("cpu", id="interpret-cpu", marks=pytest.mark.skipif(not INTERPRET, reason="TRITON_INTERPRET is off")),
    pytest.param("cuda", id="cuda", marks=needs_cuda),
]


@pytest.fixture(autouse=True)
def triton_forward(monkeypatch):
    """These are the Triton kernels' tests: every fused engine (the public functions' too) with the cluster
    forward off (`LaunchConfig.cluster_rows` 0), which eager calls of a GPU with clusters would otherwise
    take at any size where it applies; `test_cluster_forward.py` holds it to these kernels' bits."""
    if triton is None:
        yield
        return
    from rl_logp import rollout_calls
    from rl_logp.engines import make_engine
    from rl_logp.engines.fused import TUNING_VARIABLE

    monkeypatch.setenv(TUNING_VARIABLE, '{"cluster_rows": 0}')
    make_engine.cache_clear()
    rollout_calls.clear()
    yield
    make_engine.cache_clear()
    rollout_calls.clear()


def _kernels():
    """The fused engine's class, its launch configuration with the cluster forward off, the fixed point."""
    from rl_logp.engines import fused
    from rl_logp.kernels import fixed_point, launch

    return fused.FusedEngine, functools.partial(launch.LaunchConfig, cluster_rows=0), fixed_point


def _all_stats(engine, x, temp, labels, bits=40):
    s = engine.row_stats(engine_request(x, labels, temp, engine="fused", entropy=True, bits=bits))
    return [s.row_max, s.log_sum, s.lse, s.logp, s.entropy]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("vocab", [1, 255, 1031, 151936, 262144])
@pytest.mark.parametrize("temperature", [None, 0.7, "rows"])
def test_fused_equals_chunked_bitwise_on_gpu(dtype, vocab, temperature):
    n = 33
    logits = model_like_logits(n, vocab, dtype, "cuda", seed=vocab)
    labels = random_labels(n, vocab, "cuda", seed=vocab)
    labels[3] = -100
    if temperature == "rows":
        temperature = torch.linspace(0.3, 1.7, n, device="cuda")
    for fn in (logp_and_grad, _logp_entropy_and_grad):
        fused = fn(logits, labels, backend="fused", temperature=temperature)
        chunked = fn(logits, labels, backend="chunked", temperature=temperature)
        for a, b in zip(fused, chunked, strict=True):
            assert mismatches(a, b) == 0


def _logp_entropy_and_grad(logits, labels, **kwargs):
    x = logits.detach().clone().requires_grad_(True)
    logp, h = logprobs_and_entropy(x, labels, **kwargs)
    (logp.sum() + h.sum()).backward()
    return logp.detach(), h.detach(), x.grad


@needs_cuda
def test_exp_and_log_match_torch_cuda_including_subnormal_results():
    # Rows whose non-max logits sit 87..104 below the max: exp(z - M) and p are subnormal in fp32.
    n, vocab = 8, 4096
    logits = torch.linspace(-104, 0, vocab, device="cuda").repeat(n, 1)
    logits[:, 0] = 0.0
    logits += torch.arange(n, device="cuda").unsqueeze(1) * 0.37
    labels = torch.arange(n, device="cuda") * 311
    fused = _logp_entropy_and_grad(logits, labels, backend="fused")
    chunked = _logp_entropy_and_grad(logits, labels, backend="chunked")
    for a, b in zip(fused, chunked, strict=True):
        assert mismatches(a, b) == 0


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_launch_variants_give_the_same_bits(device):
    engine, config, fp = _kernels()
    vocab = 151936 if device == "cuda" else 1531
    x = model_like_logits(7, vocab, torch.bfloat16, device, seed=2)
    x[0] = 0.0  # every term is exactly 1: the integer sums at their largest
    x[1, 100:] = float("-inf")
    labels = random_labels(7, vocab, device)
    base = config()
    small = 256 if device == "cpu" else 2048
    variants = [
        dataclasses.replace(base, split_eager=True),  # the split plan, automatic (the interpreter: whole rows)
        dataclasses.replace(base, chunk=small, split=4, split_eager=True),  # ranges of two tiles, the last shorter
        dataclasses.replace(base, chunk=small, lane=2, split=3, split_eager=True, quant=fp.QUANT_CAST.value),
        dataclasses.replace(base, quant=fp.QUANT_CAST.value),
        dataclasses.replace(base, chunk=small, lane=8),
        dataclasses.replace(base, chunk=2 * small, lane=2),
        dataclasses.replace(base, two_pass=True),
        dataclasses.replace(base, programs_per_sm=0),
        dataclasses.replace(base, programs_per_sm=1, warps=4),
    ]
    variants.append(dataclasses.replace(base, div=fp.DIV_IEEE.value))
    variants.append(dataclasses.replace(base, div=fp.DIV_RECIPROCAL.value))
    for temp in (Temperature(), Temperature(scalar=0.7), Temperature(rows=torch.linspace(0.5, 1.5, 7, device=device))):
        ref = _all_stats(engine(base), x, temp, labels)
        for cfg in variants:
            got = _all_stats(engine(cfg), x, temp, labels)
            for a, b in zip(got, ref, strict=True):
                assert mismatches(a, b) == 0, cfg



@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_backward_tiles_give_the_same_bits(device):
    """The backward's lean tiles (full, live, label elsewhere, reciprocal or no temperature) and its general
    sub-tiles (the row's last tile, the label's, ignored and dead rows, div_rn rows) give the same bits:
    every tiling against whole rows (the CPU: one general tile per row) or against each other (the GPU)."""
    engine, config, fp = _kernels()
    vocab = 151936 if device == "cuda" else 1531
    n = 9
    x = model_like_logits(n, vocab, torch.bfloat16, device, seed=3)
    x[0] = 0.0  # M = 0 is outside the reciprocal's range: div_rn
    x[1] = float("-inf")  # a dead row
    x[2, 7:] = float("-inf")
    labels = random_labels(n, vocab, device, seed=3)
    labels[3], labels[4], labels[5], labels[6], labels[7] = -100, vocab + 3, 256, 255, vocab - 1
    g_lp, g_h = torch.linspace(-1.5, 2.0, n, device=device), torch.linspace(0.5, -1.0, n, device=device)
    base = config()
    tilings = [(base.grad_block, base.grad_warps), (256, 4), (256, 1), (128, 1)]
    if device == "cuda":
        tilings = [(base.grad_block, base.grad_warps), (2048, 4), (8192, 8), (512, 1)]
    for div in (fp.DIV_IEEE.value, fp.DIV_RECIPROCAL.value):
        for temp in (None, 0.7, torch.linspace(0.5, 1.5, n, device=device)):
            for parts in ((g_lp, None), (None, g_h), (g_lp, g_h)):
                grads = []
                for block, warps in tilings:
                    fused = engine(dataclasses.replace(base, div=div, grad_block=block, grad_warps=warps))
                    req = engine_request(x, labels, temp, engine="fused", entropy=True)
                    out = torch.empty_like(x)
                    fused.grad(req, fused.row_stats(req), *parts, out)
                    grads.append(out)
                for got, tiling in zip(grads[1:], tilings[1:], strict=True):
                    assert mismatches(got, grads[0]) == 0, (div, temp, tiling)
                assert grads[0][1].abs().sum() == 0 and grads[0][3 if parts[1] is None else 1].abs().sum() == 0


def _split_and_whole(x, labels, temp, config, **split):
    """Every output of the split plan (`split` overriding the launch config) and of whole rows, for a
    request with the entropy, the normaliser and every column's logprob."""
    engine = _kernels()[0]
    got = []
    for cfg in (dataclasses.replace(config, split_eager=True, **split), dataclasses.replace(config, split_rows=0)):
        req = engine_request(x, labels, temp, engine="fused", entropy=True)
        req.normalizer, req.full = True, True
        s = engine(cfg).row_stats(req)
        got.append([s.row_max, s.log_sum, s.lse, s.logp, s.entropy, s.full])
    return got


@pytest.mark.skipif(not INTERPRET, reason="checks the kernels under Triton's interpreter (TRITON_INTERPRET=1)")
def test_split_plan_in_any_arrival_order(shuffled_programs):
    """The split plan (a row's column ranges on programs of their own, the last to arrive finishing the
    row) with the programs of each launch run in shuffled orders: the bits of whole rows for every output
    (M, L, lse, logp of K labels a row, entropy, every column's logprob), on rows with a NaN, all -inf,
    a bad temperature, all zeros (the integer sums at their largest), on split 3 (not a power of two, the
    last range shorter)."""
    from rl_logp.kernels.launch import LaunchConfig, split_ranges

    vocab, n = 1400, 5
    x = model_like_logits(n, vocab, torch.bfloat16, "cpu", seed=4)
    x[0] = 0.0
    x[1, 9] = float("nan")
    x[2] = float("-inf")
    labels = torch.randint(0, vocab, (n, 3), generator=torch.Generator().manual_seed(1))
    labels[0, 1], labels[4, 2] = -100, vocab
    rows_t = torch.tensor([0.7, 1.0, 0.5, -1.0, 1.3])
    cfg = LaunchConfig(chunk=256, lane=4)
    assert split_ranges(n, vocab, None, dataclasses.replace(cfg, split=3)) == (3, 512)
    for temp in (Temperature(), Temperature(scalar=0.7), Temperature(rows=rows_t)):
        split, whole = _split_and_whole(x, labels, temp, cfg, split=3)
        assert sum(mismatches(a, b) for a, b in zip(split, whole, strict=True)) == 0
        assert torch.isnan(split[3][1]).all() and torch.isnan(split[3][3]).all() == (temp.rows is not None)
    split_orders = [order for order in shuffled_programs if len(order) == n * 3]
    assert len(split_orders) == 3 * 3  # three launches (with full logprobs) for each temperature
    last = {max((order.index(row * 3 + r), r) for r in range(3))[1] for order in split_orders[1::3]
            for row in range(n)}
    assert last == {0, 1, 2}  # each range was the last of its row to finish the sums in some launch


def test_split_ranges_cover_every_row_in_non_empty_ranges():
    """The launcher's split: whole rows above `split_rows`, for two-pass and for a row of one tile; else
    ranges a multiple of the chunk wide, each non-empty, covering the row; the automatic split a power of
    two before it is cut to the row's tiles (a kernel constexpr: few compiled variants)."""
    pytest.importorskip("triton")
    from rl_logp.kernels.launch import LaunchConfig, split_ranges

    cfg = LaunchConfig(chunk=4096, split_rows=64, split_per_sm=2)
    assert split_ranges(65, 151936, None, cfg) == (1, 151936)
    assert split_ranges(0, 151936, None, cfg) == (1, 151936)
    assert split_ranges(8, 4096, None, cfg) == (1, 4096)
    assert split_ranges(8, 151936, None, dataclasses.replace(cfg, two_pass=True)) == (1, 151936)
    assert split_ranges(8, 151936, None, dataclasses.replace(cfg, split_rows=0)) == (1, 151936)
    for n in range(1, 65):
        for vocab in (4097, 50257, 151936, 262144):
            for split in (0, 3, 1000):
                ranges, span = split_ranges(n, vocab, None, dataclasses.replace(cfg, split=split))
                if ranges == 1:
                    assert span == vocab and split == 0 and n >= 4  # the interpreter's 4 slots are not filled
                else:
                    assert span % 4096 == 0 and (ranges - 1) * span < vocab <= ranges * span
                if split == 0:
                    assert ranges == min(1 << (triton.cdiv(4, n).bit_length() - 1), triton.cdiv(vocab, 4096))


@pytest.mark.skipif(not INTERPRET, reason="checks the kernels under Triton's interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("temperature", [None, 0.7, "rows"])
def test_interpreter_sums_are_the_contract_with_numpys_exp(temperature):
    """Under the interpreter the kernels' exp is numpy's, which differs from torch's CPU exp on many
    arguments, so fused and chunked on the CPU are different exp families (their entropies can differ
    in the last bit). What is checked instead: the kernel's S and E are exactly the contract's sums with
    numpy's float32 exp, computed here independently."""
    import numpy as np

    engine, config, _ = _kernels()
    n, vocab = 9, 3001
    x = model_like_logits(n, vocab, torch.bfloat16, "cpu", seed=5)
    if temperature == "rows":
        temperature = torch.linspace(0.4, 1.6, n)
    req = engine_request(x, None, temperature, engine="fused", entropy=True)
    fused = engine(config())
    row_max = fused.shard_max(req)
    s, e = fused.shard_sums(req, row_max)
    z = x.float()
    if temperature is not None:
        z = z / (temperature.unsqueeze(1) if isinstance(temperature, torch.Tensor) else torch.tensor(temperature))
    d = (z - row_max.unsqueeze(1)).numpy()
    terms = np.exp(d).astype(np.float32)
    scale = np.float32(2.0**40)
    want_s = np.trunc(terms * scale).astype(np.int64).sum(axis=1)
    want_e = np.trunc((terms * d).astype(np.float32) * scale).astype(np.int64).sum(axis=1)
    assert torch.equal(row_max, z.amax(dim=1))
    assert s.tolist() == want_s.tolist() and e.tolist() == want_e.tolist()
    # ... and torch's CPU exp is another family: the chunked engine's sums differ in their last bits.
    chunked_s, _ = make_engine("chunked").shard_sums(engine_request(x, None, temperature, entropy=True), row_max)
    assert not torch.equal(chunked_s, s)


RECIPROCAL_TEMPERATURES = [0.7, 0.6, 1.3, 0.999, 7.0, 3.0, 0.1, 2.0**-10, 1e20, 1.0, 0.5, 2.0]


def _all_bit_patterns(dtype, device):
    return torch.arange(-(2**15), 2**15, dtype=torch.int32, device=device).to(torch.int16).view(dtype)


def _temperatures(device):
    gen = torch.Generator(device="cpu").manual_seed(4)
    extra = 8 if device == "cpu" else 40
    return RECIPROCAL_TEMPERATURES + torch.exp(torch.empty(extra).uniform_(-6.9, 20, generator=gen)).tolist()


def _ieee_quotient(values, t):
    return values.float() / torch.tensor(t, dtype=torch.float32, device=values.device)


def _differing(got, want, values):
    """Where the bits differ (NaN == NaN), bf16 subnormal inputs left out under the interpreter (its
    bf16-to-fp32 conversion gets them wrong: 1.0e-39 becomes 4.4e-39)."""
    differ = (got.view(torch.int32) != want.view(torch.int32)) & ~(got.isnan() & want.isnan())
    if values.device.type == "cpu" and values.dtype == torch.bfloat16:
        differ &= ~((values != 0) & (values.float().abs() < torch.finfo(torch.float32).tiny))
    return differ


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reciprocal_pair_is_the_ieee_quotient_of_every_16bit_value(device, dtype):
    """`row_divisor`'s pair gives every bf16 / fp16 value's IEEE quotient (+-inf, NaN, +-0 and overflow
    to inf included) for each T here, all of which it accepts (exact reciprocals too); the only
    differences allowed are quotients both below 2^-85, under a quarter ulp of any row max the pair
    serves (|M| >= 2^-60)."""
    values = _all_bit_patterns(dtype, device)
    for t in _temperatures(device):
        got, _, inv_lo = _reciprocal_quotients(values, t, pair=True)
        want = _ieee_quotient(values, t)
        assert inv_lo > 0, t
        assert not (_differing(got, want, values) & ((got.abs() >= 2.0**-85) | (want.abs() >= 2.0**-85))).any(), t


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_reciprocal_pair_refuses_what_it_cannot_check(device):
    values = _all_bit_patterns(torch.bfloat16, device)
    for t in (2.0**-11, 2.0**90, float("inf"), 0.0, -0.7, float("nan")):  # row_reciprocal's range, or hi < 2^-80
        got, _, inv_lo = _reciprocal_quotients(values, t, pair=True)
        assert inv_lo == 0, t
        assert not _differing(got, _ieee_quotient(values, t), values).any(), t  # div_rn
    for row_max in (1e-20, 1e31, float("nan"), float("inf"), float("-inf")):  # |M| outside [2^-60, 2^100]
        assert _reciprocal_quotients(values, 0.7, pair=True, row_max=row_max)[2] == 0, row_max


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_reciprocal_pair_refuses_a_temperature_whose_quotients_it_misses(device):
    """At a T where fma(x, hi, x lo) misses the IEEE x / T on one fp16 significand of 1024 (`pair_misses`,
    exact arithmetic), `row_divisor` refuses the pair and every fp16 value gets the IEEE quotient."""
    assert pair_misses(PAIR_MISSING_T, 10) == [349]
    values = _all_bit_patterns(torch.float16, device)
    got, _, inv_lo = _reciprocal_quotients(values, PAIR_MISSING_T, pair=True)
    assert inv_lo == 0
    assert not _differing(got, _ieee_quotient(values, PAIR_MISSING_T), values).any()


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_reciprocal_division_is_the_ieee_quotient_where_it_is_used(device, dtype):
    """Markstein's correction (fp32 logits, and the backward) gives the IEEE quotient for every bf16
    value and random fp32 patterns with 2^-100 <= |x| <= 2^100, and -inf, T in [2^-10, 2^100]; tiny or
    huge logits are covered by the row rule (a row on this path has 2^-60 <= |M| <= 2^100, so no +inf
    or NaN: test_reciprocal_division_keeps_output_bits_on_adversarial_rows)."""
    if dtype == torch.bfloat16:
        values = _all_bit_patterns(dtype, device)
    else:
        gen = torch.Generator(device="cpu").manual_seed(6)
        count = 1 << (16 if device == "cpu" else 22)
        values = torch.randint(-(2**31), 2**31 - 1, (count,), dtype=torch.int32, generator=gen).view(dtype).to(device)
    mag = values.float().abs()
    used = ((mag >= 2.0**-100) & (mag <= 2.0**100)) | (values.float() == float("-inf"))
    assert used.float().mean() > 0.75
    for t in _temperatures(device):
        got, _, _ = _reciprocal_quotients(values, t, pair=False)
        assert not (_differing(got, _ieee_quotient(values, t), values) & used).any(), t


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_cluster_forwards_division_set_up_on_the_host_is_the_kernels(device, dtype):
    """`division_setup.division` (what T alone decides, worked out on the host for the cluster forward)
    decides as the Triton kernels' `row_divisor` and `row_reciprocal` do in a row whose max they accept:
    their pair (hi, lo) where they keep it, their 1/T where they keep the reciprocal alone, neither where
    they refuse T; at temperatures they accept, at the ends of their range and past them, at two whose
    fp16 quotients the pair misses and at two whose lo is below hi 2^-40."""
    from rl_logp.kernels import cluster_launch, division_setup

    values = torch.ones(8, dtype=dtype, device=device)
    temperatures = [*_temperatures(device), 2.0**-10, 2.0**100, 2.0**-11, 2.0**90, 2.0**101, float("inf"), 0.0, -0.7,
                    float("nan"), PAIR_MISSING_T, 0.17463384568691254, 0.7042195796966553, 0.6324090361595154]
    kinds = set()
    for t in temperatures:
        hi, lo, flags = division_setup.division(t, cluster_launch.MANTISSA_BITS[dtype])
        _, pair_hi, pair_lo = _reciprocal_quotients(values, t, pair=True)
        _, recip, _ = _reciprocal_quotients(values, t, pair=False)
        if flags & division_setup.PAIR:
            assert (hi, lo) == (pair_hi, pair_lo) and pair_lo > 0, t
        else:
            assert pair_lo == 0 and (hi, lo) == (recip, 0.0), t
        assert bool(flags & division_setup.T_IN_RANGE) == (recip > 0), t
        kinds.add(flags)
    assert kinds == ({0, division_setup.T_IN_RANGE} if dtype == torch.float32 else
                     {0, division_setup.T_IN_RANGE, division_setup.T_IN_RANGE | division_setup.PAIR}), kinds


def _reciprocal_quotients(values, t, pair, row_max=1.0):
    """(z, inv_t, inv_lo) of 1-D `values` divided by T through `scale_logits` in a row whose max is
    `row_max`: with `row_divisor`'s pair (`pair`), else `row_reciprocal`'s 1/T (Markstein's correction)."""
    block = 8192
    grid = triton.cdiv(values.numel(), block)
    out = torch.empty(values.shape, dtype=torch.float32, device=values.device)
    hi = torch.empty(grid, dtype=torch.float32, device=values.device)
    lo = torch.empty(grid, dtype=torch.float32, device=values.device)
    _divide[(grid,)](values, out, hi, lo, t, row_max, values.numel(), PAIR=pair, BLOCK=block)
    return out, float(hi[0]), float(lo[0])


if triton is not None:

    @triton.jit
    def _divide(X, Z, HI, LO, t, row_max, n, PAIR: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n)
        if PAIR:
            inv_t, inv_lo = fixed_point.row_divisor(t, row_max, fixed_point.TEMP_SCALAR, fixed_point.DIV_RECIPROCAL,
                                                    X.dtype.element_ty.fp_mantissa_width)
        else:
            inv_t = fixed_point.row_reciprocal(t, row_max, fixed_point.TEMP_SCALAR, fixed_point.DIV_RECIPROCAL)
            inv_lo = tl.full([], 0.0, tl.float32)
        z = fixed_point.scale_logits(x, t, inv_t, fixed_point.TEMP_SCALAR, fixed_point.DIV_RECIPROCAL, inv_lo, PAIR)
        tl.store(Z + offs, z, mask=offs < n)
        tl.store(HI + tl.program_id(0), inv_t)
        tl.store(LO + tl.program_id(0), inv_lo)


def _adversarial_rows(dtype, device):
    n, vocab = 14, 1031
    x = model_like_logits(n, vocab, torch.float32, "cpu", seed=3)
    gen = torch.Generator().manual_seed(1)
    x[0, ::7] = torch.finfo(torch.float32).tiny * torch.rand(148, generator=gen)  # subnormal beside normal logits
    x[1] = -x[1].abs() * 1e-25  # a row whose max is tiny: divides by div_rn
    x[2, 5] = 0.0
    x[2, 6] = -0.0
    x[3, ::3] = -3.0e38  # finfo.min-style masking: quotients overflow to -inf at T < 1
    x[4, 9] = 1e38  # a huge logit: divides by div_rn
    x[5, :] = -0.0
    x[5, 17] = 1e-30
    x[6] = x[6] * 1e-37  # every logit tiny
    x[7, 600:] = float("-inf")  # a masked tail
    x[8] = float("-inf")  # a fully masked row
    x[9, 11] = float("nan")
    x[10, 12] = float("inf")
    x[11, 1::2] = torch.linspace(-3.39e38, -2.3e38, 515)  # quotients near the fp32 limit
    x[12, 1::2] = torch.linspace(-1e-38, 1e-38, 515)  # tiny and subnormal quotients under a max of about 1
    x[12, 0] = 1.0
    x[13] = 0.0  # M = 0: divides by div_rn
    return x.to(dtype).to(device)


@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_reciprocal_division_keeps_output_bits_on_adversarial_rows(device, dtype):
    """Every output of the reciprocal path (the pair for 16-bit logits, Markstein's for fp32) has the
    bits of div_rn's: M, L, lse, logp, entropy, the sums S and E given a max, every column's logprob
    and the gradient, on rows with subnormal, tiny, huge, masked, NaN and inf logits, at temperatures
    that are inexact, exact (powers of two), out of the reciprocal's range, or bad (0, < 0, inf, NaN)."""
    engine, config, fp = _kernels()
    x = _adversarial_rows(dtype, device)
    n, vocab = x.shape
    labels = random_labels(n, vocab, device)
    ieee = engine(config(div=fp.DIV_IEEE.value))
    reciprocal = engine(config(div=fp.DIV_RECIPROCAL.value))
    rows = torch.tensor([0.7, 1.0, 2.0, 0.0, -1.0, float("inf"), float("nan"), 2.0**-11, 2.0**90, 0.01, 40.0, 1.3,
                         0.999, 0.25], device=device)
    temps = [Temperature(scalar=s) for s in (0.7, 2.0**-10, 0.5, 3.0, 1e20)] + [Temperature(rows=rows)]
    g = torch.linspace(-1, 1, n, device=device)
    for temp in temps:
        a, b = _all_stats(ieee, x, temp, labels), _all_stats(reciprocal, x, temp, labels)
        for u, v in zip(a, b, strict=True):
            assert mismatches(u, v) == 0, temp
        req = engine_request(x, labels, temp, engine="fused", entropy=True)
        for u, v in zip(ieee.shard_sums(req, a[0]), reciprocal.shard_sums(req, a[0]), strict=True):
            assert torch.equal(u, v), temp
        full = dataclasses.replace(req, full=True)
        assert mismatches(ieee.row_stats(full).full, reciprocal.row_stats(full).full) == 0, temp
        grads = []
        for variant in (ieee, reciprocal):
            out = torch.empty_like(x)
            variant.grad(req, RowStats(row_max=a[0], log_sum=a[1], entropy=a[4]), g, g, out)
            grads.append(out)
        assert mismatches(grads[0], grads[1]) == 0, temp


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_ignored_and_out_of_range_rows_give_zero_and_zero_grad(device):
    vocab = 300
    logits = model_like_logits(6, vocab, torch.bfloat16, device)
    labels = torch.tensor([-100, -1, vocab, vocab + 7, 5, 2**40], device=device)
    logp, grad = logp_and_grad(logits, labels, backend="fused")
    assert torch.equal(logp[[0, 1, 2, 3, 5]], torch.zeros(5, device=device))
    assert mismatches(grad[[0, 1, 2, 3, 5]], torch.zeros_like(grad[[0, 1, 2, 3, 5]])) == 0
    assert logp[4] < 0 and grad[4].abs().sum() > 0


@pytest.mark.parametrize("backend", ["chunked", pytest.param("fused", marks=pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="the fused kernel cannot run here"))])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_strided_label_columns_give_the_bits_of_contiguous_labels(backend, dtype):
    """A label column of a wider id matrix (vLLM's `ids[:, 0]` with top-n logprobs) is a strided view."""
    device = "cuda" if backend == "fused" and HAS_CUDA else "cpu"
    logits = model_like_logits(6, 1031, torch.bfloat16, device, seed=8)
    ids = torch.randint(0, 1031, (6, 21), device=device).to(dtype)
    column = ids[:, 0]
    assert not column.is_contiguous()
    for temperature in (None, 0.7):
        strided = logp_and_grad(logits, column, backend=backend, temperature=temperature)
        dense = logp_and_grad(logits, column.contiguous(), backend=backend, temperature=temperature)
        for a, b in zip(strided, dense, strict=True):
            assert mismatches(a, b) == 0


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_masked_tails_and_fully_masked_rows(device):
    vocab = 500
    logits = model_like_logits(3, vocab, torch.float32, device)
    logits[0, 400:] = float("-inf")
    logits[1, :] = float("-inf")
    labels = torch.tensor([3, 3, 3], device=device)
    logp, h, grad = _logp_entropy_and_grad(logits, labels, backend="fused")
    assert torch.isfinite(logp).all() and torch.isfinite(grad).all()
    assert logp[1] == 0 and h[1] == 0 and grad[1].abs().sum() == 0
    assert (grad[0, 400:] == 0).all()


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


def _allocated_block(like: torch.Tensor) -> int:
    """The bytes the caching allocator counts for a new tensor like `like` now: its size as the allocator
    rounds it (a large block is not split where 1 MiB or less would be left), the block the next such
    allocation (the gradient) gets."""
    base = torch.cuda.memory_allocated()
    probe = torch.empty_like(like)
    size = torch.cuda.memory_allocated() - base
    del probe
    return size


@needs_cuda
def test_forward_allocates_only_outputs_and_backward_only_the_gradient():
    """The forward allocates per-row outputs, the backward the gradient's block and per-row tensors (the
    unused outputs' zero gradients among them): 256 bytes a row of slack beside the gradient."""
    n, vocab = 4096, 151936
    x = torch.randn(n, vocab, device="cuda").to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    leaf = x.clone().requires_grad_(True)
    logprobs(leaf * 1.0, labels, backend="fused", temperature=0.7).sum().backward()  # compile outside the measurement
    for temperature in (None, 0.7, torch.full((n,), 0.7, device="cuda")):
        y = (leaf * 1.0).detach().requires_grad_(True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = logprobs(y, labels, backend="fused", temperature=temperature)
        # the outputs and per-row statistics (no workspace): nothing per logit
        assert torch.cuda.max_memory_allocated() - base <= 64 * n
        gradient = _allocated_block(y)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out.sum().backward()
        assert torch.cuda.max_memory_allocated() - base <= gradient + 256 * n
    nonleaf = leaf * 1.0
    out = logprobs(nonleaf, labels, backend="fused", inplace_backward=True, temperature=0.7)
    torch.cuda.synchronize()
    gradient = _allocated_block(leaf)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.sum().backward()
    assert torch.cuda.max_memory_allocated() - base <= gradient + 256 * n  # the gradient `leaf * 1.0` passes to leaf.grad
    leaf.grad = None


@needs_cuda
def test_no_host_sync_on_the_hot_path():
    n, vocab = 64, 151936
    x = model_like_logits(n, vocab, torch.bfloat16, "cuda").requires_grad_(True)
    labels = random_labels(n, vocab, "cuda")
    temp = torch.full((n,), 0.7, device="cuda")
    logprobs(x, labels, temperature=temp).sum().backward()  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            logprobs(x, labels, temperature=temp)
            logprobs(x, labels, temperature=0.7)
            entropy(x, temperature=temp)
        lp, h = logprobs_and_entropy(x, labels, temperature=temp)
        (lp.sum() + h.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@needs_cuda
@pytest.mark.parametrize("n", [8, 256], ids=["split-plan", "whole-rows"])
def test_cuda_graph_capture_replays_the_same_bits(n):
    """Captured, 8 rows run the split plan (256: whole rows), and replayed they give eager's bits (whole
    rows)."""
    vocab = 151936
    x = model_like_logits(n, vocab, torch.bfloat16, "cuda")
    labels = random_labels(n, vocab, "cuda")
    temp = torch.full((n,), 0.7, device="cuda")

    def calls():
        return logprobs(x, labels, temperature=temp), full_logprobs(x, temperature=temp)

    with torch.no_grad():
        eager = calls()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            calls()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = calls()
        x.copy_(model_like_logits(n, vocab, torch.bfloat16, "cuda", seed=9))
        graph.replay()
        torch.cuda.synchronize()
        for got, want, before in zip(captured, calls(), eager, strict=True):
            assert mismatches(got, want) == 0
            assert mismatches(got, before) > 0  # the replay read the new logits


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_inplace_backward_gives_the_same_gradient(device):
    vocab = 1031 if device == "cpu" else 151936
    logits = model_like_logits(7, vocab, torch.bfloat16, device)
    labels = random_labels(7, vocab, device)
    expected = logp_and_grad(logits, labels, backend="fused", temperature=0.7)[1]
    leaf = logits.clone().requires_grad_(True)
    scaled = leaf * 1.0  # a non-leaf the gradient can overwrite
    logprobs(scaled, labels, backend="fused", inplace_backward=True, temperature=0.7).sum().backward()
    assert mismatches(leaf.grad, expected) == 0


@pytest.mark.parametrize("backend", ["chunked", pytest.param("fused", marks=pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="the fused kernel cannot run here"))])
def test_inplace_backward_hands_its_buffer_to_the_leaf(backend):
    """The gradient written over a non-leaf copy of a leaf becomes the leaf's .grad without a copy (the
    caller still holds the copy): no logits-sized buffer in forward + backward."""
    device = "cuda" if backend == "fused" and HAS_CUDA else "cpu"
    leaf = model_like_logits(5, 1031, torch.float32, device).requires_grad_(True)
    x = leaf.clone()
    logprobs(x, random_labels(5, 1031, device), backend=backend, inplace_backward=True).sum().backward()
    assert leaf.grad.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("backend", ["chunked", pytest.param("fused", marks=pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="the fused kernel cannot run here"))])
def test_inplace_backward_never_overwrites_a_leaf(backend):
    device = "cuda" if backend == "fused" and HAS_CUDA else "cpu"
    w = model_like_logits(5, 257, torch.float32, device).requires_grad_(True)
    before = w.detach().clone()
    labels = random_labels(5, 257, device)
    logprobs(w, labels, backend=backend, inplace_backward=True).sum().backward()
    assert mismatches(w.detach(), before) == 0
    assert w.grad.data_ptr() != w.data_ptr()
    assert mismatches(w.grad, logp_and_grad(before, labels, backend=backend)[1]) == 0


VIEWS_OF_A_LEAF = {
    "squeeze": lambda w: w.unsqueeze(0).squeeze(0) if w.dim() == 2 else w.squeeze(0),
    "view": lambda w: w.view(w.shape[0], w.shape[1]),
    "slice": lambda w: w[1:],
    "as_strided": lambda w: w.as_strided((w.shape[0] - 1, w.shape[1]), (w.shape[1], 1), w.shape[1]),
}


@pytest.mark.parametrize("backend", ["chunked", pytest.param("fused", marks=pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="the fused kernel cannot run here"))])
@pytest.mark.parametrize("make_view", VIEWS_OF_A_LEAF.values(), ids=VIEWS_OF_A_LEAF.keys())
def test_inplace_backward_never_overwrites_a_view_of_a_leaf(backend, make_view):
    device = "cuda" if backend == "fused" and HAS_CUDA else "cpu"
    w = model_like_logits(6, 257, torch.float32, device).unsqueeze(0).requires_grad_(True)
    before = w.detach().clone()
    view = make_view(w if make_view is VIEWS_OF_A_LEAF["squeeze"] else w[0])
    labels = random_labels(view.shape[0], 257, device)
    logprobs(view, labels, backend=backend, inplace_backward=True).sum().backward()
    assert mismatches(w.detach(), before) == 0
    expected = torch.zeros_like(before)
    expected_view = make_view(expected if make_view is VIEWS_OF_A_LEAF["squeeze"] else expected[0])
    expected_view.copy_(logp_and_grad(make_view(before if make_view is VIEWS_OF_A_LEAF["squeeze"] else before[0]),
                                      labels, backend=backend)[1])
    assert mismatches(w.grad, expected) == 0


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


@pytest.mark.parametrize("device", FUSED_DEVICES)
def test_fused_shard_sums_are_given_a_global_max(device):
    engine = make_engine("fused")
    x = model_like_logits(4, 700, torch.float32, device)
    global_max = x.amax(dim=1) + 1.5
    req = engine_request(x[:, 100:350], None, None, engine="fused", entropy=True, start=100, vocab_total=700)
    part, part_entropy = engine.shard_sums(req, global_max)
    d = x[:, 100:350] - global_max[:, None]
    ref = (torch.exp(d) * 2.0**40).to(torch.int64).sum(dim=1)
    ref_entropy = (torch.exp(d) * d * 2.0**40).to(torch.int64).sum(dim=1)
    if device == "cuda":
        assert torch.equal(part, ref) and torch.equal(part_entropy, ref_entropy)
    else:  # the interpreter's numpy exp is not torch's CPU exp: within a few ulps per term
        assert ((part - ref).abs().double() <= ref.double() * 2**-20 + 256).all()
        assert ((part_entropy - ref_entropy).abs().double() <= ref_entropy.abs().double() * 2**-20 + 256).all()
