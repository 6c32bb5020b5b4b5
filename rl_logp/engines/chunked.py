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
from rl_logp.engines.base import LogpEngine, RowStats
from rl_logp.request import LogpRequest

# Workspace bytes per element of a block: an fp32 copy of the logits, its int64 fixed-point terms, and on
# the CPU the fp64 argument of the exponential (`contract.exp32`).
WORKSPACE_BYTES_PER_ELEMENT = 20


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

    def shard_max(self, req: LogpRequest) -> torch.Tensor:
        x, temp = req.logits, req.temperature
        n, vocab = x.shape
        out = torch.full((n,), contract.NEG_INF, dtype=torch.float32, device=x.device)
        for rows, cols in self._plan(vocab).blocks(n, vocab):
            block = contract.block_row_max(contract.scaled_logits(x[rows, cols], temp.divisor(rows, x.device)))
            torch.maximum(out[rows], block, out=out[rows])
        return contract.mark_bad_rows(out, temp.bad_rows())

    def shard_sums(self, req: LogpRequest, row_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, temp = req.logits, req.temperature
        n, vocab = x.shape
        fixed = torch.zeros(n, dtype=torch.int64, device=x.device)
        entropy_fixed = torch.zeros(n, dtype=torch.int64, device=x.device) if req.entropy else None
        for rows, cols in self._plan(vocab).blocks(n, vocab):
            z = contract.scaled_logits(x[rows, cols], temp.divisor(rows, x.device))
            s, e = contract.block_fixed_sums_(z, row_max[rows], req.bits, req.entropy)
            fixed[rows] += s
            if req.entropy:
                entropy_fixed[rows] += e
        return fixed, entropy_fixed

    def row_stats(self, req: LogpRequest) -> RowStats:
        x = req.logits
        row_max = self.shard_max(req)
        fixed, entropy_fixed = self.shard_sums(req, row_max)
        log_sum, lse, ent = contract.finalize(row_max, fixed, entropy_fixed, req.bits)
        logp = full = None
        if req.labels is not None or req.full:
            divisor = req.temperature.divisor(slice(0, x.shape[0]), x.device)
        if req.labels is not None:
            target = contract.shard_target_logit(x, req.labels, divisor)
            logp = contract.assemble_logp(target, row_max, log_sum, req.labels, x.shape[1])
        if req.full:
            full = contract.full_logprobs(x, divisor, row_max, log_sum)
        return RowStats(row_max=row_max, log_sum=log_sum, lse=lse, logp=logp, entropy=ent, full=full)

    def grad(self, req: LogpRequest, stats: RowStats, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None,
             out: torch.Tensor) -> None:
        x, temp, labels = req.logits, req.temperature, req.labels
        n, vocab = x.shape
        divisor = temp.divisor(slice(0, n), x.device)
        if g_logp is not None:
            valid = (labels >= 0) & (labels < req.vocab_total)
            s_lp = contract.grad_scale(g_logp, divisor)
        if g_entropy is not None:
            s_h = contract.grad_scale(g_entropy, divisor)
        for rows, cols in self._plan(vocab).blocks(n, vocab):
            logp_part = None
            if g_logp is not None:
                logp_part = (labels[rows] - req.vocab_offset - cols.start, valid[rows], s_lp[rows])
            entropy_part = None if g_entropy is None else (stats.entropy[rows], s_h[rows])
            block = contract.block_grad(x[rows, cols], temp.divisor(rows, x.device), stats.row_max[rows],
                                        stats.log_sum[rows], logp_part, entropy_part)
            out[rows, cols].copy_(block)
