"""`rl_logp.linear_logits` / `rl_logp.linear_logprobs`: the fused head equals the unfused path bit for bit
(values, entropy, gradients of hidden and weight), whatever the rows, their order, the chunking and the
vocabulary split; the matmul is a fixed-order reduction; bad inputs raise errors that name the argument.

Targets: the CPU's torch loop (`chunked`), the Triton kernels under TRITON_INTERPRET=1 (`fused` on the CPU,
small shapes: the interpreter runs a program per row), and the real kernels on a CUDA GPU.
"""

import itertools
import os
import socket

import pytest
import torch
import torch.distributed as dist
from helpers import INTERPRET, mismatches, needs_cuda, random_cuts

import rl_logp
from rl_logp import linear_matmul

SMALL_CHUNK = 4096  # config's minimum chunk_bytes: blocks of ALIGN rows / columns

# (backend, device, rows, hidden, vocab, chunk_bytes): chunk_bytes small enough for several blocks of rows
# (forward) and of vocabulary columns (backward) where the rows allow it; the interpreter runs a program per
# row, so its shapes are small (one block of rows, two of columns).
TARGETS = [
    pytest.param("chunked", "cpu", 300, 32, 520, 128 << 10, id="torch-cpu"),
    pytest.param("fused", "cpu", 40, 64, 300, SMALL_CHUNK, id="interpret-cpu",
                 marks=pytest.mark.skipif(not INTERPRET, reason="TRITON_INTERPRET is off")),
    pytest.param("auto", "cuda", 1000, 512, 32003, 16 << 20, id="cuda", marks=needs_cuda),
]


