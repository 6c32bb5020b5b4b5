#!/usr/bin/env bash
# One flag turns rl-logp on for a verl GRPO recipe: forward RL_LOGP_BACKEND to the Ray workers.
# (The verl.plugins entry point then patches logprobs_from_logits in every worker on `import verl`.)
python3 -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  +ray_kwargs.ray_init.runtime_env.env_vars.RL_LOGP_BACKEND=auto \
  "$@"
