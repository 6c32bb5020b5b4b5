"""vLLM adapter: every logprob vLLM computes comes from rl-logp's invariant lse.

Patched, where the installed vLLM has them (probed, not assumed; 0.24.0 and 0.34.0 are tested):
- Model Runner V1 (vLLM <= 0.2x): `vllm.v1.sample.sampler.Sampler.compute_logprobs` (full-vocab logprobs;
  the sampled token, top-k and ranks of every `logprobs_mode` are gathered from it by vLLM's own code).
- V1 processed modes: `TopKTopPSampler.forward_native` / `forward_cpu` (they call log_softmax on the
  processed logits themselves). Samplers bind `forward` when constructed: apply before the engine starts
  (the `vllm.general_plugins` entry point does). `forward_cuda` with FlashInfer returns no logprobs.
- Model Runner V2, GPU worker: `vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs` (the Triton
  log-softmax behind `compute_topk_logprobs` / `compute_topk_scores`: sampled token, top-k, custom
  logprob token ids, prompt logprobs; ranks come from the logits and need no lse), and
  `vllm.v1.worker.gpu.sample.gumbel.apply_temperature` (vLLM's Triton `logits / T`, replaced by torch's
  IEEE division so the processed logits are the contract's `fp32(x) / T`; T in {0, 1} stays a no-op).
- Model Runner V2, CPU worker (vLLM >= 0.3x): `vllm.v1.worker.cpu.logprob.compute_token_logprobs`.

Which logits each mode scores: `raw_logprobs` the model's logits; `processed_logprobs` the fp32 logits
after vLLM's temperature division (and top-k/top-p masking, if used). The trainer matches the first with
`rl_logp.logprobs(logits, tokens)` and the second with `rl_logp.logprobs(logits, tokens, temperature=T)`
when no top-k/top-p is set (with top-k/top-p it must score the same masked logits). The `*_logits` modes
return logits, not logprobs: nothing to patch.
"""

from __future__ import annotations

import importlib
import logging

import torch

from rl_logp.config import LogpConfig, resolve_config
from rl_logp.dispatch import logsumexp

from .patching import PatchSet

logger = logging.getLogger("rl_logp.vllm")
_patches = PatchSet()
_class_patches: list[tuple[type, str, object]] = []
_active: LogpConfig | None = None
_patched_names: list[str] = []

V1_SAMPLER = "vllm.v1.sample.sampler"
V1_TOPK_TOPP = "vllm.v1.sample.ops.topk_topp_sampler"
V2_GPU_LOGPROB = "vllm.v1.worker.gpu.sample.logprob"
V2_GPU_TEMPERATURE = "vllm.v1.worker.gpu.sample.gumbel"
V2_CPU_LOGPROB = "vllm.v1.worker.cpu.logprob"
V2_TOPK_NAMES = ("compute_topk_scores", "compute_topk_logprobs")


def _try_import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def make_compute_logprobs(config: LogpConfig):
    """Drop-in for V1 `Sampler.compute_logprobs(logits) -> fp32 [B, V]`."""

    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        lse = logsumexp(logits, config=config)
        return logits.to(torch.float32) - lse.unsqueeze(-1)

    return compute_logprobs


def make_compute_token_logprobs(config: LogpConfig):
    """Drop-in for V2 `compute_token_logprobs(logits, token_ids) -> fp32 [B, K]`."""

    def compute_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        lse = logsumexp(logits, config=config)
        picked = logits.gather(1, token_ids.to(torch.int64)).to(torch.float32) + 0.0
        return picked - lse.unsqueeze(-1)

    return compute_token_logprobs


def apply_temperature_ieee(logits: torch.Tensor, expanded_idx_mapping: torch.Tensor, temperature: torch.Tensor) -> None:
    """Drop-in for V2 `apply_temperature(logits, expanded_idx_mapping, temperature)`, in place: the
    contract's IEEE fp32 division; rows whose temperature is 0 (greedy) or 1 are left as they are."""
    t = temperature[expanded_idx_mapping.to(torch.int64)].to(torch.float32)
    logits.div_(torch.where((t == 0.0) | (t == 1.0), torch.ones_like(t), t).unsqueeze(1))


def make_processed_logprobs_forward(original, config: LogpConfig):
    """Wrap `TopKTopPSampler.forward_native/forward_cpu`, whose processed_logprobs mode calls
    `log_softmax` itself: run vLLM's code in processed_logits mode and score those logits here."""

    def forward(self, logits, generators, k, p):
        if self.logprobs_mode != "processed_logprobs":
            return original(self, logits, generators, k, p)
        self.logprobs_mode = "processed_logits"
        try:
            sampled, processed = original(self, logits, generators, k, p)
        finally:
            self.logprobs_mode = "processed_logprobs"
        return sampled, processed.to(torch.float32) - logsumexp(processed, config=config).unsqueeze(-1)

    return forward


