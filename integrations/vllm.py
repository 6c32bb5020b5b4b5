"""vLLM adapter: every logprob vLLM computes comes from rl-logp's contract, and top-k / top-p sampling
keeps the contract's kept set (`rl_logp.sampling_mask`).

Patched, where the installed vLLM has them (probed, not assumed; 0.24.0 and 0.34.0 are tested):
- Model Runner V1 (vLLM <= 0.2x): `vllm.v1.sample.sampler.Sampler.compute_logprobs` (full-vocab logprobs,
  `rl_logp.full_logprobs`, one kernel launch on CUDA when eager) and `Sampler.gather_logprobs` (the sampled
  token's id, logprob and rank beside vLLM's own top-k of the logprobs, one launch of
  `rl_logp.kernels.sampled_rank` in place of five torch ops: the same bits, less host time per step).
- V1 processed modes: `TopKTopPSampler.forward_native` / `forward_cpu` (they call log_softmax on the
  processed logits themselves). Samplers bind `forward` when constructed: apply before the engine starts
  (the `vllm.general_plugins` entry point does).
- Model Runner V2, GPU worker: `vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs` (the Triton
  log-softmax behind `compute_topk_logprobs` / `compute_topk_scores`: sampled token, top-k, custom
  logprob token ids, prompt logprobs; ranks come from the logits and need no normaliser), and
  `vllm.v1.worker.gpu.sample.gumbel.apply_temperature` (vLLM's Triton `logits / T`, whose fp32 division is
  approximate, replaced by rl-logp's one-launch IEEE division, `rl_logp.kernels.temperature`, so the
  processed logits are the contract's `fp32(x) / T`; T in {0, 1} stays a no-op).
- Model Runner V2, CPU worker (vLLM >= 0.3x): `vllm.v1.worker.cpu.logprob.compute_token_logprobs`.
- Sampling (`sampling_mask=True`, the default): `vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p`
  (every caller: V1's `TopKTopPSampler`, its rejection sampler, the V2 GPU and CPU workers; it replaces
  vLLM's Triton kernel and its sort-based PyTorch rule; on CUDA rl-logp's kept-set kernel,
  `rl_logp.kernels.kept_set`, masks in place) and `flashinfer_sample` (V1's `forward_cuda`
  and the V2 GPU worker sample with FlashInfer when no processed logprobs are asked for; the replacement
  draws from the contract's kept set with exponential noise, vLLM's own native method in Gumbel-max form:
  on CUDA `rl_logp.kernels.kept_set` draws in its last pass).

Every logprob is `(z[j] - M) - L` with `(M, L) = rl_logp.log_normalizer(z)` (the contract: `M` the exact
row max, `L` the log of the int64 fixed-point sum): the bits `rl_logp.logprobs` gives for label j.

Which logits each mode scores: `raw_logprobs` the model's logits; `processed_logprobs` the fp32 logits
after vLLM's temperature division and top-k / top-p masking. The trainer matches the first with
`rl_logp.logprobs(logits, tokens)` and the second with `rl_logp.logprobs(logits, tokens, temperature=T)`,
or with top-k / top-p `rl_logp.logprobs(rl_logp.sampling_mask.apply_top_k_top_p(logits, temperature=T,
top_k=k, top_p=p), tokens)`. The `*_logits` modes return logits, not logprobs: nothing to patch.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator

import torch

import rl_logp
from rl_logp import rollout_calls
from rl_logp.config import LogpConfig, resolve_config
from rl_logp.engines import fused_runs_on
from rl_logp.sampling_mask import mask_logits_, sample_kept

from .patching import PatchSet

logger = logging.getLogger("rl_logp.vllm")
_patches = PatchSet()
_active: LogpConfig | None = None
_active_sampling_mask = False
_patched_names: list[str] = []

V1_SAMPLER = "vllm.v1.sample.sampler"
V1_TOPK_TOPP = "vllm.v1.sample.ops.topk_topp_sampler"
V2_GPU_LOGPROB = "vllm.v1.worker.gpu.sample.logprob"
V2_GPU_TEMPERATURE = "vllm.v1.worker.gpu.sample.gumbel"
V2_CPU_LOGPROB = "vllm.v1.worker.cpu.logprob"
V2_TOPK_NAMES = ("compute_topk_scores", "compute_topk_logprobs")
VLLM_MODULES = ("vllm",)
"""Where functions are replaced: every vLLM module that holds one, including modules imported later
while the patch is active (revert restores those too)."""


def try_import(name: str):
    """The module, or None when this vLLM does not have it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def make_compute_logprobs(config: LogpConfig):
    """Drop-in for V1 `Sampler.compute_logprobs(logits) -> fp32 [B, V]` (`rl_logp.full_logprobs`: one launch
    on CUDA when eager)."""

    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        return rl_logp.full_logprobs(logits, config=config)

    return compute_logprobs


