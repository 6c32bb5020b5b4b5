"""The cases that broke earlier providers, each a transformation of one frozen batch of logits, and the
sampling parameters (temperature, top-k, top-p) a case is scored under."""

from __future__ import annotations

import dataclasses

import torch

from rl_logp.config import MIN_CHUNK_BYTES
from rl_logp.sampling_mask import apply_top_k_top_p


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What the rollout sampled with. The trainer scores `fp32(x) / T`, or with top-k / top-p the
    contract's kept set of it (`rl_logp.sampling_mask`); vLLM applies them itself."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    @property
    def masks(self) -> bool:
        return self.top_k is not None or self.top_p is not None


@dataclasses.dataclass
class Case:
    """Rows to score, with the index of each row in the frozen batch (to compare across cases)."""

    name: str
    logits: torch.Tensor
    labels: torch.Tensor
    source_rows: torch.Tensor
    options: dict = dataclasses.field(default_factory=dict)
    sampling: Sampling = Sampling()


def frozen_batch(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Model-like logits (broad background, a few hot tokens) and labels, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 2.5 - 3.0
    hot = torch.randint(0, vocab, (rows, max(1, vocab // 500)), generator=gen)
    x.scatter_(1, hot, torch.rand(hot.shape, generator=gen) * 12 + 4)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    return x.to(dtype), labels


def load_batch(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A user's saved logits: a dict with 'logits' [N, V] (or [B, T, V]) and 'labels' ([N] / [B, T])."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        data = load_file(path)
    else:
        data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or "logits" not in data or "labels" not in data:
        raise ValueError(f"{path}: expected a dict with tensors 'logits' and 'labels'")
    logits, labels = data["logits"], data["labels"]
    return logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long()


def build_cases(logits: torch.Tensor, labels: torch.Tensor, seed: int) -> list[Case]:
    n, vocab = logits.shape
    gen = torch.Generator().manual_seed(seed)
    every = torch.arange(n)
    perm = torch.randperm(n, generator=gen)
    active = every[torch.rand(n, generator=gen) < 0.6]
    cases = [Case("full batch", logits, labels, every)]
    for size in sorted({1, 3, 8, n // 2 + 1}):
        if size < n:
            cases.append(Case(f"batch of {size}", logits[:size], labels[:size], every[:size]))
    cases.append(Case("permuted rows", logits[perm], labels[perm], perm))
    cases.append(Case("active-row compaction", logits[active], labels[active], active))
    padded_labels = labels.clone()
    padded_labels[n - n // 4 :] = -100
    cases.append(Case("padded rows (label -100)", logits, padded_labels, every))
    out_of_range = labels.clone()
    out_of_range[::5] = vocab + 3
    cases.append(Case("labels out of range", logits, out_of_range, every))
    cases.append(Case("small chunks", logits, labels, every, {"chunk_bytes": max(MIN_CHUNK_BYTES, 12 * (vocab // 3))}))
    cases.append(Case("temperature 0.7", logits, labels, every, sampling=Sampling(temperature=0.7)))
    top = Sampling(temperature=0.7, top_k=max(2, vocab // 10), top_p=0.9)
    cases.append(Case("top-k + top-p, T 0.7", logits, sampled_labels(logits, top, gen), every, sampling=top))
    cases.append(Case("fp32 logits", logits.float(), labels, every))
    return cases


def sampled_labels(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> torch.Tensor:
    """A token per row drawn from the kept set (as a rollout would), so the case scores finite logprobs."""
    kept = apply_top_k_top_p(logits, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    return torch.multinomial(kept.softmax(dim=-1), 1, generator=gen).squeeze(1)

