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
