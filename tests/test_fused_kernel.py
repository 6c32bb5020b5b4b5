"""The fused Triton kernels: equality with the chunked path and between their own launch variants, edge
rows, 64-bit offsets, workspace, host syncs, CUDA graphs. GPU tests skip on CPU; the logic tests also
run under TRITON_INTERPRET=1 on the CPU (where the interpreter's numpy exp is not torch's, so CPU twins
compare the kernel's variants with each other, and with chunked only within a few ulps)."""

import dataclasses

import pytest
import torch
from helpers import (
    HAS_CUDA,
    INTERPRET,
    engine_request,
    logp_and_grad,
    make_engine,
    mismatches,
    model_like_logits,
    needs_cuda,
    random_labels,
)

from rl_logp import entropy, logprobs, logprobs_and_entropy, resolve_backend
from rl_logp.engines import RowStats
from rl_logp.temperature import Temperature

FUSED_DEVICES = [
    pytest.param("cpu", id="interpret-cpu", marks=pytest.mark.skipif(not INTERPRET, reason="TRITON_INTERPRET is off")),
    pytest.param("cuda", id="cuda", marks=needs_cuda),
]


def _kernels():
    from rl_logp.engines import fused
    from rl_logp.kernels import fixed_point, launch

    return fused.FusedEngine, launch.LaunchConfig, fixed_point


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
        dataclasses.replace(base, quant=fp.QUANT_CAST.value),
        dataclasses.replace(base, chunk=small, lane=8),
        dataclasses.replace(base, chunk=2 * small, lane=2),
        dataclasses.replace(base, two_pass=True),
        dataclasses.replace(base, programs_per_sm=0),
        dataclasses.replace(base, programs_per_sm=1, warps=4),
    ]
    if device == "cuda":  # the interpreter's fma is a separate multiply and add, so only the GPU can run it
        variants.append(dataclasses.replace(base, div=fp.DIV_IEEE.value))
        variants.append(dataclasses.replace(base, div=fp.DIV_RECIPROCAL.value))
    for temp in (Temperature(), Temperature(scalar=0.7), Temperature(rows=torch.linspace(0.5, 1.5, 7, device=device))):
        ref = _all_stats(engine(base), x, temp, labels)
        for cfg in variants:
            got = _all_stats(engine(cfg), x, temp, labels)
            for a, b in zip(got, ref, strict=True):
                assert mismatches(a, b) == 0, cfg


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


@needs_cuda
def test_reciprocal_division_is_the_ieee_quotient_where_it_is_used():
    """Markstein's correction gives the IEEE quotient for every bf16 value and 4M fp32 patterns with
    2^-100 <= |x| <= 2^100 (and +-inf, NaN), T in [2^-10, 2^100]; tiny or huge logits are covered by the
    row rule (test_reciprocal_division_keeps_output_bits_on_adversarial_rows)."""
    _, _, fp = _kernels()
    x_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda").to(torch.int16).view(torch.bfloat16)
    x_fp32 = torch.randint(-(2**31), 2**31 - 1, (1 << 22,), dtype=torch.int32, device="cuda").view(torch.float32)
    temps = torch.cat([torch.tensor([0.7, 0.6, 1.3, 2.0**-10, 0.999, 7.0, 2.0**100], device="cuda"),
                       torch.exp(torch.empty(40, device="cuda").uniform_(-6.9, 20))])
    checked = bad = 0
    for values in (x_bf16, x_fp32):
        mag = values.float().abs()
        used = ((mag >= 2.0**-100) & (mag <= 2.0**100)) | ~torch.isfinite(values.float())
        for t in temps.tolist():
            got = _divide(values, t, fp.DIV_RECIPROCAL.value)
            want = values.float() / torch.tensor(t, device="cuda")
            differ = (got.view(torch.int32) != want.view(torch.int32)) & ~(got.isnan() & want.isnan())
            bad += int((differ & used).sum())
            checked += int(used.sum())
    assert checked > 10**8 and bad == 0


def _divide(values, t, div):
    import triton
    import triton.language as tl

    from rl_logp.kernels.fixed_point import scale_logits

    @triton.jit
    def divide(X, Z, t, n, DIV: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n)
        tl.store(Z + offs, scale_logits(x, t, tl.math.div_rn(1.0, t), 1, DIV), mask=offs < n)

    out = torch.empty(values.shape, dtype=torch.float32, device="cuda")
    divide[(triton.cdiv(values.numel(), 1024),)](values, out, t, values.numel(), DIV=div, BLOCK=1024)
    return out


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_reciprocal_division_keeps_output_bits_on_adversarial_rows(dtype):
    engine, config, fp = _kernels()
    n, vocab = 12, 4099
    x = model_like_logits(n, vocab, torch.float32, "cuda", seed=3)
    tiny = torch.finfo(torch.float32).tiny
    x[0, ::7] = tiny * torch.rand(586, device="cuda")  # subnormal logits beside normal ones
    x[1] = -x[1].abs() * 1e-25  # a row whose max is tiny: divides by div_rn
    x[2, 5] = 0.0
    x[2, 6] = -0.0
    x[3, ::3] = -3.0e38  # finfo.min-style masking
    x[4, 9] = 1e38  # a huge logit: divides by div_rn
    x[5, :] = -0.0
    x[5, 17] = 1e-30
    x[6] = x[6] * 1e-37  # every logit tiny
    x = x.to(dtype)
    labels = random_labels(n, vocab, "cuda")
    ieee = engine(config(div=fp.DIV_IEEE.value))
    reciprocal = engine(config(div=fp.DIV_RECIPROCAL.value))
    for temp in (Temperature(scalar=0.7), Temperature(scalar=2.0**-10), Temperature(rows=torch.linspace(0.01, 40, n, device="cuda"))):
        a, b = _all_stats(ieee, x, temp, labels), _all_stats(reciprocal, x, temp, labels)
        for u, v in zip(a, b, strict=True):
            assert mismatches(u, v) == 0
        g = torch.linspace(-1, 1, n, device="cuda")
        grads = []
        for variant in (ieee, reciprocal):
            out = torch.empty_like(x)
            req = engine_request(x, labels, temp, engine="fused", entropy=True)
            variant.grad(req, RowStats(row_max=a[0], log_sum=a[1], entropy=a[4]), g, g, out)
            grads.append(out)
        assert mismatches(grads[0], grads[1]) == 0


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


@needs_cuda
def test_forward_allocates_only_outputs_and_backward_only_the_gradient():
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
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out.sum().backward()
        assert torch.cuda.max_memory_allocated() - base <= y.numel() * 2 + 256 * n
    nonleaf = leaf * 1.0
    out = logprobs(nonleaf, labels, backend="fused", inplace_backward=True, temperature=0.7)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.sum().backward()
    assert torch.cuda.max_memory_allocated() - base <= y.numel() * 2 + 256 * n  # leaf.grad itself
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
def test_cuda_graph_capture_replays_the_same_bits():
    n, vocab = 256, 151936
    x = model_like_logits(n, vocab, torch.bfloat16, "cuda")
    labels = random_labels(n, vocab, "cuda")
    temp = torch.full((n,), 0.7, device="cuda")
    with torch.no_grad():
        eager = logprobs(x, labels, temperature=temp)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            logprobs(x, labels, temperature=temp)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = logprobs(x, labels, temperature=temp)
        x.copy_(model_like_logits(n, vocab, torch.bfloat16, "cuda", seed=9))
        graph.replay()
        torch.cuda.synchronize()
        assert mismatches(captured, logprobs(x, labels, temperature=temp)) == 0
        assert mismatches(captured, eager) > 0  # the replay read the new logits


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
