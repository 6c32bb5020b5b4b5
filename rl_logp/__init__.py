"""rl-logp: selected-token log-probabilities that are the same bits in the trainer and the rollout.

Public API: `logprobs` (autograd), `entropy` (autograd), `logsumexp`, `LogpConfig` / `resolve_config`, the backend names, and the contract's
partial functions in `rl_logp.contract` (for vocab-parallel and custom providers). Kernels live in
`rl_logp.kernels`, the verl and vLLM adapters in `rl_logp.integrations`, the agreement checker in
`rl_logp.check`.
"""

from rl_logp.config import BACKENDS, INVARIANT_BACKENDS, LogpConfig, resolve_config
from rl_logp.dispatch import entropy, fused_runs_on, logprobs, logsumexp, resolve_backend

__all__ = [
    "BACKENDS",
    "INVARIANT_BACKENDS",
    "LogpConfig",
    "entropy",
    "fused_runs_on",
    "logprobs",
    "logsumexp",
    "resolve_backend",
    "resolve_config",
]
__version__ = "0.1.0"
