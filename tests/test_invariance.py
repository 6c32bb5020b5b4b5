"""Bitwise invariance of the invariant paths: batch shape and position, chunking, vocabulary splits.

Every test counts differing bits and asserts zero. The `torch` baseline is run through the same
harness and shown to differ, so the harness can tell an invariant path from one that is not.
On a GPU the same functions run at the Qwen vocabulary (151936) with three seeds.
"""

import itertools

import pytest
import torch
from helpers import (
    HAS_CUDA,
    batch_invariance_mismatches,
    batch_sizes,
    logp_and_grad,
    make_engine,
    mismatches,
    model_like_logits,
    random_cuts,
    random_labels,
    split_vocab_stats,
)

from rl_logp import logprobs_and_entropy


def _sweep_shape(backend, device):
    if device == "cuda":
        return 151936, 2048, [0, 1, 2]
    if backend == "fused":  # Triton's interpreter is slow: a shorter sweep on a smaller vocabulary
        return 257, 65, [0]
    return 1031, 2048, [0]


def _targets():
    from helpers import invariant_targets

    return invariant_targets()


@pytest.mark.parametrize("backend,device", _targets())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_batch_size_and_position_do_not_change_bits(backend, device, dtype):
    vocab, limit, seeds = _sweep_shape(backend, device)
    sizes = batch_sizes(limit)
    total = {"placements": 0, "logp": 0, "dlogits": 0}
    for seed in seeds:
        probes = model_like_logits(3, vocab, dtype, device, seed=100 + seed)
        fill = model_like_logits(max(sizes), vocab, dtype, device, seed=200 + seed)
        counts = batch_invariance_mismatches(
            probes, random_labels(3, vocab, device, seed), fill, random_labels(max(sizes), vocab, device, seed),
            sizes, backend=backend,
        )
        for key in total:
            total[key] += counts[key]
    assert total["placements"] >= 3 * len(sizes) - 4
    assert total["logp"] == 0 and total["dlogits"] == 0, total


@pytest.mark.parametrize("backend,device", _targets())
def test_temperature_rows_are_batch_invariant(backend, device):
    vocab = 257 if device == "cpu" else 151936
    sizes = batch_sizes(33)
    probes = model_like_logits(3, vocab, torch.bfloat16, device, seed=7)
    fill = model_like_logits(max(sizes), vocab, torch.bfloat16, device, seed=8)
    counts = batch_invariance_mismatches(
        probes, random_labels(3, vocab, device), fill, random_labels(max(sizes), vocab, device), sizes,
        backend=backend, temperature=0.7,
    )
    assert counts["logp"] == 0 and counts["dlogits"] == 0, counts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))])
def test_chunk_budget_does_not_change_bits(device):
    # Budgets from "many rows per chunk" down to "a fraction of one row per chunk" (column blocks).
    vocab = 4099
    logits = model_like_logits(37, vocab, torch.bfloat16, device, seed=3)
    labels = random_labels(37, vocab, device, seed=3)
    reference = logp_and_grad(logits, labels, backend="chunked", chunk_bytes=1 << 30)
    for budget in [1 << 20, 12 * vocab * 3, 12 * vocab, 12 * 1000, 4096]:
        logp, grad = logp_and_grad(logits, labels, backend="chunked", chunk_bytes=budget)
        assert mismatches(logp, reference[0]) == 0, budget
        assert mismatches(grad, reference[1]) == 0, budget


@pytest.mark.parametrize("backend,device", _targets())
@pytest.mark.parametrize("temperature", [None, torch.tensor(0.7)])
def test_vocab_split_at_random_points_matches_unsplit(backend, device, temperature):
    vocab = 1031 if device == "cpu" else 151936
    n = 9
    logits = model_like_logits(n, vocab, torch.bfloat16, device, seed=11)
    labels = random_labels(n, vocab, device, seed=11)
    labels[0] = -100
    temp = None if temperature is None else temperature.to(device).expand(n).contiguous()
    x = logits.detach().clone().requires_grad_(True)
    logp, ent = logprobs_and_entropy(x, labels, backend=backend, temperature=temp)
    (logp.sum() + ent.sum()).backward()
    engine = make_engine(backend)
    for pieces, seed in [(2, 0), (3, 1), (4, 2), (7, 3)]:
        cuts = random_cuts(vocab, pieces, seed)
        split = split_vocab_stats(engine, logits, labels, cuts, temperature=temp, entropy=True)
        assert mismatches(split[0], logp.detach()) == 0, cuts
        assert mismatches(split[1], ent.detach()) == 0, cuts
        assert mismatches(split[2], x.grad) == 0, cuts


def test_float_sum_baseline_is_not_split_invariant():
    # The same harness applied to a float sum of exp over vocabulary slices (what Megatron's and the
    # `torch` backend's TP form do) finds differing rows: the harness can see a non-invariant path.
    vocab, n = 151936, 64
    z = model_like_logits(n, vocab, torch.bfloat16, "cpu", seed=5).float()
    m = z.amax(dim=1, keepdim=True)
    whole = torch.exp(z - m).sum(dim=1)
    cuts = random_cuts(vocab, 2, 9)
    split = sum(torch.exp(z[:, a:b] - m).sum(dim=1) for a, b in itertools.pairwise(cuts))
    assert mismatches(split, whole) > 0
    # The int64 fixed-point sum over the same slices is exact.
    q = lambda t: (torch.exp(t - m) * 2.0**40).to(torch.int64).sum(dim=1)  # noqa: E731
    assert torch.equal(q(z), sum(q(z[:, a:b]) for a, b in itertools.pairwise(cuts)))


def test_torch_baseline_batch_behaviour_on_cpu_is_reported():
    # On the CPU, torch's log_softmax reduces each row with the same single-threaded vectorized loop
    # whatever the batch, so it happens to be batch-invariant here; on a GPU its reduction strategy
    # depends on the shape (see benchmarks/results for the measured GPU mismatch counts). What it is
    # not, anywhere, is split-invariant: see test_float_sum_baseline_is_not_split_invariant.
    vocab = 1031
    sizes = batch_sizes(64)
    probes = model_like_logits(3, vocab, torch.float32, "cpu", seed=1)
    fill = model_like_logits(max(sizes), vocab, torch.float32, "cpu", seed=2)
    counts = batch_invariance_mismatches(
        probes, random_labels(3, vocab, "cpu"), fill, random_labels(max(sizes), vocab, "cpu"), sizes,
        backend="torch",
    )
    assert counts["placements"] > 0 and counts["logp"] == 0


@pytest.mark.parametrize("backend,device", _targets())
def test_runs_are_deterministic(backend, device):
    vocab = 1031 if device == "cpu" else 151936
    logits = model_like_logits(17, vocab, torch.bfloat16, device, seed=4)
    labels = random_labels(17, vocab, device, seed=4)
    first = logp_and_grad(logits, labels, backend=backend)
    for _ in range(3):
        again = logp_and_grad(logits, labels, backend=backend)
        assert mismatches(again[0], first[0]) == 0 and mismatches(again[1], first[1]) == 0