def make_compute_token_logprobs(config: LogpConfig):
    """Drop-in for V2 `compute_token_logprobs(logits, token_ids) -> fp32 [B, K]` (`rl_logp.column_logprobs`:
    one launch on CUDA when eager)."""

    def compute_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        return rl_logp.column_logprobs(logits, token_ids, config=config)

    return compute_token_logprobs


def apply_temperature_ieee(logits: torch.Tensor, expanded_idx_mapping: torch.Tensor, temperature: torch.Tensor) -> None:
    """Drop-in for V2 `apply_temperature(logits, expanded_idx_mapping, temperature)`, in place: the
    contract's IEEE fp32 division; rows whose temperature is 0 (greedy) or 1 are left as they are (x / 1 is
    x). One launch of `rl_logp.kernels.temperature` where the fused kernels run on the logits' device and
    the three tensors are laid out as vLLM passes them (fp32 logits, one device, contiguous rows and index), else
    torch's division (the same bits). An index outside the temperatures gives NaN rows on the kernel (torch's
    index error elsewhere), never a temperature read from outside the tensor. A call whose signature (each
    tensor's shape, strides, dtype and device) was seen runs its plan (`rl_logp.rollout_calls`): the
    launch alone."""
    key = rollout_calls.signature(("divide_rows",), logits, expanded_idx_mapping, temperature)
    if key is not None and rollout_calls.run(key, [logits, expanded_idx_mapping, temperature]) is not None:
        return
    if (fused_runs_on(logits.device) and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1
            and expanded_idx_mapping.device == logits.device and temperature.device == logits.device
            and expanded_idx_mapping.is_contiguous() and temperature.is_contiguous()):
        from rl_logp.engines.fused import config_from_environment
        from rl_logp.kernels.temperature import bind_divide_rows, divide_rows_

        divide_rows_(logits, expanded_idx_mapping, temperature)
        if key is not None:
            bound = bind_divide_rows(logits, expanded_idx_mapping, temperature, direct=config_from_environment().driver)
            rollout_calls.remember(key, None, bound, None)
        return
    t = temperature.index_select(0, expanded_idx_mapping).to(torch.float32)
    logits.div_(t.masked_fill_(t == 0.0, 1.0).unsqueeze(1))


def make_gather_logprobs(original, tensors_type):
    """Drop-in for V1 `Sampler.gather_logprobs(logprobs, num_logprobs, token_ids) -> LogprobsTensors` (the
    sampled token's id, logprob and rank, and the top `num_logprobs` ids and logprobs beside it): vLLM's
    own `torch.topk` for the top-n, then one launch of `rl_logp.kernels.sampled_rank` for the rest in
    place of vLLM's gather, count, two cats and cast (the same bits), where the fused kernels run on the
    logprobs' device and the tensors are as vLLM passes them (fp32 contiguous [rows, V] logprobs of one row
    or more, int64 [rows] token ids on the same device); vLLM's own function (`original`) otherwise. A token id outside
    [0, V) gets a NaN logprob and the rank -1 on the kernel (vLLM's gather raises there). A call whose
    signature was seen runs its plan (`rl_logp.rollout_calls`): the three outputs allocated, the top-n and
    the launch."""

    def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor):
        key = (rollout_calls.signature(("gather_logprobs", num_logprobs), logprobs, token_ids)
               if type(num_logprobs) is int else None)
        if key is not None:
            outs = rollout_calls.run(key, (logprobs, token_ids))
            if outs is not None:
                return tensors_type(*outs)
        if not (type(num_logprobs) is int and num_logprobs >= 0 and fused_runs_on(logprobs.device)
                and logprobs.dtype == torch.float32 and logprobs.dim() == 2 and logprobs.shape[0] > 0
                and logprobs.is_contiguous() and token_ids.dtype == torch.int64
                and token_ids.shape == logprobs.shape[:1] and token_ids.device == logprobs.device
                and token_ids.is_contiguous()):
            return original(logprobs, num_logprobs, token_ids)
        from rl_logp.engines.fused import config_from_environment
        from rl_logp.kernels.sampled_rank import bind_sampled_rank, sampled_rank

        rows, device = logprobs.shape[0], logprobs.device
        outs = (torch.empty((rows, num_logprobs + 1), dtype=torch.int32, device=device),
                torch.empty((rows, num_logprobs + 1), dtype=torch.float32, device=device),
                torch.empty(rows, dtype=torch.int64, device=device))
        top = tuple(torch.topk(logprobs, num_logprobs, dim=-1)) if num_logprobs else (None, None)
        sampled_rank(logprobs, token_ids, *top, *outs)
        if key is not None:
            bound = bind_sampled_rank(logprobs, token_ids, *top, *outs, direct=config_from_environment().driver)
            rollout_calls.remember(key, None, _topk_first(bound, num_logprobs), outs)
        return tensors_type(*outs)

    return gather_logprobs


