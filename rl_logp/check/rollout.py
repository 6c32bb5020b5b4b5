"""The rollout side of `rl_logp.check`: a provider that scores the tokens a rollout sampled.

`rollout_provider()` returns vLLM's own sampler code under rl-logp's patch when vLLM is installed
(`rl_logp.integrations.vllm_rollout.VllmRollout`, imported here only when asked for: the core does not
depend on the adapter), else the training function on full-vocab logits (`SameFunctionRollout`).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from rl_logp import logprobs
from rl_logp.check.cases import Sampling
from rl_logp.sampling_mask import apply_top_k_top_p

VLLM_PROVIDER = "rl_logp.integrations.vllm_rollout"


class SameFunctionRollout:
    """The rollout stand-in without vLLM: the training function on full-vocab logits."""

    def __init__(self, why: str) -> None:
        self.description = f"rl_logp.logprobs on full-vocab logits (vLLM sampler not available: {why})"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        if sampling.masks:
            logits = apply_top_k_top_p(logits, temperature=sampling.temperature, top_k=sampling.top_k,
                                       top_p=sampling.top_p)
            return logprobs(logits, labels, backend="auto")
        return logprobs(logits, labels, backend="auto", temperature=sampling.temperature)


def rollout_provider(backend: str = "auto") -> Any:
    """The vLLM sampler when the adapter can run it, else the training function on full-vocab logits."""
    try:
        return importlib.import_module(VLLM_PROVIDER).VllmRollout(backend)
    except ImportError as err:
        return SameFunctionRollout(str(err))


def __getattr__(name: str) -> Any:
    """`rl_logp.check.rollout.VllmRollout`, resolved when first used (tests/test_check_cli.py wraps its
    `__call__` through this name)."""
    if name == "VllmRollout":
        return importlib.import_module(VLLM_PROVIDER).VllmRollout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
