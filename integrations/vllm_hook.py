"""`vllm.general_plugins` entry point: patch vLLM in every vLLM process when `RL_LOGP_BACKEND` is set.

`RL_LOGP_VLLM_SAMPLING_MASK=0` keeps vLLM's own top-k / top-p (see `rl_logp.integrations.vllm.apply`).
"""

from __future__ import annotations

import os

SAMPLING_MASK_OFF = ("0", "false", "no", "off")


def load() -> None:
    """Apply the vLLM patch from the environment (idempotent); a no-op without RL_LOGP_BACKEND."""
    if not os.environ.get("RL_LOGP_BACKEND"):
        return
    from rl_logp.integrations import vllm as adapter

    if adapter.active_config() is None:
        mask = os.environ.get("RL_LOGP_VLLM_SAMPLING_MASK", "1").strip().lower() not in SAMPLING_MASK_OFF
        adapter.apply(sampling_mask=mask)
