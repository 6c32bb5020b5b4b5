"""The Megatron engine's logits step with the temperature handed to rl-logp instead of divided in place.

verl 0.9.1's `MegatronEngineWithLMHead._lm_head_logits_processor` (verl/workers/engine/megatron/
transformer_impl.py:1190-1245) divides this rank's vocabulary shard of the logits by bf16(T) in place
(`logits.div_(temperature.unsqueeze(-1).to(logits.dtype))`, line 1209), so no rollout engine's logp can
match it at T != 1. The replacement, for the calls rl-logp serves whole (no top-k distillation, no Σπ²):
no division; logp and entropy from one `rl_logp.logprobs_and_entropy` call on Megatron's TP group with
`temperature=T` (the contract's fp32(x)/T inside; one read; in-place backward into the logits, which
only rl-logp reads then, as Megatron's own vocab-parallel cross entropy does). With top-k distillation
or Σπ² it calls verl's own method (bf16 division; the patched vocab-parallel functions score the
result) after the strict-mode audit. Run with megatron-core 0.18.0's parallel state at TP = 2 and 3
(tests/test_verl_megatron.py) and at TP = 1 on the GPU (benchmarks/bench_verl_step.py --suites megatron).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

import rl_logp
from rl_logp import LogpConfig

from .verl_functions import megatron_tp_group
from .verl_step import Auditor


def wrap_lm_head_logits_processor(original: Callable, config: LogpConfig, auditor: Auditor) -> Callable:
    """`_lm_head_logits_processor` with verl 0.9.1's signature; see the module docstring."""

    @functools.wraps(original)
    def _lm_head_logits_processor(self, logits, label, temperature, *, calculate_sum_pi_squared: bool,
                                  calculate_entropy: bool, distillation_use_topk: bool, distillation_only: bool,
                                  logits_processor_func: Callable, batch, data_format: str) -> dict:
        if distillation_use_topk or calculate_sum_pi_squared:
            if distillation_use_topk:
                auditor.bypass("Megatron distillation top-k logits processor (distillation_use_topk=True)",
                               "it scores the student logits with Megatron's own vocab-parallel softmax",
                               "use a distillation loss without top-k")
            if calculate_sum_pi_squared:
                auditor.bypass("vocab_parallel_sum_pi_squared (calculate_sum_pi_squared=True)",
                               "rl-logp has no vocab-parallel logsumexp for it",
                               "set actor_rollout_ref.actor.calculate_sum_pi_squared=False")
            return original(self, logits, label, temperature, calculate_sum_pi_squared=calculate_sum_pi_squared,
                            calculate_entropy=calculate_entropy, distillation_use_topk=distillation_use_topk,
                            distillation_only=distillation_only, logits_processor_func=logits_processor_func,
                            batch=batch, data_format=data_format)
        t = torch.where(temperature <= 0, torch.full_like(temperature, 1e-8), temperature)  # verl's guard
        group = megatron_tp_group()
        out = {}
        if calculate_entropy and not distillation_only:
            out["log_probs"], out["entropy"] = rl_logp.logprobs_and_entropy(
                logits, label, temperature=t, tp_group=group, config=config, inplace_backward=True
            )
        elif calculate_entropy:
            out["entropy"] = rl_logp.entropy(logits, temperature=t, tp_group=group, config=config)
        elif not distillation_only:
            out["log_probs"] = rl_logp.logprobs(
                logits, label, temperature=t, tp_group=group, config=config, inplace_backward=True
            )
        return out

    return _lm_head_logits_processor
