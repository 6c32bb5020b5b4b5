"""rl-logp under torch.compile: one opaque op per call, eager bits, one graph for every row count.

Wrapped the way verl 0.9.1's FSDP engine wraps `entropy_from_logits`
(`torch.compile(fn, dynamic=True)`), with `fullgraph=True` so any graph break fails the test. One
compiled object runs over 64, 512 and 4096 rows, 2-D and 3-D inputs, T as a float and as a per-row
tensor, forward and backward; the bits must equal eager's and dynamo must not recompile when the row
count changes. The CPU runs the chunked engine; the GPU the fused kernels.
"""

import warnings

import pytest
import torch
from helpers import HAS_CUDA, mismatches, model_like_logits, random_labels

import rl_logp

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))]
ROWS = [64, 512, 4096]


def _entropy(logits, temperature):
    return rl_logp.entropy(logits, temperature=temperature)


def _logprobs(logits, labels, temperature):
    return rl_logp.logprobs(logits, labels, temperature=temperature)


def _fused_logprobs(logits, labels):
    return rl_logp.logprobs(logits, labels, temperature=0.7, backend="fused")


def _both(logits, labels, temperature):
    logp, h = rl_logp.logprobs_and_entropy(logits, labels, temperature=temperature)
    return logp + h


def _inputs(rows, vocab, device, three_d, seed):
    x = model_like_logits(rows, vocab, torch.bfloat16, device, seed=seed)
    y = random_labels(rows, vocab, device, seed=seed)
    if three_d:
        x, y = x.view(rows // 32, 32, vocab), y.view(rows // 32, 32)
    return x, y


def _value_and_grad(fn, x, *args):
    leaf = x.detach().clone().requires_grad_(True)
    out = fn(leaf * 1.0, *args)
    out.float().sum().backward()
    return out.detach(), leaf.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["entropy", "logprobs", "logprobs_and_entropy"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, "rows"])
@pytest.mark.parametrize("three_d", [False, True], ids=["2d", "3d"])
def test_compiled_equals_eager_without_recompiles(device, which, temperature, three_d):
    from torch._dynamo.utils import counters

    vocab = 151936 if device == "cuda" else 1031
    fn = {"entropy": _entropy, "logprobs": _logprobs, "logprobs_and_entropy": _both}[which]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, dynamic=True, fullgraph=True)
    for i, rows in enumerate(ROWS):
        x, y = _inputs(rows, vocab, device, three_d, seed=i)
        t = temperature
        if temperature == "rows":
            t = torch.rand(y.shape, device=device) + 0.5
        args = (t,) if which == "entropy" else (y, t)
        want = _value_and_grad(fn, x, *args)
        got = _value_and_grad(compiled, x, *args)
        assert mismatches(got[0], want[0]) == 0, rows
        assert mismatches(got[1], want[1]) == 0, rows
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiling_a_fused_call_makes_dynamo_warn_nothing_and_compile_once(monkeypatch):
    """torch.compile traces the backend's resolution (`engines.fused_runs_on`; on the CPU the fused kernels
    run under the interpreter, on a GPU machine the logits are on the GPU): nothing in it may make Dynamo
    warn, as it does at every `functools` cache wrapper it traces through, nor recompile once its first call
    (nothing asked yet) has filled the memo."""
    from torch._dynamo import utils as dynamo_utils
    from torch._dynamo.utils import counters

    from rl_logp import engines

    monkeypatch.setattr(engines, "_RUNS_ON", {})
    monkeypatch.setattr(engines, "_IMPORT_ERROR", [])
    monkeypatch.setattr(dynamo_utils, "warn_once_cache", set())  # Dynamo warns once a process per message
    device = "cuda" if HAS_CUDA else "cpu"
    x, y = _inputs(8, 67, device, False, seed=0)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_fused_logprobs, fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [compiled(x, y) for _ in range(2)]
    dynamo = [str(w.message) for w in caught if "Dynamo" in str(w.message)]
    assert not dynamo, dynamo
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert engines._RUNS_ON == {device: True}
    for out in got:
        assert mismatches(out, _fused_logprobs(x, y)) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_model_with_lm_head_matches_eager(device):
    """A user compiling the whole step: lm_head matmul then logprobs in one fullgraph module."""
    vocab, hidden, rows = (151936, 256, 512) if device == "cuda" else (1031, 64, 96)
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False).to(device=device, dtype=torch.bfloat16)
    h = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    y = torch.randint(0, vocab, (rows,), generator=gen).to(device)

    def step(hidden_states, labels):
        return rl_logp.logprobs(head(hidden_states), labels, temperature=0.7)

    def run(fn):
        head.zero_grad()
        x = h.clone().requires_grad_(True)
        logp = fn(x, y)
        logp.backward(torch.ones_like(logp))
        return logp.detach(), x.grad, head.weight.grad.clone()

    want = run(step)
    got = run(torch.compile(step, fullgraph=True))
    for a, b in zip(got, want, strict=True):
        assert mismatches(a.reshape(-1), b.reshape(-1)) == 0


def test_bad_input_raises_the_same_error_compiled_or_not():
    x = torch.randn(4, 33)
    y = torch.zeros(4)  # float labels
    with pytest.raises(TypeError, match="labels have dtype"):
        rl_logp.logprobs(x, y)
    with pytest.raises(TypeError, match="labels have dtype"):
        torch.compile(rl_logp.logprobs, dynamic=True)(x, y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [None, 0.7, "rows"])