def _topk_first(bound, num_logprobs: int):
    """A plan's launch of `kernels.sampled_rank` taking (logprobs, token_ids, *outputs): with the top
    `num_logprobs` of the logprobs computed first (torch.topk) and passed after the token ids."""
    if bound is None or num_logprobs == 0:
        return bound
    return lambda tensors: bound((*tensors[:2], *torch.topk(tensors[0], num_logprobs, dim=-1), *tensors[2:]))


def make_processed_logprobs_forward(original, config: LogpConfig):
    """Wrap `TopKTopPSampler.forward_native/forward_cpu`, whose processed_logprobs mode calls
    `log_softmax` itself: run vLLM's code in processed_logits mode and score those logits here."""
    compute_logprobs = make_compute_logprobs(config)

    def forward(self, logits, generators, k, p):
        if self.logprobs_mode != "processed_logprobs":
            return original(self, logits, generators, k, p)
        # A plain attribute of the module: set as object.__setattr__ would (Module.__setattr__ looks through
        # its parameters, buffers and submodules first, at every decode step).
        object.__setattr__(self, "logprobs_mode", "processed_logits")
        try:
            sampled, processed = original(self, logits, generators, k, p)
        finally:
            object.__setattr__(self, "logprobs_mode", "processed_logprobs")
        return sampled, compute_logprobs(processed)

    return forward


def make_apply_top_k_top_p(config: LogpConfig):
    """Drop-in for vLLM's `apply_top_k_top_p(logits, k, p[, has_topp_only_rows])`: the contract's kept
    set (`rl_logp.sampling_mask`), -inf elsewhere, in place on vLLM's fp32 processed logits."""

    def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None,
                          has_topp_only_rows: bool = True) -> torch.Tensor:
        del has_topp_only_rows  # a hint for vLLM's Triton kernel (0.3x); the contract needs none
        if k is None and p is None:
            return logits
        z = logits.to(torch.float32)  # the tensor itself when it is fp32 already
        return mask_logits_(z, k, p, config)

    return apply_top_k_top_p


def make_flashinfer_sample(config: LogpConfig):
    """Drop-in for vLLM's `flashinfer_sample(logits, k, p, generators)`: sample from the contract's kept
    set with exponential noise drawn as vLLM's native sampler draws it (a request's own generator for its
    row), the draw `argmax(probs / q)` taken in Gumbel-max form (`rl_logp.sampling_mask.sample_kept`: on
    CUDA the kept-set kernel, which draws in its last pass over the logits, reading the noise beside
    them), leaving `logits` untouched."""

    def flashinfer_sample(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None,
                          generators: dict[int, torch.Generator] | None = None) -> torch.Tensor:
        z = logits.to(torch.float32)  # the tensor itself when it is fp32 already
        noise = torch.empty_like(z, memory_format=torch.contiguous_format).exponential_()
        for row, generator in (generators or {}).items():
            noise[row].exponential_(generator=generator)
        return sample_kept(z, k, p, noise, config)

    return flashinfer_sample


