"""Score a batch with rl-logp and show that the bits do not depend on the batch it sits in."""

import torch

import rl_logp

logits = torch.randn(8, 32000, dtype=torch.bfloat16)
labels = torch.randint(0, 32000, (8,))
batch = rl_logp.logprobs(logits, labels)
alone = torch.stack([rl_logp.logprobs(logits[i : i + 1], labels[i : i + 1])[0] for i in range(8)])
print("logp:", batch)
print("same bits alone and in the batch:", torch.equal(batch, alone))