def _inputs(n, hidden, vocab, device, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * (3.0 / hidden**0.5)
    y = torch.randint(0, vocab, (n,), generator=gen)
    y[1] = -100
    return h.to(device, dtype), w.to(device, dtype), y.to(device)


def _temperature(kind, n, device):
    if kind == "rows":
        return torch.linspace(0.4, 1.6, n, device=device)
    return kind


def _fused(h, w, y, entropy, **kwargs):
    """(logp, entropy or None, grad_h, grad_w) of linear_logprobs with loss sum(logp) + sum(entropy)."""
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = rl_logp.linear_logprobs(h, w, y, entropy=entropy, **kwargs)
    logp, ent = out if entropy else (out, None)
    (logp.sum() + (ent.sum() if entropy else 0)).backward()
    return logp.detach(), None if ent is None else ent.detach(), h.grad, w.grad


def _unfused(h, w, y, entropy, *, backend, temperature=None, chunk_bytes=None):
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    x = rl_logp.linear_logits(h, w, backend=backend)
    kwargs = {"backend": backend, "temperature": temperature, "chunk_bytes": chunk_bytes}
    if entropy:
        logp, ent = rl_logp.logprobs_and_entropy(x, y, **kwargs)
        (logp.sum() + ent.sum()).backward()
        return logp.detach(), ent.detach(), h.grad, w.grad
    logp = rl_logp.logprobs(x, y, **kwargs)
    logp.sum().backward()
    return logp.detach(), None, h.grad, w.grad


def test_align_is_a_multiple_of_every_kernel_block():
    from rl_logp.kernels import matmul

    assert linear_matmul.ALIGN % matmul.ALIGN == 0
    for cfg in matmul.CONFIGS.values():
        assert all(linear_matmul.ALIGN % b == 0 for b in (cfg.block_m, cfg.block_n, cfg.block_k))


@pytest.mark.parametrize("entropy", [False, True], ids=["logp", "logp+entropy"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, "rows"])
@pytest.mark.parametrize("backend,device,n,hidden,vocab,chunk", TARGETS)
def test_fused_head_equals_unfused_path_bitwise(backend, device, n, hidden, vocab, chunk, temperature, entropy):
    """Several row blocks in the forward and vocabulary blocks in the backward (a small chunk_bytes)."""
    h, w, y = _inputs(n, hidden, vocab, device)
    t = _temperature(temperature, n, device)
    fused = _fused(h, w, y, entropy, backend=backend, temperature=t, chunk_bytes=chunk)
    unfused = _unfused(h, w, y, entropy, backend=backend, temperature=t)
    for name, a, b in zip(("logp", "entropy", "grad_h", "grad_w"), fused, unfused, strict=True):
        if a is not None or b is not None:
            assert mismatches(a, b) == 0, name
    assert fused[0][1] == 0 and fused[2].abs().sum() > 0  # the ignored row scores 0; gradients flow


@pytest.mark.parametrize("backend,device,n,hidden,vocab,chunk", TARGETS)
def test_default_chunking_gives_the_same_bits(backend, device, n, hidden, vocab, chunk):
    h, w, y = _inputs(n, hidden, vocab, device, seed=3)
    small = _fused(h, w, y, True, backend=backend, temperature=0.7, chunk_bytes=chunk)
    default = _fused(h, w, y, True, backend=backend, temperature=0.7)
    for a, b in zip(small, default, strict=True):
        assert mismatches(a, b) == 0


@pytest.mark.parametrize("backend,device,n,hidden,vocab,chunk", TARGETS)
def test_each_row_is_scored_alike_in_any_batch(backend, device, n, hidden, vocab, chunk):
    """Rows alone, permuted, and split into uneven calls give the same logp and entropy bits."""
    h, w, y = _inputs(n, hidden, vocab, device, seed=5)
    kwargs = {"backend": backend, "temperature": 0.7, "entropy": True, "chunk_bytes": chunk}
    with torch.no_grad():
        logp, ent = rl_logp.linear_logprobs(h, w, y, **kwargs)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(1)).to(device)
        p_logp, p_ent = rl_logp.linear_logprobs(h[perm], w, y[perm], **kwargs)
        assert mismatches(p_logp, logp[perm]) == 0 and mismatches(p_ent, ent[perm]) == 0
        cuts = random_cuts(n, 4, seed=2)
        parts = [rl_logp.linear_logprobs(h[a:b], w, y[a:b], **kwargs) for a, b in itertools.pairwise(cuts)]
        assert mismatches(torch.cat([p[0] for p in parts]), logp) == 0
        assert mismatches(torch.cat([p[1] for p in parts]), ent) == 0
        for i in (0, n // 2, n - 1):
            alone = rl_logp.linear_logprobs(h[i : i + 1], w, y[i : i + 1], **kwargs)
            assert mismatches(alone[0], logp[i : i + 1]) == 0 and mismatches(alone[1], ent[i : i + 1]) == 0


@pytest.mark.parametrize("backend,device,n,hidden,vocab,chunk", TARGETS)
def test_logits_do_not_depend_on_rows_or_vocabulary_cuts(backend, device, n, hidden, vocab, chunk):
    h, w, _ = _inputs(n, hidden, vocab, device, seed=7)
    with torch.no_grad():
        full = rl_logp.linear_logits(h, w, backend=backend)
        for a, b in itertools.pairwise(random_cuts(vocab, 3, seed=4)):
            assert mismatches(rl_logp.linear_logits(h, w[a:b], backend=backend), full[:, a:b]) == 0
        for a, b in itertools.pairwise(random_cuts(n, 3, seed=6)):
            assert mismatches(rl_logp.linear_logits(h[a:b], w, backend=backend), full[a:b]) == 0
        batched = rl_logp.linear_logits(h.reshape(2, n // 2, hidden), w, backend=backend)
        assert batched.shape == (2, n // 2, vocab) and mismatches(batched.reshape(n, vocab), full) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("backend,device,n,hidden,vocab,chunk", TARGETS)
def test_logits_are_the_product_rounded_once(backend, device, n, hidden, vocab, chunk, dtype):
    """Within one rounding of the output dtype of the exact product (fp32 accumulation of exact products)."""
    h, w, _ = _inputs(min(n, 64), hidden, min(vocab, 512), device, dtype, seed=8)
    with torch.no_grad():
        got = rl_logp.linear_logits(h, w, backend=backend).double()
    exact = h.double() @ w.double().t()
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(1.0)
    assert got.dtype == torch.float64 and ((got - exact).abs() <= ulp + 1e-4 * exact.abs().max()).all()


def test_torch_loop_is_a_sequential_fp32_sum():
    """The CPU path's logit (i, j) is exactly fp32(...fp32(fp32(h0 w0) + fp32(h1 w1)) + ...), in order."""
    h, w, _ = _inputs(3, 40, 5, "cpu", torch.float32, seed=9)
    got = rl_logp.linear_logits(h, w, backend="chunked")
    for i, j in ((0, 0), (2, 4), (1, 3)):
        acc = torch.zeros((), dtype=torch.float32)
        for k in range(40):
            acc = acc + h[i, k] * w[j, k]
        assert mismatches(got[i, j].reshape(1), acc.reshape(1)) == 0
    assert mismatches(got, (h @ w.t())) > 0  # torch.matmul's order is another one (why it is not used)


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs Triton (interpreter or GPU)")
def test_kernel_accumulates_across_reduction_cuts_like_one_call():
    from rl_logp.kernels.matmul import matmul

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(10)
    a = torch.randn(70, 700, generator=gen).bfloat16().to(device)
    b = torch.randn(700, 90, generator=gen).bfloat16().to(device)
    one = torch.zeros(70, 90, device=device)
    matmul(a, b, one, accumulate=True)
    pieces = torch.zeros(70, 90, device=device)
    for start in (0, 256, 512):
        matmul(a[:, start : start + 256], b[start : start + 256], pieces, accumulate=True)
    assert mismatches(one, pieces) == 0
    rounded = torch.empty(70, 90, dtype=torch.bfloat16, device=device)
    matmul(a, b, rounded)
    assert mismatches(rounded, one.bfloat16()) == 0


def test_no_rows_gives_empty_outputs_and_zero_weight_gradient():
    h, w, _ = _inputs(4, 16, 30, "cpu")
    h0, w = h[:0].clone().requires_grad_(True), w.clone().requires_grad_(True)
    logp, ent = rl_logp.linear_logprobs(h0, w, torch.zeros(0, dtype=torch.long), entropy=True, backend="chunked")
    assert logp.shape == ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert h0.grad.shape == (0, 16) and w.grad.shape == w.shape and not w.grad.any()


@pytest.mark.parametrize("call,match", [
    (lambda h, w, y: rl_logp.linear_logprobs(h.long(), w, y), "hidden has dtype torch.int64"),
    (lambda h, w, y: rl_logp.linear_logprobs(h.bfloat16(), w, y), "weight has dtype torch.float32 but hidden"),
    (lambda h, w, y: rl_logp.linear_logprobs(h, w.t(), y), "weight is .V, H."),
    (lambda h, w, y: rl_logp.linear_logprobs(h, w[None], y), "weight .V, H."),
    (lambda h, w, y: rl_logp.linear_logprobs(h, w[:0], y), "V == 0"),
    (lambda h, w, y: rl_logp.linear_logprobs(h, w, y[:-1]), "labels have shape"),
    (lambda h, w, y: rl_logp.linear_logprobs(h, w, y.float()), "labels have dtype"),
    (lambda h, w, y: rl_logp.linear_logprobs(h.numpy(), w, y), "hidden must be a torch.Tensor"),
    (lambda h, w, y: rl_logp.linear_logprobs(h, w, y, backend="torch"), "need an invariant backend"),
    (lambda h, w, y: rl_logp.linear_logprobs(h, w, y, temperature=-1.0), "temperature=-1.0"),
    (lambda h, w, y: rl_logp.linear_logprobs(h, w, y, temperature=torch.ones(3)), "temperature has shape"),
    (lambda h, w, y: rl_logp.linear_logprobs(h, w, y, vocab_start=0), "pass tp_group"),
    (lambda h, w, y: rl_logp.linear_logits(h, w, backend="flash_attn"), "need an invariant backend"),
])
def test_bad_inputs_name_the_argument(call, match):
    h, w, y = _inputs(8, 16, 30, "cpu", torch.float32)
    with pytest.raises((TypeError, ValueError), match=match):
        call(h, w, y)


@needs_cuda
def test_devices_must_match():
    h, w, y = _inputs(8, 16, 30, "cpu")
    with pytest.raises(ValueError, match="weight is on cuda"):
        rl_logp.linear_logprobs(h, w.cuda(), y)
    with pytest.raises(ValueError, match="labels are on cuda"):
        rl_logp.linear_logprobs(h, w, y.cuda())


@needs_cuda
def test_head_memory_stays_near_the_gradients_on_gpu():
    """Forward + backward at N=4096, H=1024, V=151936 (bf16): the peak above the inputs is the gradients
    (grad_W, grad_h and its fp32 accumulator) plus one block of logits and the row statistics, far below the
    1.2 GB of the logits."""
    n, hidden, vocab = 4096, 1024, 151936
    h, w, y = _inputs(n, hidden, vocab, "cuda")
    h.requires_grad_(True)
    w.requires_grad_(True)
    chunk = 64 << 20
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logp, ent = rl_logp.linear_logprobs(h, w, y, temperature=0.7, entropy=True, chunk_bytes=chunk)
    (logp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = w.numel() * 2 + h.numel() * (2 + 4)
    assert peak <= grads + 2 * chunk + (16 << 20), (peak, grads)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TP_ROWS, TP_HIDDEN, TP_VOCAB, TP_CHUNK = 300, 32, 1031, 256 << 10  # two blocks of rows, of columns


def _tp_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cuts = random_cuts(TP_VOCAB, world, seed=11)
    h, w, y = _inputs(TP_ROWS, TP_HIDDEN, TP_VOCAB, "cpu", seed=12)
    got = _fused(h, w[cuts[rank] : cuts[rank + 1]], y, True, backend="chunked", temperature=0.7,
                 chunk_bytes=TP_CHUNK, tp_group=dist.group.WORLD)
    torch.save({"out": got, "cuts": cuts}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_vocab_parallel_uneven_split_gives_tp1_bits(tmp_path):
    world = 2
    torch.multiprocessing.spawn(_tp_rank, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    h, w, y = _inputs(TP_ROWS, TP_HIDDEN, TP_VOCAB, "cpu", seed=12)
    logp, ent, grad_h, grad_w = _fused(h, w, y, True, backend="chunked", temperature=0.7, chunk_bytes=TP_CHUNK)
    cuts = ranks[0]["cuts"]
    assert cuts[1] % linear_matmul.ALIGN != 0  # an uneven cut, not at a block boundary
    for r in ranks:
        r_logp, r_ent, _, _ = r["out"]
        assert mismatches(r_logp, logp) == 0 and mismatches(r_ent, ent) == 0
    assert mismatches(torch.cat([r["out"][3] for r in ranks]), grad_w) == 0
    partials = sum(r["out"][2].float() for r in ranks)  # the caller's all-reduce (a float sum: not bitwise)
    torch.testing.assert_close(partials, grad_h.float(), rtol=2e-2, atol=2e-2)