def apply(
    backend: str | None = None,
    config: LogpConfig | dict | None = None,
    *,
    sampling_mask: bool = True,
    **options,
) -> list[str]:
    """Patch the installed vLLM (idempotent) and log one line naming what was patched. Returns the names
    of the functions patched.

    `sampling_mask=False` leaves vLLM's own top-k / top-p (Triton, PyTorch or FlashInfer) in place:
    the logprobs are still the contract's, but processed logprobs under top-k / top-p then score vLLM's
    kept set, which the trainer cannot recompute exactly.
    """
    patched_names = _apply(resolve_config(config, backend=backend, **options), sampling_mask)
    logger.warning("rl_logp: vLLM logprobs -> rl_logp backend=%s (%s)", _active.backend, ", ".join(patched_names))
    return patched_names


def _apply(cfg: LogpConfig, sampling_mask: bool) -> list[str]:
    global _active, _active_sampling_mask
    revert()
    patched = []
    v1 = try_import(V1_SAMPLER)
    if v1 is not None and hasattr(v1, "Sampler"):
        _patches.set_attr(v1.Sampler, "compute_logprobs", staticmethod(make_compute_logprobs(cfg)))
        patched.append(f"{V1_SAMPLER}.Sampler.compute_logprobs")
        if "gather_logprobs" in v1.Sampler.__dict__ and hasattr(v1, "LogprobsTensors"):
            gather = make_gather_logprobs(v1.Sampler.gather_logprobs, v1.LogprobsTensors)
            _patches.set_attr(v1.Sampler, "gather_logprobs", staticmethod(gather))
            patched.append(f"{V1_SAMPLER}.Sampler.gather_logprobs")
    topk = try_import(V1_TOPK_TOPP)
    sampler_class = getattr(topk, "TopKTopPSampler", None)
    for name in ("forward_native", "forward_cpu"):
        if sampler_class is not None and name in sampler_class.__dict__:
            original = sampler_class.__dict__[name]
            _patches.set_attr(sampler_class, name, make_processed_logprobs_forward(original, cfg))
            patched.append(f"{V1_TOPK_TOPP}.TopKTopPSampler.{name}")
    token_logprobs = make_compute_token_logprobs(cfg)
    targets = [
        (V2_GPU_LOGPROB, "compute_token_logprobs", token_logprobs),
        (V2_GPU_TEMPERATURE, "apply_temperature", apply_temperature_ieee),
        (V2_CPU_LOGPROB, "compute_token_logprobs", token_logprobs),
    ]
    if sampling_mask:
        targets += [
            (V1_TOPK_TOPP, "apply_top_k_top_p", make_apply_top_k_top_p(cfg)),
            (V1_TOPK_TOPP, "flashinfer_sample", make_flashinfer_sample(cfg)),
        ]
    for module_name, attr, replacement in targets:
        module = try_import(module_name)
        if module is not None and hasattr(module, attr):
            _patches.replace_in_modules(getattr(module, attr), replacement, VLLM_MODULES)
            patched.append(f"{module_name}.{attr}")
    if not patched:
        raise ImportError("rl_logp: no vLLM logprob function found to patch (is vLLM installed?)")
    _active, _active_sampling_mask = cfg, sampling_mask
    _patched_names[:] = patched
    return patched


def revert() -> None:
    """Restore vLLM's originals."""
    global _active, _active_sampling_mask
    _patches.revert()
    _patched_names.clear()
    _active, _active_sampling_mask = None, False


@contextlib.contextmanager
def patched(backend: str | None = None, config: LogpConfig | dict | None = None, *,
            sampling_mask: bool = True, **options) -> Iterator[list[str]]:
    """The patch for the duration of a `with` block, without logging; afterwards vLLM is as it was
    (patched with the previous config, or not at all)."""
    previous = (_active, _active_sampling_mask)
    try:
        yield _apply(resolve_config(config, backend=backend, **options), sampling_mask)
    finally:
        revert()
        if previous[0] is not None:
            _apply(*previous)


def active_config() -> LogpConfig | None:
    """The config of the current patch, or None when vLLM is not patched."""
    return _active


def active_patches() -> list[str]:
    """The names of the vLLM functions the current patch replaced (empty when not patched)."""
    return list(_patched_names)