def apply(backend: str | None = None, config: LogpConfig | dict | None = None, **options) -> list[str]:
    """Patch the installed vLLM (idempotent). Returns the names of the functions patched."""
    global _active
    cfg = resolve_config(config, backend=backend, **options)
    revert()
    patched = []
    v1 = _try_import(V1_SAMPLER)
    if v1 is not None and hasattr(v1, "Sampler"):
        _class_patches.append((v1.Sampler, "compute_logprobs", v1.Sampler.__dict__["compute_logprobs"]))
        v1.Sampler.compute_logprobs = staticmethod(make_compute_logprobs(cfg))
        patched.append(f"{V1_SAMPLER}.Sampler.compute_logprobs")
    topk = _try_import(V1_TOPK_TOPP)
    for name in ("forward_native", "forward_cpu"):
        if topk is not None and name in getattr(topk, "TopKTopPSampler", object).__dict__:
            original = topk.TopKTopPSampler.__dict__[name]
            _class_patches.append((topk.TopKTopPSampler, name, original))
            setattr(topk.TopKTopPSampler, name, make_processed_logprobs_forward(original, cfg))
            patched.append(f"{V1_TOPK_TOPP}.TopKTopPSampler.{name}")
    token_logprobs = make_compute_token_logprobs(cfg)
    for module_name, attr, replacement in (
        (V2_GPU_LOGPROB, "compute_token_logprobs", token_logprobs),
        (V2_GPU_TEMPERATURE, "apply_temperature", apply_temperature_ieee),
        (V2_CPU_LOGPROB, "compute_token_logprobs", token_logprobs),
    ):
        module = _try_import(module_name)
        if module is not None and hasattr(module, attr):
            _patches.replace_everywhere(getattr(module, attr), replacement)
            patched.append(f"{module_name}.{attr}")
    if not patched:
        raise ImportError("rl_logp: no vLLM logprob function found to patch (is vLLM installed?)")
    _active = cfg
    _patched_names[:] = patched
    logger.warning("rl_logp: vLLM logprobs -> rl_logp backend=%s (%s)", cfg.backend, ", ".join(patched))
    return patched


def revert() -> None:
    """Restore vLLM's originals."""
    global _active
    for cls, name, original in reversed(_class_patches):
        setattr(cls, name, original)
    _class_patches.clear()
    _patches.revert()
    _patched_names.clear()
    _active = None


def active_config() -> LogpConfig | None:
    """The config of the current patch, or None when vLLM is not patched."""
    return _active


def active_patches() -> list[str]:
    """The names of the vLLM functions the current patch replaced (empty when not patched)."""
    return list(_patched_names)


class VllmRolloutProvider:
    """The rollout side of `rl_logp.check`: scores given tokens through the installed vLLM's sampler code.

    V1 runner (vLLM <= 0.2x): `Sampler.apply_temperature` (vLLM's fp32 in-place division, processed
    mode), then `Sampler.compute_logprobs` (patched) and `Sampler.gather_logprobs` (vLLM's gather, top-k,
    ranks). V2 runner (vLLM >= 0.3x, no V1 sampler): the worker's temperature step (the CPU worker's
    `CPUSamplingStates.apply_temperature`, the GPU worker's `apply_temperature`, patched), then its
    `compute_topk_scores` (patched lse). Tokens outside [0, V) are scored as 0, the rl-logp convention
    (vLLM itself never sees them).
    """

    def __init__(self, backend: str = "auto") -> None:
        apply(backend=backend)
        self._v1 = _try_import(V1_SAMPLER)
        version = importlib.import_module("vllm").__version__
        runner = "V1 Sampler" if self._v1 is not None else "V2 worker compute_topk_scores"
        self.description = f"vLLM {runner} (vllm {version}, patched)"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, temperature: float | None) -> torch.Tensor:
        vocab = logits.shape[1]
        in_range = (labels >= 0) & (labels < vocab)
        tokens = torch.where(in_range, labels, torch.zeros_like(labels)).to(torch.int64)
        x = logits.to(torch.float32)
        if self._v1 is not None:
            picked = self._score_v1(x, tokens, temperature)
        else:
            picked = self._score_v2(x, tokens, temperature)
        return torch.where(in_range, picked, torch.zeros_like(picked))

    def _score_v1(self, x: torch.Tensor, tokens: torch.Tensor, temperature: float | None) -> torch.Tensor:
        import torch._dynamo

        sampler = self._v1.Sampler
        if temperature is not None:
            x = sampler.apply_temperature(x, _temperatures(x, temperature), True)
        with torch._dynamo.config.patch(disable=True):
            return sampler.gather_logprobs(sampler.compute_logprobs(x), 1, token_ids=tokens).logprobs[:, 0]

    def _score_v2(self, x: torch.Tensor, tokens: torch.Tensor, temperature: float | None) -> torch.Tensor:
        rows = torch.arange(x.shape[0], device=x.device)
        if x.is_cuda:
            module = importlib.import_module(V2_GPU_LOGPROB)
            if temperature is not None:
                importlib.import_module(V2_GPU_TEMPERATURE).apply_temperature(x, rows, _temperatures(x, temperature))
        else:
            module = importlib.import_module(V2_CPU_LOGPROB)
            if temperature is not None:
                _cpu_worker_temperature(x, temperature)
        topk = next(getattr(module, name) for name in V2_TOPK_NAMES if hasattr(module, name))
        return topk(x, 0, tokens).logprobs[:, 0]


def _temperatures(x: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.full((x.shape[0],), float(temperature), dtype=torch.float32, device=x.device)


def _cpu_worker_temperature(x: torch.Tensor, temperature: float) -> None:
    """The CPU worker's own temperature step, fed through its request state as the engine does."""
    import numpy as np
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.cpu.sampler import CPUSamplingStates

    batch = x.shape[0]
    states = CPUSamplingStates(batch, x.shape[1], x.device)
    for row in range(batch):
        states.add_request(row, SamplingParams(temperature=temperature, logprobs=0))
    states.apply_temperature(x, torch.arange(batch), np.arange(batch))

