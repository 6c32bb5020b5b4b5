"""`vllm.general_plugins` entry point: patch vLLM in every vLLM process when `RL_LOGP_BACKEND` is set."""

from __future__ import annotations

import os


def load() -> None:
    """Apply the vLLM patch from the environment (idempotent); a no-op without RL_LOGP_BACKEND."""
    if not os.environ.get("RL_LOGP_BACKEND"):
        return
    from rl_logp.integrations import vllm as adapter

    if adapter.active_config() is None:
        adapter.apply()
