"""Test session set-up: on a machine without CUDA, Triton kernels run under its interpreter.

TRITON_INTERPRET must be set before Triton decorates the kernels, so it is set here, first. The fixture
`shuffled_programs` runs the interpreter's programs out of grid order (the split plans' arrival tests).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def shuffled_programs(monkeypatch) -> list[list[int]]:
    """Triton's interpreter runs each launch's programs in a new random order (fixed seed) instead of in
    grid order, so that any program of a row, not only its last range, can be the last to arrive. Returns
    the orders, one list of linear program ids per launch."""
    from triton.runtime import interpreter

    builder, gen, orders = interpreter.interpreter_builder, torch.Generator().manual_seed(5), []
    set_grid_idx = builder.set_grid_idx

    def shuffled(x, y, z):
        _, ny, nz = builder.grid_dim
        if (x, y, z) == (0, 0, 0):
            orders.append(torch.randperm(builder.grid_dim[0] * ny * nz, generator=gen).tolist())
        i = orders[-1][(x * ny + y) * nz + z]
        set_grid_idx(i // (ny * nz), i // nz % ny, i % nz)

    monkeypatch.setattr(builder, "set_grid_idx", shuffled)
    return orders
