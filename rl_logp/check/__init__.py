"""The provider-agreement checker: `python -m rl_logp.check` or `torchrun --nproc-per-node=2 -m rl_logp.check`.

`cases` builds the frozen inputs (seeded, or loaded from a user's .pt/.safetensors file) and their sampling
parameters, `rollout` picks the rollout provider (vLLM's sampler code patched for the call only,
`rl_logp.integrations.vllm_rollout`, where vLLM imports; else the same function on full-vocab logits), `runner` through
every training provider at TP=1 and at the launched TP degree, `report` prints the table, the failures
with their tracebacks and the verdict, and writes the JSON.
"""
