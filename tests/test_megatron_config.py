"""The Megatron recipe overlay (configs/rl_logp_grpo_megatron.yaml) composes with the installed verl from the
documented command and puts the worker hook and the RL_LOGP_* variables where verl reads them, on verl's
own Megatron trainer config."""

import subprocess
import sys
from pathlib import Path

import verl  # noqa: F401  (plain import: a broken verl install fails here instead of skipping)
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]


def test_megatron_overlay_composes_with_the_installed_verl_from_the_command_line():
    """The documented command with a TP override and hydra's `--cfg job` (print the composed config)."""
    out = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={ROOT / 'configs'}",
         "--config-name=rl_logp_grpo_megatron", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
         "--cfg", "job"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    composed = OmegaConf.create(out.stdout)
    actor = composed.actor_rollout_ref.actor
    assert actor.strategy == "megatron" and actor.megatron.tensor_model_parallel_size == 2
    assert composed.actor_rollout_ref.ref.strategy == "megatron"
    assert composed.actor_rollout_ref.model.external_lib == "rl_logp.integrations.verl_hook"
    assert composed.actor_rollout_ref.model.use_fused_kernels is False
    assert actor.calculate_sum_pi_squared is False
    assert composed.actor_rollout_ref.rollout.calculate_log_probs is True
    assert composed.algorithm.adv_estimator == "grpo"
    env = composed.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.RL_LOGP_BACKEND == "auto" and env.RL_LOGP_STRICT == "1"
