"""The on-policy metric: how many response tokens' rollout logp differs, bit for bit, from the trainer's.

verl 0.9.1 compares the rollout's and the actor's old log-probs in
`verl.utils.debug.metrics.calculate_debug_metrics` (called by `RayPPOTrainer` when the batch carries
`rollout_log_probs`, i.e. `actor_rollout_ref.rollout.calculate_log_probs=True`, and by the v1 trainer).
With rl-logp on, that function is wrapped so its result gains

- `rl_logp/rollout_train_mismatch_tokens`: response tokens whose fp32 rollout logp and old logp bits differ;
- `rl_logp/rollout_train_max_abs_diff`: the largest |rollout - old| over those tokens (NaN without any).

On-policy data scored by rl-logp on both sides gives 0 and 0.0; anything else is the off-policy drift.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

MISMATCH_KEY = "rl_logp/rollout_train_mismatch_tokens"
MAX_ABS_DIFF_KEY = "rl_logp/rollout_train_max_abs_diff"


def rollout_train_agreement(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """The two metrics over the tokens where `response_mask` is set (all shaped [batch, response])."""
    mask = response_mask.bool()
    rollout = rollout_log_probs.detach().to(torch.float32)
    train = old_log_probs.detach().to(device=rollout.device, dtype=torch.float32)
    differ = (rollout.view(torch.int32) != train.view(torch.int32)) & mask.to(rollout.device)
    gaps = (rollout - train).abs()[mask.to(rollout.device)]
    return {
        MISMATCH_KEY: int(differ.sum()),
        MAX_ABS_DIFF_KEY: float(gaps.max()) if gaps.numel() else float("nan"),
    }


def _response_mask(batch: Any, response_length: int) -> torch.Tensor:
    """The mask verl's `calculate_debug_metrics` uses: response_mask, else attention_mask, else all."""
    if "response_mask" in batch.keys():
        mask = batch["response_mask"]
    elif "attention_mask" in batch.keys():
        mask = batch["attention_mask"]
    else:
        mask = torch.ones_like(batch["rollout_log_probs"])
    return mask[:, -response_length:]


def wrap_calculate_debug_metrics(original: Callable) -> Callable:
    """verl's `calculate_debug_metrics(data)` plus the two rl-logp keys."""

    @functools.wraps(original)
    def calculate_debug_metrics(data: Any) -> dict:
        metrics = original(data)
        rollout = data.batch["rollout_log_probs"]
        old = data.batch["old_log_probs"]
        metrics.update(rollout_train_agreement(rollout, old, _response_mask(data.batch, rollout.shape[-1])))
        return metrics

    return calculate_debug_metrics
