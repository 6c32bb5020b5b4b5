"""The interface every invariant engine implements, and the statistics it returns.

An engine scores one `LogpRequest` (`rl_logp.request`): its logits are a 2-D block [n, c], a whole
vocabulary or one rank's contiguous slice. The ops (`rl_logp.ops`) and the vocab-parallel provider
(`rl_logp.vocab_parallel`) call these methods; two engines that keep the contract (`rl_logp.contract`)
give the same bits on the same device.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence

import torch

from rl_logp.request import LogpRequest


@dataclasses.dataclass(slots=True)
class RowStats:
    """Per-row results of a forward over whole rows (fp32 [n] each; None where not asked for); `logp` has
    the labels' shape ([n], or [n, K] for K labels per row), `full` every column's logprob ([n, c])."""

    row_max: torch.Tensor | None = None
    log_sum: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    full: torch.Tensor | None = None


class LogpEngine(abc.ABC):
    """Statistics of whole rows, of vocabulary shards, and the row-local gradient."""

    name = "engine"

    @abc.abstractmethod
    def row_stats(self, req: LogpRequest) -> RowStats:
        """Of whole rows: logp of `req.labels` (given), the entropy (`req.entropy`), M, L, lse
        (`req.normalizer`) and every column's logprob (`req.full`); engines may fill more than asked."""

    @abc.abstractmethod
    def shard_max(self, req: LogpRequest) -> torch.Tensor:
        """Max of z per row of a shard, fp32 [n] (NaN rows as NaN; -inf for a zero-width shard)."""

    @abc.abstractmethod
    def shard_sums(self, req: LogpRequest, row_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(S, E) per row of a shard given the global max, int64 [n]; E is None without `req.entropy`."""

    def bind_scores(self, req: LogpRequest, out: torch.Tensor) -> Callable[[Sequence[torch.Tensor]], bool] | None:
        """A repeatable form of `row_stats(req)` for a request of one output `out` (logp of the labels, or
        with `req.full` every column's) that just ran: called with (logits, labels, out) (or (logits, out)
        without labels) of the request's shapes, it writes `out` and returns True, or returns False having
        done nothing. None (the default): this engine has none."""
        return None

    @abc.abstractmethod
    def grad(self, req: LogpRequest, stats: RowStats, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None,
             out: torch.Tensor) -> None:
        """Write dz (logp part with g_logp, entropy part with g_entropy, or both) into `out` (may be the
        logits), from the forward's M, L and entropy in `stats`."""
