"""The `chunked` engine: the contract in plain torch, over blocks of a fixed byte budget.

Blocks are [rows, cols] tiles sized from `chunk_bytes` and the vocabulary width only, never from N, so
the workspace is bounded whatever the batch. Whole rows are scored in one pass when a row fits in the
budget; wider rows are cut into column blocks (the exact max and the int64 sums make the cut invisible).
Runs on any device torch runs on; on a GPU it gives the same bits as the `fused` kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from rl_logp import contract
from rl_logp.engine import LogpEngine, RowStats
from rl_logp.temperature import Temperature

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

    def blocks(self, n: int, vocab: int) -> Iterator[tuple[slice, slice]]:
        """Every (rows, cols) tile of an [n, vocab] block of logits."""
        for rows in self.row_blocks(n):
            for start in range(0, vocab, self.cols):
                yield rows, slice(start, min(vocab, start + self.cols))


class ChunkedEngine(LogpEngine):
    """Pure-torch engine with a bounded workspace (see `ChunkPlan`)."""

    name = "chunked"

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes

    def _plan(self, vocab: int) -> ChunkPlan:
        return ChunkPlan.for_budget(vocab, self.chunk_bytes)

    def _max(self, x: torch.Tensor, temp: Temperature) -> torch.Tensor:
        n, vocab = x.shape
        out = torch.full((n,), contract.NEG_INF, dtype=torch.float32, device=x.device)
        for rows, cols in self._plan(vocab).blocks(n, vocab):
            block = contract.block_row_max(contract.scaled_logits(x[rows, cols], temp.divisor(rows, x.device)))
            torch.maximum(out[rows], block, out=out[rows])
        return contract.mark_bad_rows(out, temp.bad_rows())

    def shard_max(self, x: torch.Tensor, temp: Temperature) -> torch.Tensor:
        return contract.nan_as_inf(self._max(x, temp))

    def shard_sums(
        self, x: torch.Tensor, temp: Temperature, row_max: torch.Tensor, bits: int, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, vocab = x.shape
        fixed = torch.zeros(n, dtype=torch.int64, device=x.device)
        entropy_fixed = torch.zeros(n, dtype=torch.int64, device=x.device) if entropy else None
        for rows, cols in self._plan(vocab).blocks(n, vocab):
            z = contract.scaled_logits(x[rows, cols], temp.divisor(rows, x.device))
            s, e = contract.block_fixed_sums_(z, row_max[rows], bits, entropy)
            fixed[rows] += s
            if entropy:
                entropy_fixed[rows] += e
        return fixed, entropy_fixed

    def row_stats(
        self, x: torch.Tensor, temp: Temperature, labels: torch.Tensor | None, bits: int, entropy: bool
    ) -> RowStats:
        row_max = self._max(x, temp)
        fixed, entropy_fixed = self.shard_sums(x, temp, row_max, bits, entropy)
        log_sum, lse, ent = contract.finalize(row_max, fixed, entropy_fixed, bits)
        logp = None
        if labels is not None:
            everything = slice(0, x.shape[0])
            target = contract.shard_target_logit(x, labels, temp.divisor(everything, x.device))
            logp = contract.assemble_logp(target, row_max, log_sum, labels, x.shape[1])
        return RowStats(row_max=row_max, log_sum=log_sum, lse=lse, logp=logp, entropy=ent)

    def grad(
        self,
        x: torch.Tensor,
        temp: Temperature,
        labels: torch.Tensor | None,
        label_offset: int,
        vocab_total: int,
        row_max: torch.Tensor,
        log_sum: torch.Tensor,
        entropy: torch.Tensor | None,
        g_logp: torch.Tensor | None,
        g_entropy: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        n, vocab = x.shape
        everything = slice(0, n)
        divisor = temp.divisor(everything, x.device)
        if g_logp is not None:
            valid = (labels >= 0) & (labels < vocab_total)
            s_lp = contract.grad_scale(g_logp, divisor)
        if g_entropy is not None:
            s_h = contract.grad_scale(g_entropy, divisor)
        for rows, cols in self._plan(vocab).blocks(n, vocab):
            logp_part = None
            if g_logp is not None:
                logp_part = (labels[rows] - label_offset - cols.start, valid[rows], s_lp[rows])
            entropy_part = None if g_entropy is None else (entropy[rows], s_h[rows])
            block = contract.block_grad(
                x[rows, cols], temp.divisor(rows, x.device), row_max[rows], log_sum[rows], logp_part, entropy_part
            )
            out[rows, cols].copy_(block)
