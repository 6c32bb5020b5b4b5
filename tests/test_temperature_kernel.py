"""The temperature kernel (kernels/temperature.py, behind vLLM V2's patched `apply_temperature`): each row
divided in place by its temperature through the index, the bits of torch's IEEE division, rows at T = 0 or
1 untouched. Under Triton's interpreter here, compiled on a GPU."""

import pytest
import torch
from helpers import bits, model_like_logits, needs_cuda

from rl_logp.engines import fused_runs_on

DEVICES = [pytest.param("cpu", id="interpret-cpu",
                        marks=pytest.mark.skipif(not fused_runs_on(torch.device("cpu")),
                                                 reason="needs Triton's interpreter (TRITON_INTERPRET=1)")),
           pytest.param("cuda", id="cuda", marks=needs_cuda)]
TEMPERATURES = [0.7, 1.0, 0.0, 1.3, 1e-3, 3.0, -0.0, 0.9]


def _torch_division(x: torch.Tensor, index: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    t = temperature.index_select(0, index).to(torch.float32)
    return x.div(t.masked_fill(t == 0.0, 1.0).unsqueeze(1))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("device", DEVICES)
def test_rows_divided_through_the_index_with_torch_bits(device, index_dtype):
    from rl_logp.kernels.temperature import BLOCK, divide_rows_

    vocab = BLOCK + 1000 if device == "cuda" else 3000
    wide = model_like_logits(9, vocab + 64, torch.float32, device, seed=7).mul_(3)
    x = wide[:, :vocab]  # a row stride of its own
    temperature = torch.tensor(TEMPERATURES, device=device)
    index = torch.tensor([3, 1, 2, 0, 7, 6, 5, 4, 2], device=device, dtype=index_dtype)
    want = _torch_division(x, index, temperature)
    before = wide.clone()
    divide_rows_(x, index, temperature)
    assert torch.equal(bits(x), bits(want))
    assert torch.equal(bits(wide[:, vocab:]), bits(before[:, vocab:]))  # nothing past the row written
    for row in (1, 2, 8, 5):  # T = 1, 0, 0, -0.0: untouched
        assert torch.equal(bits(x[row]), bits(before[row, :vocab]))


@pytest.mark.parametrize("device", DEVICES)
def test_an_index_outside_the_temperatures_gives_nan_rows(device):
    from rl_logp.kernels.temperature import divide_rows_

    x = model_like_logits(4, 300, torch.float32, device, seed=8)
    want = x.clone()
    divide_rows_(x, torch.tensor([0, 3, -1, 1], device=device), torch.tensor([0.5, 2.0, 4.0], device=device))
    assert torch.isnan(x[[1, 2]]).all()
    assert torch.equal(bits(x[[0, 3]]), bits(want[[0, 3]] / torch.tensor([[0.5], [2.0]], device=device)))


@pytest.mark.parametrize("device", DEVICES)
def test_no_rows_or_columns_launch_nothing(device):
    from rl_logp.kernels.temperature import divide_rows_

    for shape in [(0, 10), (3, 0)]:
        x = torch.empty(shape, device=device)
        divide_rows_(x, torch.zeros(shape[0], dtype=torch.int64, device=device), torch.ones(1, device=device))
        assert x.shape == shape


@needs_cuda
def test_gpu_vllm_rows_of_a_real_vocabulary():
    from rl_logp.kernels.temperature import divide_rows_

    x = (torch.randn(257, 151936, device="cuda") * 4).float()
    temperature = torch.rand(300, device="cuda") * 2
    temperature[::7] = 0.0
    index = torch.randperm(300, device="cuda")[:257].to(torch.int32)
    want = _torch_division(x, index, temperature)
    divide_rows_(x, index, temperature)
    assert torch.equal(bits(x), bits(want))


@pytest.mark.parametrize("device", DEVICES)
def test_vllm_apply_temperature_keeps_a_plan(device, monkeypatch):
    """The adapter's `apply_temperature` (vLLM V2, at every decode step): the calls after a signature's first
    run its plan (the launch alone, `kernels.temperature.bind_divide_rows`) with torch's division bits;
    another signature binds anew; logits torch divides (fp16) keep no plan; a plan whose launch declines (the
    logits off a 16-byte boundary) gives way to the ordinary path."""
    from rl_logp import rollout_calls
    from rl_logp.integrations import vllm as adapter
    from rl_logp.kernels import temperature as module

    rollout_calls.clear()
    ordinary, divide = [], module.divide_rows_
    monkeypatch.setattr(module, "divide_rows_", lambda *args: (ordinary.append(1), divide(*args)))
    temperature = torch.tensor([0.7, 1.0, 0.0, 1.3, 2.0], device=device)
    try:
        for n, calls in ((4, 3), (3, 2)):
            for seed in range(calls):
                x = model_like_logits(n, 3000, torch.float32, device, seed=seed)
                index = torch.tensor([4, 0, 3, 1][:n], device=device)
                want = _torch_division(x, index, temperature)
                adapter.apply_temperature_ieee(x, index, temperature)
                assert torch.equal(bits(x), bits(want))
        assert len(ordinary) == 2 and len(rollout_calls._plans) == 2
        half = model_like_logits(3, 3000, torch.float16, device, seed=5)
        adapter.apply_temperature_ieee(half, torch.tensor([4, 0, 3], device=device), temperature)
        assert len(ordinary) == 2 and len(rollout_calls._plans) == 2  # torch's division, no plan
        base = model_like_logits(1, 4 * 3000 + 1, torch.float32, device, seed=6)[0]
        aligned, shifted = base[:-1].view(4, 3000), base[1:].view(4, 3000)  # the first loop's 4-row signature
        for x in (aligned, shifted):
            index = torch.tensor([4, 0, 3, 1], device=device)
            want = _torch_division(x, index, temperature)
            adapter.apply_temperature_ieee(x, index, temperature)
            assert torch.equal(bits(x), bits(want))
        assert len(ordinary) == 3  # the 4-row plan ran on the aligned logits and declined the shifted ones
    finally:
        rollout_calls.clear()
