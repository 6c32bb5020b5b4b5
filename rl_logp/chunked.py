"""The `chunked` backend: the contract in plain torch, over blocks of a fixed byte budget.

Blocks are [rows, cols] tiles sized from `chunk_bytes` and the vocabulary width only, never from N, so
the workspace is bounded whatever the batch. Whole rows are scored in one pass when a row fits in the
budget; wider rows are cut into column blocks (the exact max and the int64 sum make the cut invisible).
Runs on any device torch runs on; on a GPU it gives the same bits as the `fused` kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from rl_logp.contract import (
    NEG_INF,
    block_entropy_grad,
    block_entropy_sum_,
    block_fixed_sum_,
    block_grad,
    block_row_max,
    scaled_logits,
)
from rl_logp.engine import LogpEngine

# Workspace bytes per element of a block: an fp32 copy of the logits plus its int64 fixed-point terms.
WORKSPACE_BYTES_PER_ELEMENT = 12


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """Tile shape for a vocabulary width under a byte budget."""

    rows: int
    cols: int

    @classmethod
    def for_budget(cls, vocab: int, chunk_bytes: int) -> ChunkPlan:
        elements = max(1, chunk_bytes // WORKSPACE_BYTES_PER_ELEMENT)
        cols = max(1, min(vocab, elements))
        return cls(rows=max(1, elements // cols), cols=cols)

    @property
    def workspace_bytes(self) -> int:
        return self.rows * self.cols * WORKSPACE_BYTES_PER_ELEMENT

    def row_blocks(self, n: int) -> Iterator[slice]:
        for start in range(0, n, self.rows):
            yield slice(start, min(n, start + self.rows))

    def col_blocks(self, vocab: int) -> Iterator[slice]:
        for start in range(0, vocab, self.cols):
            yield slice(start, min(vocab, start + self.cols))

    def blocks(self, n: int, vocab: int) -> Iterator[tuple[slice, slice]]:
        """Every (rows, cols) tile of an [n, vocab] block of logits."""
        for rows in self.row_blocks(n):
            for cols in self.col_blocks(vocab):
                yield rows, cols


def _rows_of(temperature: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if temperature is None else temperature[rows]


class ChunkedEngine(LogpEngine):
    """Pure-torch engine with a bounded workspace (see `ChunkPlan`)."""

    name = "chunked"

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes

    def plan(self, vocab: int) -> ChunkPlan:
        return ChunkPlan.for_budget(vocab, self.chunk_bytes)

    def row_max(self, x: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
        n, vocab = x.shape
        out = torch.full((n,), NEG_INF, dtype=torch.float32, device=x.device)
        for rows, cols in self.plan(vocab).blocks(n, vocab):
            block = block_row_max(scaled_logits(x[rows, cols], _rows_of(temperature, rows)))
            torch.maximum(out[rows], block, out=out[rows])
        return out

    def _integer_sum(self, x, temperature, row_max, bits, block_sum_) -> torch.Tensor:
        """Per-row int64 sum of `block_sum_(z, M, bits)` over all tiles (exact: tiling is invisible)."""
        n, vocab = x.shape
        out = torch.zeros(n, dtype=torch.int64, device=x.device)
        for rows, cols in self.plan(vocab).blocks(n, vocab):
            z = scaled_logits(x[rows, cols], _rows_of(temperature, rows))
            out[rows] += block_sum_(z, row_max[rows], bits)
        return out

    def fixed_sum(
        self, x: torch.Tensor, temperature: torch.Tensor | None, row_max: torch.Tensor, bits: int
    ) -> torch.Tensor:
        return self._integer_sum(x, temperature, row_max, bits, block_fixed_sum_)

    def row_stats(
        self, x: torch.Tensor, temperature: torch.Tensor | None, bits: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, vocab = x.shape
        plan = self.plan(vocab)
        if vocab == 0 or plan.cols < vocab:
            return super().row_stats(x, temperature, bits)
        row_max = torch.empty(n, dtype=torch.float32, device=x.device)
        fixed = torch.empty(n, dtype=torch.int64, device=x.device)
        for rows in plan.row_blocks(n):
            z = scaled_logits(x[rows], _rows_of(temperature, rows))
            row_max[rows] = block_row_max(z)
            fixed[rows] = block_fixed_sum_(z, row_max[rows], bits)
        return row_max, fixed

    def grad(
        self,
        x: torch.Tensor,
        temperature: torch.Tensor | None,
        lse_for_grad: torch.Tensor,
        local_labels: torch.Tensor,
        grad_scale: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        n, vocab = x.shape
        for rows, cols in self.plan(vocab).blocks(n, vocab):
            block = block_grad(
                x[rows, cols],
                _rows_of(temperature, rows),
                lse_for_grad[rows],
                local_labels[rows] - cols.start,
                grad_scale[rows],
            )
            out[rows, cols].copy_(block)

    def entropy_sum(
        self, x: torch.Tensor, temperature: torch.Tensor | None, row_max: torch.Tensor, bits: int
    ) -> torch.Tensor:
        """sum_j trunc(exp(z - M) (z - M) 2^F) per row, int64 (see contract.block_entropy_sum_)."""
        return self._integer_sum(x, temperature, row_max, bits, block_entropy_sum_)

    def entropy_grad(self, x, temperature, lse, entropy, grad_scale, out) -> None:
        """Write the entropy's gradient block by block into `out`."""
        n, vocab = x.shape
        for rows, cols in self.plan(vocab).blocks(n, vocab):
            block = block_entropy_grad(
                x[rows, cols], _rows_of(temperature, rows), lse[rows], entropy[rows], grad_scale[rows]
            )
            out[rows, cols].copy_(block)
