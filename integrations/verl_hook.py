"""Import hook for verl workers: the `verl.plugins` entry point and the
`actor_rollout_ref.model.external_lib=rl_logp.integrations.verl_hook` route.

Patches verl once per process when `RL_LOGP_BACKEND` is set (other `RL_LOGP_*` variables tune it);
does nothing otherwise, so installing rl-logp never changes verl by itself.
"""

from __future__ import annotations

import os


def load() -> None:
    """Entry point: apply the verl patch from the environment (idempotent)."""
    if not os.environ.get("RL_LOGP_BACKEND"):
        return
    from rl_logp.integrations import verl as adapter

    if adapter.active_config() is None:
        adapter.apply()


load()
