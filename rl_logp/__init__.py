"""rl-logp: selected-token log-probabilities that are the same bits in the trainer and the rollout.

Public API (`rl_logp.api`): `logprobs`, `entropy`, `logprobs_and_entropy` (autograd), `logsumexp`,
`log_normalizer`, `column_logprobs` / `full_logprobs` (a rollout's scores, one launch); `apply_top_k_top_p`
(the top-k/top-p kept set, `rl_logp.sampling_mask`); `LogpConfig` / `resolve_config`; the backend names;
`linear_logits` / `linear_logprobs` (the lm_head's logits from a batch-invariant matmul, and their logp
and entropy without a logits-sized buffer, `rl_logp.linear`). Where things live (docs/design.md maps every
module): a call becomes one `LogpRequest` (`rl_logp.request`), scored by the `torch.library` ops
(`rl_logp.ops`) through an engine (`rl_logp.engines`: the pure-torch `chunked` engine, and the `fused`
engine over the Triton kernels of `rl_logp.kernels`); the contract's arithmetic is `rl_logp.contract`; the
vocab-parallel forward and the TP agreement are `rl_logp.vocab_parallel` / `rl_logp.shard_layout`; the
verl and vLLM adapters are `rl_logp.integrations`; the agreement checker is `rl_logp.check`.
"""

from rl_logp.api import (
    column_logprobs,
    entropy,
    full_logprobs,
    log_normalizer,
    logprobs,
    logprobs_and_entropy,
    logsumexp,
)
from rl_logp.config import BACKENDS, INVARIANT_BACKENDS, LogpConfig, resolve_config
from rl_logp.engines import fused_runs_on, resolve_backend
from rl_logp.linear import linear_logits, linear_logprobs
from rl_logp.sampling_mask import apply_top_k_top_p

__all__ = [
    "BACKENDS",
    "INVARIANT_BACKENDS",
    "LogpConfig",
    "apply_top_k_top_p",
    "column_logprobs",
    "entropy",
    "full_logprobs",
    "fused_runs_on",
    "linear_logits",
    "linear_logprobs",
    "log_normalizer",
    "logprobs",
    "logprobs_and_entropy",
    "logsumexp",
    "resolve_backend",
    "resolve_config",
]
__version__ = "0.3.0"
