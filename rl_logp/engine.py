"""The interface every invariant engine implements, and the statistics it returns.

An engine works on a 2-D block of logits `x` [n, c] (a whole vocabulary or one rank's contiguous slice)
with a `Temperature`. The ops (`rl_logp.ops`) and the vocab-parallel provider (`rl_logp.vocab_parallel`)
call these methods; two engines that keep the contract (`rl_logp.contract`) give the same bits on the
same device.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from rl_logp.temperature import Temperature


@dataclasses.dataclass
class RowStats:
    """Per-row results of a forward over whole rows (fp32 [n] each)."""

    row_max: torch.Tensor
    log_sum: torch.Tensor
    lse: torch.Tensor
    logp: torch.Tensor | None
    entropy: torch.Tensor | None


class LogpEngine(abc.ABC):
    """Statistics of whole rows, of vocabulary shards, and the row-local gradient."""

    name = "engine"

    @abc.abstractmethod
    def row_stats(
        self, x: torch.Tensor, temp: Temperature, labels: torch.Tensor | None, bits: int, entropy: bool
    ) -> RowStats:
        """M, L, lse and, as asked, logp of `labels` (int64 [n]) and the entropy of whole rows."""

    @abc.abstractmethod
    def shard_max(self, x: torch.Tensor, temp: Temperature) -> torch.Tensor:
        """Max of z per row of a shard, fp32 [n] (NaN rows as +inf; -inf for a zero-width shard)."""

    @abc.abstractmethod
    def shard_sums(
        self, x: torch.Tensor, temp: Temperature, row_max: torch.Tensor, bits: int, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(S, E) per row of a shard given the global max, int64 [n]; E is None without entropy."""

    @abc.abstractmethod
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
        """Write dz (logp part with g_logp, entropy part with g_entropy, or both) into `out` (may be x).

        `labels` are global column ids; this block holds columns [label_offset, label_offset + c) of a
        vocabulary of `vocab_total` columns.
        """
