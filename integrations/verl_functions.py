"""Drop-ins for verl 0.9.1's logits-scoring functions, built for one `LogpConfig`.

Each keeps verl's signature and output shape and returns fp32. Inside an FSDP-engine step they follow the
step's `StepPlan` (`integrations.verl_step`): deferred temperature, logp and entropy from one read,
in-place backward only where rl-logp's node is the logits' only autograd consumer; in a bypassed step
the temperature step is verl's own and the others score the logits it returns. Outside a step (other
engines, the naive rollout, user code) they score the logits they are given, out of place.

verl's originals, for reference (verl/utils/torch_functional.py unless named):
`logprobs_from_logits` line 73, `entropy_from_logits` 231, `entropy_from_logits_with_chunking` 248,
`calculate_sum_pi_squared_from_logits` 690; `_scale_logits_by_temperature`
verl/workers/engine/fsdp/transformer_impl.py:98; `vocab_parallel_log_probs_from_logits` and
`vocab_parallel_entropy[_with_chunking]` verl/utils/megatron/tensor_parallel.py:201, 142, 154;
`FusedLinearForPPO.forward` verl/utils/experimental/torch_functional.py:229 and `linear_cross_entropy`
verl/utils/kernel/linear_cross_entropy.py:119 (verl's fused heads, `use_fused_kernels=True`: logp and
entropy from the hidden states and the lm_head's weight, no logits), both `rl_logp.linear_logprobs`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

import rl_logp
from rl_logp import LogpConfig

from .verl_step import current_plan


def make_logprobs_from_logits(config: LogpConfig) -> Callable:
    """`logprobs_from_logits(logits, labels, inplace_backward=True)`."""

    def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True):
        plan = current_plan()
        if plan is None:
            return rl_logp.logprobs(logits, labels, config=config)
        served = plan.take_logp(logits, labels)
        if served is not None:
            return served
        return rl_logp.logprobs(
            logits, labels, config=config,
            temperature=plan.temperature_for(logits, "logprobs_from_logits"),
            inplace_backward=inplace_backward and plan.inplace_ok(logits),
        )

    return logprobs_from_logits


def make_entropy_from_logits(config: LogpConfig) -> Callable:
    """`entropy_from_logits(logits)`, `entropy_from_logits_with_chunking(logits, chunk_size)` and the FSDP
    engine's `compute_entropy_from_logits` (verl's `chunk_size` is a memory knob; rl-logp's workspace is
    bounded by `config.chunk_bytes`)."""

    def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
        plan = current_plan()
        if plan is None:
            return rl_logp.entropy(logits, config=config)
        if plan.combines(logits):
            logp, entropy = rl_logp.logprobs_and_entropy(
                logits, plan.labels, config=config, temperature=plan.temperature,
                inplace_backward=plan.inplace_ok(logits),
            )
            plan.keep_logp(logp)
            return entropy
        return rl_logp.entropy(logits, config=config, temperature=plan.temperature_for(logits, "entropy_from_logits"))

    return entropy_from_logits


def make_sum_pi_squared(config: LogpConfig) -> Callable:
    """`calculate_sum_pi_squared_from_logits(logits)`: sum_j p_j^2 = exp(lse(2z) - 2 lse(z)), verl's
    identity, with both lse the contract's. lse(2z) is `logsumexp(x, temperature=T/2)`: x/(T/2) and
    2(x/T) are the same fp32 number (scaling by 2 is exact), so it is invariant like lse(z). Not
    differentiable: verl 0.9.1 computes it only in `compute_log_prob` (no grad) as data for the optimal
    token baseline. Returns fp32 (verl returns the logits' dtype; its caller casts to fp32)."""

    def calculate_sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and logits.requires_grad:
            raise RuntimeError(
                "rl_logp: calculate_sum_pi_squared_from_logits is not differentiable under rl-logp "
                "(verl 0.9.1 computes it only under no_grad); call it under torch.no_grad() or on "
                "logits.detach(), or unset RL_LOGP_BACKEND"
            )
        plan = current_plan()
        temperature = plan.temperature_for(logits, "calculate_sum_pi_squared_from_logits") if plan else None
        if temperature is None:
            temperature = 1.0
        lse = rl_logp.logsumexp(logits, config=config, temperature=temperature)
        lse_twice = rl_logp.logsumexp(logits, config=config, temperature=temperature * 0.5)
        return torch.exp(lse_twice - 2.0 * lse)

    return calculate_sum_pi_squared_from_logits


def make_scale_logits_by_temperature(verl_scale: Callable) -> Callable:
    """The FSDP engine's `_scale_logits_by_temperature(logits, temperature, *, is_unit_temperature)`;
    `verl_scale` is verl's own. In a bypassed step (`StepPlan.verl_scaling`) verl's runs, so every consumer
    gets the logits verl gives it. Where the step's plan defers the temperature the logits come back
    unchanged and T (clamped at 1e-8, as verl does) goes to the consumers; elsewhere (no plan, or a plan
    that cannot defer) the contract's `fp32(x) / T` is materialised (one bf16 logits-sized buffer more
    than verl)."""

    def _scale_logits_by_temperature(
        logits: torch.Tensor, temperature: torch.Tensor, *, is_unit_temperature: bool
    ) -> torch.Tensor:
        plan = current_plan()
        deferred = None
        if plan is not None and plan.verl_scaling:
            out = verl_scale(logits, temperature, is_unit_temperature=is_unit_temperature)
        elif is_unit_temperature:
            out = logits
        elif plan is not None and plan.defer_temperature:
            out = logits
            t = temperature.clamp(min=1e-8).to(torch.float32)
            deferred = torch.broadcast_to(t, (*logits.shape[:-1], 1))[..., 0]
        else:
            out = logits.to(torch.float32) / temperature.clamp(min=1e-8).to(torch.float32)
        if plan is not None:
            plan.bind(out, deferred)
        return out

    return _scale_logits_by_temperature


def megatron_tp_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_group()


def make_vocab_parallel_log_probs_from_logits(config: LogpConfig) -> Callable:
    """`vocab_parallel_log_probs_from_logits(logits, labels)` on Megatron's TP group."""

    def vocab_parallel_log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return rl_logp.logprobs(logits, labels, config=config, tp_group=megatron_tp_group())

    return vocab_parallel_log_probs_from_logits


def make_vocab_parallel_entropy(config: LogpConfig) -> Callable:
    """`vocab_parallel_entropy(logits)` and `vocab_parallel_entropy_with_chunking(logits, chunk_size)`:
    the vocab-parallel entropy of the contract (all-reduce MAX, SUM of the int64 S and E)."""

    def vocab_parallel_entropy(vocab_parallel_logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
        return rl_logp.entropy(vocab_parallel_logits, config=config, tp_group=megatron_tp_group())

    return vocab_parallel_entropy


def make_fused_linear_for_ppo(config: LogpConfig) -> Callable:
    """`FusedLinearForPPO.forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0)` for every
    `impl_backend` (torch, liger): (log_probs, entropy) of the hidden states' logits at `temperature`
    (the contract's fp32(x) / T), fp32, the labels' shape."""

    def forward(self, hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor,
                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        return rl_logp.linear_logprobs(hidden_states, vocab_weights, input_ids, temperature=temperature, entropy=True,
                                       config=config)

    return forward


def make_linear_cross_entropy(config: LogpConfig) -> Callable:
    """`linear_cross_entropy(hidden, weight, labels, temperature, reduction, dist_process_group)` (the
    `triton` fused backend, and Megatron's fused forward with its TP group: `weight` is the rank's vocabulary
    rows, the gradient of `hidden` the rank's partial, as verl's kernel returns it). Only reduction="none",
    the one verl 0.9.1 uses."""

    def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             temperature: float = 1.0, reduction: str = "none",
                             dist_process_group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if reduction != "none":
            raise ValueError(
                f"rl_logp: linear_cross_entropy(reduction={reduction!r}) is not served by rl-logp; use "
                "reduction='none' and reduce the per-token values, or unset RL_LOGP_BACKEND"
            )
        return rl_logp.linear_logprobs(hidden, weight, labels, temperature=temperature, entropy=True,
                                       tp_group=dist_process_group, config=config)

    return linear_cross_entropy


def make_refusal(site: str, message: str) -> Callable:
    """Stands in for `site` when rl-logp was asked for but misconfigured: every call raises `message`."""

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{message} (raised by the rl-logp stand-in for verl's {site})")

    refuse.__name__ = site.rsplit(".", 1)[-1]
    return refuse
