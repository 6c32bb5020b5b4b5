"""Adapters wiring rl-logp into verl (trainer) and vLLM (rollout), installed as `rl_logp.integrations`."""