def test_normalizer_functions_compile_with_eager_bits(device, temperature):
    """`logsumexp` and `log_normalizer` (no labels, no entropy: the op's outputs must not alias)."""
    vocab = 151936 if device == "cuda" else 1031
    torch._dynamo.reset()
    lse = torch.compile(rl_logp.logsumexp, dynamic=True, fullgraph=True)
    normalizer = torch.compile(rl_logp.log_normalizer, dynamic=True, fullgraph=True)
    for i, rows in enumerate((3, 64, 257)):
        x = model_like_logits(rows, vocab, torch.bfloat16, device, seed=i)
        t = torch.rand(rows, device=device) + 0.5 if temperature == "rows" else temperature
        assert mismatches(lse(x, temperature=t), rl_logp.logsumexp(x, temperature=t)) == 0
        for got, want in zip(normalizer(x, temperature=t), rl_logp.log_normalizer(x, temperature=t), strict=True):
            assert mismatches(got, want) == 0


@pytest.fixture(scope="module")
def one_rank_group():
    """A gloo world of this process alone: the vocab-parallel form of the op runs its collectives on it."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if started:
        dist.destroy_process_group()


def _op_requests(device, group):
    """Argument tuples of `rl_logp::row_stats` covering its outputs, temperatures and the TP form."""
    from rl_logp import ops
    from rl_logp.request import prepare_inputs
    from rl_logp.shard_layout import VocabShard

    cfg = rl_logp.resolve_config(None, backend="chunked")
    x = model_like_logits(6, 257, torch.float32, device, seed=3)
    y = random_labels(6, 257, device, seed=3)
    shard = VocabShard(group=group, start=0, width=257, vocab_size=257, comm_device=torch.device("cpu"))
    cases = []
    for labels, entropy, temperature, tp, normalizer in [
        (None, False, None, None, True),  # logsumexp / log_normalizer
        (y, False, None, None, True),
        (y, True, 0.7, None, True),
        (None, True, torch.linspace(0.5, 1.5, 6, device=device), None, False),
        (y, True, 0.7, shard, True),
    ]:
        req = prepare_inputs(x, labels, temperature).request(cfg, "chunked", entropy=entropy, normalizer=normalizer,
                                                             shard=tp)
        cases.append(ops._flatten(req))
    return cases


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_every_op(device, one_rank_group):
    """torch.library.opcheck (schema, fake tensors, autograd registration, AOT dispatch) over row_stats,
    grad and grad_."""
    for args in _op_requests(device, one_rank_group):
        x = args[0].clone().requires_grad_(True)
        torch.library.opcheck(torch.ops.rl_logp.row_stats.default, (x, *args[1:]))
        _, ent, _, row_max, log_sum = torch.ops.rl_logp.row_stats(*args)
        g = torch.ones(args[0].shape[0], device=device)
        entropy = args[-1][0]
        stats = [row_max, log_sum, ent if entropy else None, g if args[1] is not None else None, g if entropy else None]
        if stats[3] is None and stats[4] is None:
            continue
        torch.library.opcheck(torch.ops.rl_logp.grad.default, (args[0], *args[1:], stats))
        torch.library.opcheck(torch.ops.rl_logp.grad_.default, (args[0].clone(), *args[1:], stats))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True], ids=["new_buffer", "inplace"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, "rows"])
@pytest.mark.parametrize("used", ["both", "logp", "entropy"])
def test_eager_autograd_function_gives_the_ops_bits(device, inplace, temperature, used, monkeypatch):
    """Eager training calls run the ops' bodies under `ops._EagerRowStats` (no dispatcher); through
    `rl_logp::row_stats` and its registered formula (what torch.compile runs) they give the same logp,
    entropy and gradient bits, whichever of the two outputs the loss uses (the other's gradient reaches
    the formula as zeros either way), and the in-place backward bumps the logits' version counter either
    way."""
    import types

    from rl_logp import ops

    x, y = _inputs(256, 3001, device, False, seed=11)
    x[:3, ::2] = float("-inf")  # columns whose p is 0: where a zero gradient's sign would show
    t = torch.rand(256, device=device) + 0.5 if temperature == "rows" else temperature

    def run():
        leaf = x.detach().clone().requires_grad_(True)
        logits = leaf * 1.0
        logp, h = rl_logp.logprobs_and_entropy(logits, y, temperature=t, inplace_backward=inplace)
        version = logits._version
        loss = {"both": logp.sum() + 0.5 * h.sum(), "logp": logp.sum(), "entropy": h.sum()}[used]
        loss.backward()
        return logp.detach(), h.detach(), leaf.grad, logits._version - version, type(logp.grad_fn).__name__

    eager = run()
    monkeypatch.setattr(ops, "_EagerRowStats", types.SimpleNamespace(apply=torch.ops.rl_logp.row_stats))
    through_ops = run()
    assert eager[4] == "_EagerRowStatsBackward" and through_ops[4] != eager[4]
    for got, want in zip(eager[:3], through_ops[:3], strict=True):
        assert mismatches(got, want) == 0
    assert eager[3] == through_ops[3] and (eager[3] > 0) == inplace

