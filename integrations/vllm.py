"""vLLM adapter: every logprob vLLM computes comes from rl-logp's invariant lse.

Patched, where the installed vLLM has them (probed, not assumed):
- Model Runner V1: `vllm.v1.sample.sampler.Sampler.compute_logprobs` (full-vocab logprobs; the sampled
  token, top-k and ranks of every `logprobs_mode` are gathered from it by vLLM's own code).
- V1 processed modes: `TopKTopPSampler.forward_native` / `forward_cpu` (they call log_softmax on the
  processed logits themselves). Samplers bind `forward` when constructed: apply before the engine starts
  (the `vllm.general_plugins` entry point does). `forward_cuda` with FlashInfer returns no logprobs.
- Model Runner V2: `vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs` (the Triton log-softmax
  behind `compute_topk_logprobs`, sampled token and top-k; ranks come from the logits and need no lse).

Which logits each mode scores: `raw_logprobs` the model's logits; `processed_logprobs` the fp32 logits
after vLLM's temperature division (and top-k/top-p masking, if used). The trainer matches the first with
`rl_logp.logprobs(logits, tokens)` and the second with `rl_logp.logprobs(logits, tokens, temperature=T)`
when no top-k/top-p is set (with top-k/top-p it must score the same masked logits).
"""

from __future__ import annotations

import importlib
import logging

import torch

from rl_logp.config import LogpConfig, resolve_config
from rl_logp.dispatch import logprobs, logsumexp

from .patching import PatchSet

logger = logging.getLogger("rl_logp.vllm")
_patches = PatchSet()
_class_patches: list[tuple[type, str, object]] = []
_active: LogpConfig | None = None

V1_SAMPLER = "vllm.v1.sample.sampler"
V1_TOPK_TOPP = "vllm.v1.sample.ops.topk_topp_sampler"
V2_LOGPROB = "vllm.v1.worker.gpu.sample.logprob"


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
    v2 = _try_import(V2_LOGPROB)
    if v2 is not None and hasattr(v2, "compute_token_logprobs"):
        _patches.replace_everywhere(v2.compute_token_logprobs, make_compute_token_logprobs(cfg))
        patched.append(f"{V2_LOGPROB}.compute_token_logprobs")
    if not patched:
        raise ImportError("rl_logp: no vLLM logprob function found to patch (is vLLM installed?)")
    _active = cfg
    logger.warning("rl_logp: vLLM logprobs -> rl_logp backend=%s (%s)", cfg.backend, ", ".join(patched))
    return patched


def revert() -> None:
    """Restore vLLM's originals."""
    global _active
    for cls, name, original in reversed(_class_patches):
        setattr(cls, name, original)
    _class_patches.clear()
    _patches.revert()
    _active = None


def active_config() -> LogpConfig | None:
    return _active


class VllmRolloutProvider:
    """The rollout side of `rl_logp.check`: scores given tokens through vLLM's V1 sampler code.

    temperature -> `Sampler.apply_temperature` (vLLM's fp32 in-place division, processed mode),
    then `Sampler.compute_logprobs` (patched) and `Sampler.gather_logprobs` (vLLM's gather, top-k, ranks).
    Tokens outside [0, V) are scored as 0, the rl-logp convention (vLLM itself never sees them).
    """

    def __init__(self, backend: str = "auto") -> None:
        sampler_module = importlib.import_module(V1_SAMPLER)
        self.sampler = sampler_module.Sampler
        apply(backend=backend)
        self.description = f"vLLM V1 Sampler (vllm {importlib.import_module('vllm').__version__}, patched)"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, temperature: float | None) -> torch.Tensor:
        x = logits.to(torch.float32)
        if temperature is not None:
            temp = torch.full((x.shape[0],), float(temperature), dtype=torch.float32, device=x.device)
            x = self.sampler.apply_temperature(x, temp, True)
        vocab = x.shape[1]
        in_range = (labels >= 0) & (labels < vocab)
        tokens = torch.where(in_range, labels, torch.zeros_like(labels)).to(torch.int64)
        full = self.sampler.compute_logprobs(x)
        tensors = _gather(self.sampler, full, tokens)
        return torch.where(in_range, tensors.logprobs[:, 0], torch.zeros_like(tensors.logprobs[:, 0]))


def _gather(sampler, full: torch.Tensor, tokens: torch.Tensor):
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):
        return sampler.gather_logprobs(full, 1, token_ids=tokens)


def reference_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float | None = None) -> torch.Tensor:
    """What the trainer must compute to match vLLM's processed-logprobs mode without top-k/top-p."""
    return logprobs(logits, tokens, temperature=temperature)
