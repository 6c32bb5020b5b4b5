"""The provider-agreement checker: `python -m rl_logp.check` or `torchrun --nproc-per-node=2 -m rl_logp.check`.

`cases` builds the frozen inputs (seeded, or loaded from a user's .pt/.safetensors file), `runner` scores
them through every provider at TP=1 and at the launched TP degree, `report` prints the table and the
verdict and writes the JSON.
"""
