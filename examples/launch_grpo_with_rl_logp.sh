#!/usr/bin/env bash
# rl-logp on for your own verl GRPO recipe: the keys configs/rl_logp_grpo.yaml sets, as overrides.
# - external_lib: every worker imports the hook when it builds its model config (the verl.plugins entry
#   point does the same on `import verl`); it patches verl from the RL_LOGP_* variables.
# - RL_LOGP_BACKEND / RL_LOGP_STRICT: forwarded by Ray to the TaskRunner and every worker. Strict mode
#   fails the first step at any call site that scores logits outside rl-logp (fused kernels, top-k
#   distillation, engines that divide by the temperature themselves); an invalid value fails at import.
#   Ray wants string values, hence the quoted "1".
# - calculate_log_probs: the rollout's logprobs reach the trainer, which then logs
#   rl_logp/rollout_train_mismatch_tokens (0 when rollout and trainer agree bit for bit).
python3 -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  actor_rollout_ref.model.external_lib=rl_logp.integrations.verl_hook \
  actor_rollout_ref.model.use_fused_kernels=false \
  actor_rollout_ref.rollout.calculate_log_probs=true \
  +ray_kwargs.ray_init.runtime_env.env_vars.RL_LOGP_BACKEND=auto \
  '+ray_kwargs.ray_init.runtime_env.env_vars.RL_LOGP_STRICT="1"' \
  "$@"
