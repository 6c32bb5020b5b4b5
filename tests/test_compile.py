"""rl-logp under torch.compile: one opaque op per call, eager bits, one graph for every row count.

Wrapped the way verl 0.9.1's FSDP engine wraps `entropy_from_logits`
(`torch.compile(fn, dynamic=True)`), with `fullgraph=True` so any graph break fails the test. One
compiled object runs over 64, 512 and 4096 rows, 2-D and 3-D inputs, T as a float and as a per-row
tensor, forward and backward; the bits must equal eager's and dynamo must not recompile when the row
count changes. The CPU runs the chunked engine; the GPU the fused kernels.
"""

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
