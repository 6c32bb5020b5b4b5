"""The on-policy metric in verl's own `calculate_debug_metrics` (what RayPPOTrainer logs when the batch carries
rollout log-probs): exact counts of differing response tokens, padding ignored, verl's keys kept."""

import torch
import verl  # noqa: F401  (plain import: a broken verl install fails here instead of skipping)
from verl import DataProto

from rl_logp.integrations import verl as adapter
from rl_logp.integrations.verl_metrics import MAX_ABS_DIFF_KEY, MISMATCH_KEY


def _batch(old: torch.Tensor, rollout: torch.Tensor, response_mask: torch.Tensor) -> DataProto:
    batch, response = old.shape
    prompt = torch.ones(batch, 3, dtype=torch.int64)
    return DataProto.from_single_dict({
        "old_log_probs": old, "rollout_log_probs": rollout, "response_mask": response_mask,
        "responses": torch.zeros(batch, response, dtype=torch.int64),
        "attention_mask": torch.cat([prompt, response_mask], dim=1),
    })


def test_calculate_debug_metrics_counts_exactly_the_differing_response_tokens():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 9, generator=gen) * 5
    mask = torch.ones(4, 9, dtype=torch.int64)
    mask[1, 6:] = 0
    mask[3, 2:] = 0
    rollout = old.clone()
    rollout[0, 0] = torch.nextafter(old[0, 0], torch.tensor(0.0))  # one ulp apart: counted
    rollout[2, 5] = old[2, 5] - 0.25
    rollout[1, 7] = old[1, 7] + 3.0  # padding: not counted
    rollout[3, 4] = old[3, 4] + 3.0
    from verl.utils.debug import metrics

    adapter.apply(backend="chunked")
    try:
        got = metrics.calculate_debug_metrics(_batch(old, rollout, mask))
        same = metrics.calculate_debug_metrics(_batch(old, old.clone(), mask))
    finally:
        adapter.revert()
    assert got[MISMATCH_KEY] == 2
    assert got[MAX_ABS_DIFF_KEY] == 0.25
    assert got["training/rollout_probs_diff_valid"] == 1  # verl's own keys are still there
    assert same[MISMATCH_KEY] == 0 and same[MAX_ABS_DIFF_KEY] == 0.0
    stock = metrics.calculate_debug_metrics(_batch(old, rollout, mask))
    assert MISMATCH_KEY not in stock
