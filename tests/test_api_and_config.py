"""Config parsing, input validation, edge inputs, the bounded chunked workspace, and the check CLI."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import HAS_CUDA, INTERPRET, logp_and_grad, mismatches, model_like_logits, random_labels

import rl_logp
from rl_logp import LogpConfig, logprobs, resolve_config
from rl_logp.engines.chunked import WORKSPACE_BYTES_PER_ELEMENT, ChunkPlan


def test_config_precedence_env_dict_kwargs():
    env = {"RL_LOGP_BACKEND": "torch", "RL_LOGP_CHUNK_BYTES": "1_048_576", "RL_LOGP_STRICT": "0"}
    assert resolve_config(environ=env) == LogpConfig(backend="torch", chunk_bytes=1 << 20)
    assert resolve_config({"backend": "chunked"}, environ=env).backend == "chunked"
    assert resolve_config({"backend": "chunked"}, environ=env, backend="fused").backend == "fused"
    assert LogpConfig.from_env(env).chunk_bytes == 1 << 20


@pytest.mark.parametrize("bad,match", [
    ({"backend": "cuda"}, "backend='cuda' is unknown"),
    ({"chunk_bytes": 10}, "below the minimum"),
    ({"fixed_point_bits": 63}, "fixed_point_bits=63"),
    ({"strict": True, "backend": "torch"}, "not batch/TP-invariant"),
    ({"colour": 1}, "unknown config key 'colour'"),
])
def test_config_rejects_bad_values(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        resolve_config(bad, environ={})


def test_fused_where_its_kernels_cannot_import_names_the_reason_and_the_fix(monkeypatch):
    """Where Triton (the fused kernels) cannot be imported, backend='fused' raises naming why and what to pass
    instead, and 'auto' scores with the chunked engine: the same bits, no silent failure."""
    from rl_logp import engines

    monkeypatch.setattr(engines, "_IMPORT_ERROR", ["No module named 'triton'"])
    monkeypatch.setattr(engines, "_RUNS_ON", {})
    x, y = model_like_logits(4, 67, torch.float32, "cpu", seed=0), random_labels(4, 67, "cpu", seed=0)
    with pytest.raises(ValueError, match=r"backend='fused' needs CUDA logits and Triton \(No module named 'triton'\); "
                                         r"use backend='chunked'"):
        logprobs(x, y, backend="fused")
    assert engines.resolve_backend("auto", torch.device("cuda")) == "chunked"
    assert mismatches(logprobs(x, y), logprobs(x, y, backend="chunked")) == 0
    assert engines._RUNS_ON == {"cpu": False, "cuda": False}


def test_bad_env_value_names_the_variable():
    with pytest.raises(ValueError, match="strict='maybe'"):
        resolve_config(environ={"RL_LOGP_STRICT": "maybe"})


@pytest.mark.parametrize("logits,labels,match", [
    (torch.randn(2, 5, dtype=torch.complex64), torch.zeros(2, dtype=torch.long), "dtype torch.complex64"),
    (torch.randn(2, 5), torch.zeros(2), "labels have dtype torch.float32"),
    (torch.randn(2, 5), torch.zeros(3, dtype=torch.long), "labels have shape"),
    (torch.randn(2, 0), torch.zeros(2, dtype=torch.long), "empty vocabulary"),
])
def test_bad_inputs_get_clear_errors(logits, labels, match):
    with pytest.raises((TypeError, ValueError), match=match):
        logprobs(logits, labels, backend="chunked")


@pytest.mark.parametrize("temperature,error,match", [
    (0.0, ValueError, r"temperature=0\.0 must be finite and > 0"),
    (float("nan"), ValueError, "must be finite and > 0"),
    (1e-50, ValueError, "outside float32's normal range"),
    (1e39, ValueError, "outside float32's normal range"),
    ("0.7", TypeError, "temperature must be a float or a tensor"),
    (True, TypeError, "temperature must be a float or a tensor"),
    (torch.full((2,), 0.7, requires_grad=True), ValueError, "temperature requires grad"),
    (torch.ones(3), ValueError, "temperature has shape"),
    (torch.ones(2, dtype=torch.long), TypeError, "floating-point tensor"),
])
def test_bad_temperatures_name_the_fix(temperature, error, match):
    with pytest.raises(error, match=match):
        logprobs(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), temperature=temperature)


def test_bad_option_types_name_the_fix():
    x, y = torch.randn(2, 5), torch.zeros(2, dtype=torch.long)
    with pytest.raises(TypeError, match="to choose a backend pass backend='chunked'"):
        logprobs(x, y, config="chunked")
    with pytest.raises(ValueError, match="vocab_start/vocab_size describe a vocab split"):
        logprobs(x, y, vocab_size=5)
    with pytest.raises(TypeError, match=r"tp_group must be a torch\.distributed\.ProcessGroup"):
        logprobs(x, y, tp_group="tp")
    with pytest.raises(ValueError, match="flash_attn' has no entropy"):
        rl_logp.entropy(x, backend="flash_attn")


def test_fp64_logits_are_scored_as_fp32_with_an_fp64_gradient():
    x = torch.randn(6, 301, dtype=torch.float64) * 3
    y = random_labels(6, 301, "cpu")
    got = logp_and_grad(x, y, backend="chunked")
    want = logp_and_grad(x.float(), y, backend="chunked")
    assert got[1].dtype == torch.float64
    assert mismatches(got[0], want[0]) == 0
    assert mismatches(got[1].float(), want[1]) == 0


def test_labels_with_size_one_dimensions_match_the_rows():
    x = model_like_logits(8, 301, torch.bfloat16, "cpu")
    y = random_labels(8, 301, "cpu")
    flat = logprobs(x, y, backend="chunked")
    assert mismatches(logprobs(x, y.view(1, 8), backend="chunked"), flat) == 0
    assert mismatches(logprobs(x.view(1, 8, 301), y, backend="chunked").view(8), flat) == 0
    with pytest.raises(ValueError, match="labels have shape"):
        logprobs(x, y.view(2, 4), backend="chunked")


@pytest.mark.parametrize("backend", ["chunked", pytest.param("fused", marks=pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="the fused kernel cannot run here"))])
def test_nan_and_inf_rows_give_nan_and_ignored_labels_stay_zero(backend):
    device = "cuda" if HAS_CUDA and backend == "fused" else "cpu"
    x = model_like_logits(5, 257, torch.float32, device)
    x[0, 3] = float("nan")
    x[1, 9] = float("inf")
    x[2, 9] = float("inf")
    labels = torch.tensor([1, 2, -100, 4, 5], device=device)
    leaf = x.clone().requires_grad_(True)
    logp, h = rl_logp.logprobs_and_entropy(leaf, labels, backend=backend)
    (logp.sum() + h.sum()).backward()
    assert torch.isnan(logp[:2]).all() and torch.isnan(h[:3]).all()
    assert logp[2] == 0  # an ignored label never poisons a loss
    assert torch.isnan(leaf.grad[:3]).all(dim=1).all()  # the entropy's gradient is NaN on all three
    assert torch.isfinite(logp[3:]).all() and torch.isfinite(leaf.grad[3:]).all()


@pytest.mark.parametrize("backend", ["chunked", pytest.param("fused", marks=pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="the fused kernel cannot run here"))])
def test_bad_rows_of_a_temperature_tensor_give_nan_without_a_sync(backend):
    device = "cuda" if HAS_CUDA and backend == "fused" else "cpu"
    x = model_like_logits(5, 257, torch.float32, device)
    y = random_labels(5, 257, device)
    t = torch.tensor([0.7, 0.0, -1.0, float("nan"), float("inf")], device=device)
    leaf = x.clone().requires_grad_(True)
    logp, h = rl_logp.logprobs_and_entropy(leaf, y, backend=backend, temperature=t)
    (logp.sum() + h.sum()).backward()
    assert torch.isfinite(logp[0]) and torch.isfinite(h[0]) and torch.isfinite(leaf.grad[0]).all()
    assert torch.isnan(logp[1:]).all() and torch.isnan(h[1:]).all() and torch.isnan(leaf.grad[1:]).all()
    alone = rl_logp.logprobs(x[:1], y[:1], backend=backend, temperature=0.7)
    assert mismatches(logp[:1].detach(), alone) == 0


def test_extreme_finite_logits_give_the_right_answer():
    vocab = 1000
    uniform = torch.full((2, vocab), 1e30)
    uniform[1] = -1e30
    y = torch.tensor([3, 7])
    want = -torch.log(torch.tensor(float(vocab)))
    assert torch.allclose(logprobs(uniform, y, backend="chunked"), want.expand(2), rtol=1e-6)
    assert torch.allclose(rl_logp.entropy(uniform, backend="chunked"), -want.expand(2), rtol=1e-6)
    spread = torch.zeros(1, vocab)
    spread[0, 0] = 3e38
    assert logprobs(spread, torch.tensor([0]), backend="chunked") == 0
    assert logprobs(spread, torch.tensor([1]), backend="chunked") == -3e38


def test_double_backward_is_a_clear_error():
    x = model_like_logits(3, 64, torch.float32, "cpu").requires_grad_(True)
    y = random_labels(3, 64, "cpu")
    for out in (logprobs(x, y, backend="chunked"), rl_logp.entropy(x, backend="chunked")):
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(out.sum(), x, create_graph=True)


def test_logsumexp_and_log_normalizer_are_the_contract():
    x = model_like_logits(9, 1031, torch.bfloat16, "cpu")
    for t in (None, 0.7):
        lse = rl_logp.logsumexp(x, backend="chunked", temperature=t)
        row_max, log_sum = rl_logp.log_normalizer(x, backend="chunked", temperature=t)
        z = x.double() / (t or 1.0)
        assert (lse.double() - torch.logsumexp(z, dim=1)).abs().max() < 4e-6
        assert mismatches(lse, (row_max.double() + log_sum.double()).float()) <= 9
        # every column's logprob from (M, L) is the bits logprobs gives for that label
        zf = x.float() / torch.tensor(t or 1.0)
        cols = torch.randint(0, 1031, (9,))
        from_parts = (zf.gather(1, cols[:, None]).squeeze(1) - row_max) - log_sum
        assert mismatches(from_parts, logprobs(x, cols, backend="chunked", temperature=t)) == 0
        alone = torch.cat([rl_logp.logsumexp(x[i : i + 1], backend="chunked", temperature=t) for i in range(9)])
        assert mismatches(alone, lse) == 0
    with pytest.raises(ValueError, match="needs an invariant backend"):
        rl_logp.logsumexp(x, backend="torch")


def test_empty_batch_and_3d_and_noncontiguous_inputs():
    empty = logprobs(torch.randn(0, 7, requires_grad=True), torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0,) and empty.dtype == torch.float32
    x = model_like_logits(12, 301, torch.bfloat16, "cpu")
    y = random_labels(12, 301, "cpu")
    flat = logp_and_grad(x, y, backend="chunked")
    shaped = logp_and_grad(x.view(3, 4, 301), y.view(3, 4), backend="chunked")
    assert mismatches(shaped[0].reshape(-1), flat[0]) == 0
    strided = torch.zeros(301, 12, dtype=torch.bfloat16)
    strided.copy_(x.t())
    t = logp_and_grad(strided.t(), y.int(), backend="chunked")  # last dim not contiguous: copied
    assert mismatches(t[0], flat[0]) == 0 and mismatches(t[1], flat[1]) == 0


def test_chunk_plan_depends_on_the_budget_and_vocab_only():
    for budget in [4096, 1 << 20, 1 << 28]:
        plan = ChunkPlan.for_budget(151936, budget)
        assert plan.workspace_bytes <= max(budget, WORKSPACE_BYTES_PER_ELEMENT * 151936)
        assert ChunkPlan.for_budget(151936, budget) == plan
        tiles = list(plan.blocks(1000, 151936))
        covered = sum((r.stop - r.start) * (c.stop - c.start) for r, c in tiles)
        assert covered == 1000 * 151936  # the tiles cover the block exactly once


# The peak is Linux's VmHWM, reset just before the call (clear_refs 5), so a transient peak of the
# process's set-up (imports, the inputs) cannot hide the call's own growth.
_RSS_PROBE = """
import sys, torch
import rl_logp
def status(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))
n, vocab, backend = int(sys.argv[1]), 4096, sys.argv[2]
x = torch.randn(n, vocab); y = torch.randint(0, vocab, (n,))
rl_logp.logprobs(x[:2], y[:2], backend=backend, chunk_bytes=1 << 22)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS:")
rl_logp.logprobs(x, y, backend=backend, chunk_bytes=1 << 22)
print(status("VmHWM:") - base)
"""


def _peak_growth(n, backend):
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(n), backend], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_chunked_forward_workspace_does_not_grow_with_n():
    # Peak RSS growth of one forward over 4096 and 16384 rows of 4096 fp32 logits (64 MB / 256 MB):
    # the chunked path stays within its 4 MiB budget plus allocator slack at both N; the torch baseline
    # (a full log_softmax copy of 256 MB) breaks the same bound, which shows the probe can see workspace.
    bound = 48 << 20
    small, large = _peak_growth(4096, "chunked"), _peak_growth(16384, "chunked")
    assert small < bound and large < bound, (small, large)
    assert _peak_growth(16384, "torch") > bound
