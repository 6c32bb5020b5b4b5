"""verl adapter: route verl's `logprobs_from_logits` (FSDP, automodel, torchtitan engines, naive rollout,
prefix grouper), its `entropy_from_logits` (and the chunked variant; batch-invariant entropy from
`rl_logp.entropy`) and Megatron's `vocab_parallel_log_probs_from_logits` through rl-logp, and make the FSDP
engine's temperature step the contract's `fp32(x) / T`: verl 0.9.1 divides bf16 logits by bf16(T)
(T = 0.7 becomes 0.69921875), which no rollout engine does, so at T != 1 its logp cannot equal vLLM's.

    from rl_logp.integrations import verl as rl_logp_verl
    rl_logp_verl.apply(backend="fused")    # ... and rl_logp_verl.revert()

Processes you do not control get it from the `verl.plugins` entry point (`rl_logp.integrations.verl_hook`)
when `RL_LOGP_BACKEND` is set. The replacements keep verl's signatures, shapes and fp32 results.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from rl_logp.config import LogpConfig, resolve_config
from rl_logp.dispatch import entropy, logprobs, resolve_backend

from .patching import PatchSet

VERL_FSDP_ENGINE = "verl.workers.engine.fsdp.transformer_impl"
logger = logging.getLogger("rl_logp.verl")
_patches = PatchSet()
_active: LogpConfig | None = None


def make_logprobs_from_logits(config: LogpConfig):
    """A drop-in for verl's `logprobs_from_logits(logits, labels, inplace_backward=True)`."""

    def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True):
        # verl's default inplace_backward=True is safe for verl's callers only when nothing else saved the
        # logits; rl-logp's version bump turns an unsafe use into an autograd error instead of bad grads.
        return logprobs(logits, labels, config=config, inplace_backward=inplace_backward)

    return logprobs_from_logits


def make_entropy_from_logits(config: LogpConfig):
    """A drop-in for verl's `entropy_from_logits(logits)` and `..._with_chunking(logits, chunk_size)`."""

    def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
        return entropy(logits, config=config)

    return entropy_from_logits


def scale_logits_by_temperature(logits: torch.Tensor, temperature: torch.Tensor, *, is_unit_temperature: bool):
    """A drop-in for the FSDP engine's `_scale_logits_by_temperature`: fp32 logits divided by the fp32
    temperature (IEEE), the `z` that `rl_logp.logprobs(x, y, temperature=T)` and vLLM's processed_logprobs
    mode score. The result is fp32, one bf16 logits-sized buffer more than verl's bf16 quotient."""
    if is_unit_temperature:
        return logits
    return logits.to(torch.float32) / temperature.clamp(min=1e-8).to(torch.float32)


def make_vocab_parallel_log_probs_from_logits(config: LogpConfig, group_getter=None):
    """A drop-in for `verl.utils.megatron.tensor_parallel.vocab_parallel_log_probs_from_logits`."""

    def vocab_parallel_log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor):
        if group_getter is None:
            from megatron.core import parallel_state as mpu

            group = mpu.get_tensor_model_parallel_group()
        else:
            group = group_getter()
        return logprobs(logits, labels, config=config, tp_group=group)

    return vocab_parallel_log_probs_from_logits


def apply(backend: str | None = None, config: LogpConfig | dict[str, Any] | None = None, **options: Any) -> LogpConfig:
    """Patch verl (idempotent: a second call re-points the patches at the new config). Returns the config."""
    global _active
    cfg = resolve_config(config, backend=backend, **options)
    revert()
    import verl.utils.torch_functional as tf

    original = tf.logprobs_from_logits
    n = _patches.replace_everywhere(original, make_logprobs_from_logits(cfg))
    entropy_fn = make_entropy_from_logits(cfg)
    for name in ("entropy_from_logits", "entropy_from_logits_with_chunking"):
        if hasattr(tf, name):
            n += _patches.replace_everywhere(getattr(tf, name), entropy_fn)
    try:
        import verl.utils.megatron.tensor_parallel as megatron_tp
    except ImportError:
        megatron_tp = None  # Megatron-LM is not installed: nothing to patch on that side
    if megatron_tp is not None:
        mp_original = megatron_tp.vocab_parallel_log_probs_from_logits
        n += _patches.replace_everywhere(mp_original, make_vocab_parallel_log_probs_from_logits(cfg))
    engine = _import_fsdp_engine()
    if engine is not None and hasattr(engine, "_scale_logits_by_temperature"):
        n += _patches.replace_everywhere(engine._scale_logits_by_temperature, scale_logits_by_temperature)
    _active = cfg
    where = "cuda" if torch.cuda.is_available() else "cpu"
    logger.warning(
        "rl_logp: verl logprobs_from_logits -> rl_logp backend=%s (%s on %s), %d bindings patched",
        cfg.backend, resolve_backend(cfg.backend, torch.device(where)), where, n,
    )
    return cfg


def _import_fsdp_engine():
    try:
        return importlib.import_module(VERL_FSDP_ENGINE)
    except ImportError:
        return None  # this verl has no FSDP engine module (or its dependencies are missing)


def revert() -> None:
    """Restore every verl binding `apply` replaced."""
    global _active
    _patches.revert()
    _active = None


def active_config() -> LogpConfig | None:
    """The config of the current patch, or None when verl is not patched."""
    return _active
