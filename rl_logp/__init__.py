"""rl-logp: selected-token log-probabilities that are the same bits in the trainer and the rollout.

Public API (`rl_logp.api`): `logprobs`, `entropy`, `logprobs_and_entropy` (autograd), `logsumexp`,
`log_normalizer`; `apply_top_k_top_p` (the top-k/top-p kept set, `rl_logp.sampling_mask`);
`LogpConfig` / `resolve_config`; the backend names. Where things live: the contract's
arithmetic in `rl_logp.contract`, the engines (`rl_logp.engine` interface, `rl_logp.chunked`, the Triton
kernels in `rl_logp.kernels`), the `torch.library` ops in `rl_logp.ops`, the vocab-parallel provider in
`rl_logp.vocab_parallel` / `rl_logp.shard_layout`, the verl and vLLM adapters in `rl_logp.integrations`,
the agreement checker in `rl_logp.check`.
"""

from rl_logp.api import entropy, log_normalizer, logprobs, logprobs_and_entropy, logsumexp
from rl_logp.backends import fused_runs_on, resolve_backend
from rl_logp.config import BACKENDS, INVARIANT_BACKENDS, LogpConfig, resolve_config
from rl_logp.sampling_mask import apply_top_k_top_p

__all__ = [
    "BACKENDS",
    "INVARIANT_BACKENDS",
    "LogpConfig",
    "apply_top_k_top_p",
    "entropy",
    "fused_runs_on",
    "log_normalizer",
    "logprobs",
    "logprobs_and_entropy",
    "logsumexp",
    "resolve_backend",
    "resolve_config",
]
__version__ = "0.2.0"
