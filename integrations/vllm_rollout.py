"""The vLLM rollout provider of `rl_logp.check`: vLLM's own sampler code scores given tokens, with rl-logp's
vLLM patch (`rl_logp.integrations.vllm`) applied for the duration of each call only (vLLM is left as it
was found). The checker imports this module lazily (`rl_logp.check.rollout.rollout_provider`); the core
never imports the adapter.

V1 runner (vLLM <= 0.2x): `Sampler.apply_temperature` (vLLM's fp32 in-place division), the module's
`apply_top_k_top_p` (patched: the contract's kept set), `Sampler.compute_logprobs` (patched) and
`Sampler.gather_logprobs` (patched: the sampled token's logprob and rank). V2 runner (vLLM >= 0.3x, no V1 sampler): the
worker's temperature and top-k / top-p steps (the CPU worker's `CPUSamplingStates`, fed the requests'
`SamplingParams`; on CUDA the GPU worker's `apply_temperature` and `apply_top_k_top_p`, patched), then
its `compute_topk_scores` (patched). Every call works on its own fp32 copy of the logits: vLLM's steps
divide and mask in place. Tokens outside [0, V) are scored as 0, the rl-logp convention (vLLM itself
never sees them).
"""

from __future__ import annotations

import importlib

import torch

from rl_logp.check.cases import Sampling

from . import vllm as adapter


class VllmRollout:
    """Scores tokens through the installed vLLM's sampler code, patched with `backend` while it runs.
    Raises ImportError when vLLM is not installed."""

    def __init__(self, backend: str = "auto") -> None:
        version = importlib.import_module("vllm").__version__
        self._backend = backend
        self._v1 = adapter.try_import(adapter.V1_SAMPLER)
        runner = "V1 Sampler" if self._v1 is not None else "V2 worker compute_topk_scores"
        self.description = f"vLLM {runner} (vllm {version}, patched)"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        vocab = logits.shape[1]
        in_range = (labels >= 0) & (labels < vocab)
        tokens = torch.where(in_range, labels, torch.zeros_like(labels)).to(torch.int64)
        x = logits.to(torch.float32, copy=True)
        with adapter.patched(backend=self._backend):
            picked = self._score_v1(x, tokens, sampling) if self._v1 is not None else self._score_v2(x, tokens, sampling)
        return torch.where(in_range, picked, torch.zeros_like(picked))

    def _score_v1(self, x: torch.Tensor, tokens: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        import torch._dynamo

        sampler = self._v1.Sampler
        if sampling.temperature is not None:
            x = sampler.apply_temperature(x, _per_row(x, sampling.temperature, torch.float32), True)
        if sampling.masks:
            topk_topp = importlib.import_module(adapter.V1_TOPK_TOPP)
            x = topk_topp.apply_top_k_top_p(x, *_k_and_p(x, sampling))
        with torch._dynamo.config.patch(disable=True):
            return sampler.gather_logprobs(sampler.compute_logprobs(x), 1, token_ids=tokens).logprobs[:, 0]

    def _score_v2(self, x: torch.Tensor, tokens: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        if x.is_cuda:
            module = importlib.import_module(adapter.V2_GPU_LOGPROB)
            if sampling.temperature is not None:
                rows = torch.arange(x.shape[0], device=x.device)
                gumbel = importlib.import_module(adapter.V2_GPU_TEMPERATURE)
                gumbel.apply_temperature(x, rows, _per_row(x, sampling.temperature, torch.float32))
            if sampling.masks:
                x = importlib.import_module(adapter.V1_TOPK_TOPP).apply_top_k_top_p(x, *_k_and_p(x, sampling))
        else:
            module = importlib.import_module(adapter.V2_CPU_LOGPROB)
            x = _cpu_worker_processed(x, sampling)
        topk = next(getattr(module, name) for name in adapter.V2_TOPK_NAMES if hasattr(module, name))
        return topk(x, 0, tokens).logprobs[:, 0]


def _per_row(x: torch.Tensor, value: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((x.shape[0],), value, dtype=dtype, device=x.device)


def _k_and_p(x: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """vLLM's per-row top-k (int32) and top-p (fp32) tensors."""
    k = None if sampling.top_k is None else _per_row(x, sampling.top_k, torch.int32)
    p = None if sampling.top_p is None else _per_row(x, sampling.top_p, torch.float32)
    return k, p


def _cpu_worker_processed(x: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The CPU worker's own temperature and top-k / top-p steps, fed through its request state as the
    engine does (in place on `x`, or a new tensor when its top-k / top-p step returns one)."""
    import numpy as np
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.cpu.sampler import CPUSamplingStates

    if sampling.temperature is None and not sampling.masks:
        return x
    batch = x.shape[0]
    params = SamplingParams(temperature=1.0 if sampling.temperature is None else sampling.temperature,
                            top_k=sampling.top_k or 0, top_p=sampling.top_p or 1.0, logprobs=0)
    states = CPUSamplingStates(batch, x.shape[1], x.device)
    for row in range(batch):
        states.add_request(row, params)
    rows, rows_np = torch.arange(batch), np.arange(batch)
    states.apply_temperature(x, rows, rows_np)
    return states.apply_top_k_top_p(x, rows, rows_np)
