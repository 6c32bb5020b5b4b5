"""The interface every invariant backend implements: per-row statistics and the row-local backward.

An engine works on a 2-D block of logits `x` [n, c] (a whole vocabulary or one rank's slice) with an
optional per-row fp32 temperature [n]. The dispatch (`rl_logp.dispatch`) and the vocab-parallel
provider (`rl_logp.vocab_parallel`) combine these pieces exactly as `rl_logp.contract` prescribes, so
two engines that keep the contract give the same bits on the same device.
"""

from __future__ import annotations

import torch


class LogpEngine:
    """Base class: `row_stats` defaults to two calls; engines that can do both in one pass override it."""

    name = "engine"

    def row_max(self, x: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
        """max_j z[j] per row, fp32 [n]; -inf for a zero-width slice."""
        raise NotImplementedError

    def fixed_sum(
        self, x: torch.Tensor, temperature: torch.Tensor | None, row_max: torch.Tensor, bits: int
    ) -> torch.Tensor:
        """sum_j trunc(exp(z[j] - M) * 2^F) per row given the (global) max M, int64 [n]."""
        raise NotImplementedError

    def row_stats(
        self, x: torch.Tensor, temperature: torch.Tensor | None, bits: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(M, S) of whole rows."""
        row_max = self.row_max(x, temperature)
        return row_max, self.fixed_sum(x, temperature, row_max, bits)

    def grad(
        self,
        x: torch.Tensor,
        temperature: torch.Tensor | None,
        lse_for_grad: torch.Tensor,
        local_labels: torch.Tensor,
        grad_scale: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Write (onehot - exp(z - lse)) * grad_scale into `out` (same shape as x; may alias x)."""
        raise NotImplementedError
