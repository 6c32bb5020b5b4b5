"""`column_logprobs` and `full_logprobs`, the rollout's scores of several columns per row: each entry is
the bits `logprobs` gives for that column, on every invariant engine (the fused kernel's one launch under
Triton's interpreter on the CPU, on the GPU where there is one), and bad columns are clear errors."""

import pytest
import torch
from helpers import bits, invariant_targets, mismatches, model_like_logits, needs_cuda

import rl_logp


def _per_column_logprobs(x, ids, backend, temperature):
    """logprobs of each column of ids [n, K], one public call per column (the reference)."""
    return torch.stack([rl_logp.logprobs(x, ids[:, k].contiguous(), backend=backend, temperature=temperature)
                        for k in range(ids.shape[1])], dim=1)


def _rows(dtype, device, vocab=96):
    x = model_like_logits(6, vocab, dtype, device, seed=3)
    x[2] = float("-inf")  # a row with no finite max
    x[4, 7] = x[4].max()  # a tie at the max
    return x


@pytest.mark.parametrize("temperature", [None, 0.7, "rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend,device", invariant_targets())
def test_column_logprobs_are_logprobs_of_each_column(backend, device, dtype, temperature):
    x = _rows(dtype, device)
    if temperature == "rows":
        temperature = torch.tensor([0.7, 1.0, 1.3, 0.5, 2.0, 0.9], device=device)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(-2, x.shape[1] + 2, (x.shape[0], 21), generator=gen).to(device)  # a few outside [0, V)
    got = rl_logp.column_logprobs(x, ids.to(torch.int32), backend=backend, temperature=temperature)
    want = _per_column_logprobs(x, ids, backend, temperature)
    assert got.shape == ids.shape and got.dtype == torch.float32
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # logprobs' convention for a row of -inf


@pytest.mark.parametrize("backend,device", invariant_targets())
def test_column_logprobs_keep_the_lead_shape_and_any_batch(backend, device):
    x = model_like_logits(8, 64, torch.bfloat16, device, seed=4).view(2, 4, 64)
    ids = torch.randint(0, 64, (2, 4, 3), generator=torch.Generator().manual_seed(1)).to(device)
    whole = rl_logp.column_logprobs(x, ids, backend=backend)
    assert whole.shape == (2, 4, 3)
    one_row = rl_logp.column_logprobs(x[1, 2:3], ids[1, 2:3], backend=backend)
    assert torch.equal(bits(whole[1, 2:3]), bits(one_row))


@pytest.mark.parametrize("temperature", [None, 0.7])
@pytest.mark.parametrize("backend,device", invariant_targets())
def test_full_logprobs_are_logprobs_of_every_column(backend, device, temperature):
    x = _rows(torch.bfloat16, device, vocab=40)
    ids = torch.arange(x.shape[1], device=device).expand(x.shape[0], -1)
    got = rl_logp.full_logprobs(x, backend=backend, temperature=temperature)
    want = _per_column_logprobs(x, ids, backend, temperature)
    finite = torch.tensor([True, True, False, True, True, True], device=device)
    assert got.shape == x.shape
    assert torch.equal(bits(got[finite]), bits(want[finite]))
    assert torch.isnan(got[2]).all()  # as log_softmax: a row of -inf has no distribution


@pytest.mark.parametrize("temperature", [None, 1.3])
@pytest.mark.parametrize("backend,device", invariant_targets())
def test_full_logprobs_equal_the_normaliser_expression(backend, device, temperature):
    x = model_like_logits(4, 3001, torch.bfloat16, device, seed=7)
    x[1] = float("-inf")
    x[2, 5] = float("nan")
    row_max, log_sum = rl_logp.log_normalizer(x, backend=backend, temperature=temperature)
    z = x.float() if temperature is None else x.float() / torch.tensor(temperature, device=device)
    want = z.sub_(row_max[:, None]).sub_(log_sum[:, None])
    got = rl_logp.full_logprobs(x, backend=backend, temperature=temperature)
    assert got.dtype == torch.float32 and mismatches(got, want) == 0


@pytest.mark.parametrize(
    "columns,message",
    [
        (torch.zeros(4, dtype=torch.int64), "columns have shape"),
        (torch.zeros(4, 3, 2, dtype=torch.int64), "columns have shape"),
        (torch.zeros(5, 3, dtype=torch.int64), "columns have shape"),
        (torch.zeros(4, 3), "labels have dtype"),
    ],
)
def test_bad_columns_are_clear_errors(columns, message):
    with pytest.raises((TypeError, ValueError), match=message):
        rl_logp.column_logprobs(torch.zeros(4, 10), columns, backend="chunked")


def test_scores_need_an_invariant_backend():
    with pytest.raises(ValueError, match="invariant backend"):
        rl_logp.full_logprobs(torch.zeros(2, 10), backend="torch")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_scores_equal_chunked_at_a_real_vocabulary(dtype):
    x = model_like_logits(64, 151936, dtype, "cuda", seed=11)
    ids = torch.randint(0, 151936, (64, 21), device="cuda")
    for temperature in (None, 0.7):
        fused = rl_logp.column_logprobs(x, ids, backend="fused", temperature=temperature)
        assert torch.equal(bits(fused), bits(rl_logp.column_logprobs(x, ids, backend="chunked", temperature=temperature)))
        assert torch.equal(bits(fused[:, 0]), bits(rl_logp.logprobs(x, ids[:, 0].contiguous(), backend="fused",
                                                                    temperature=temperature)))
        full = rl_logp.full_logprobs(x, backend="fused", temperature=temperature)
        assert torch.equal(bits(full), bits(rl_logp.full_logprobs(x, backend="chunked", temperature=temperature)))
        assert torch.equal(bits(full.gather(1, ids)), bits(fused))


@pytest.mark.parametrize("backend,device", invariant_targets())
def test_scores_of_logits_that_require_grad_and_under_torch_compile(backend, device):
    """Logits that require grad are scored without building a graph (the scores are not differentiable),
    and a compiled caller gets eager's bits (the scores run eagerly, a graph break)."""
    x = model_like_logits(5, 211, torch.float32, device, seed=5).requires_grad_()
    ids = torch.randint(0, 211, (5, 3), device=device)
    eager_cols = rl_logp.column_logprobs(x, ids, backend=backend, temperature=0.9)
    eager_full = rl_logp.full_logprobs(x, backend=backend)
    assert not eager_cols.requires_grad and not eager_full.requires_grad

    def score(logits, columns):
        return rl_logp.column_logprobs(logits, columns, backend=backend, temperature=0.9), \
            rl_logp.full_logprobs(logits, backend=backend)

    torch._dynamo.reset()
    cols, full = torch.compile(score, backend="eager")(x.detach(), ids)
    assert torch.equal(bits(cols), bits(eager_cols)) and torch.equal(bits(full), bits(eager_full))
