"""verl adapter: every verl 0.9.1 call site that scores logits in the training step goes through rl-logp.

    from rl_logp.integrations import verl as rl_logp_verl
    rl_logp_verl.apply(backend="auto")    # ... and rl_logp_verl.revert()

What `apply` replaces, only in modules named `verl[.*]` or `megatron[.*]` (a user's own reference to a
verl function keeps the original):
- `verl.utils.torch_functional`: `logprobs_from_logits`, `entropy_from_logits`,
  `entropy_from_logits_with_chunking`, `calculate_sum_pi_squared_from_logits` (and every verl module that
  imported them by name: the FSDP, automodel and torchtitan engines, naive rollout, prefix grouper).
- the FSDP engine's `_scale_logits_by_temperature` and `FSDPEngineWithLMHead.prepare_model_outputs`
  (run under a step plan: temperature handed to rl-logp instead of a bf16 division, logp and entropy
  from one read, in-place backward only where safe; see `integrations.verl_step`).
- engines that captured `compute_entropy_from_logits` when they were built (the FSDP/veomni/automodel/
  torchtitan engines bind it, `torch.compile`d, in `__init__`): live ones found at `apply`, new ones from
  `EngineRegistry.new`, any other on its first step.
- Megatron (when installed): `vocab_parallel_log_probs_from_logits`, `vocab_parallel_entropy[_with_chunking]`
  on Megatron's TP group, and `MegatronEngineWithLMHead._lm_head_logits_processor` (temperature handed to
  rl-logp instead of divided in place; `integrations.verl_megatron`).
- `verl.utils.debug.metrics.calculate_debug_metrics` gains the on-policy metric (`integrations.verl_metrics`).

`revert` restores exactly the objects that were there. Processes you do not control get the patch from
`integrations.verl_hook` (the `verl.plugins` entry point and `actor_rollout_ref.model.external_lib`).
What is and is not covered, engine by engine: docs/verl.md.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from rl_logp import LogpConfig, resolve_backend, resolve_config

from . import verl_functions as fn
from .patching import PatchSet
from .verl_megatron import wrap_lm_head_logits_processor
from .verl_metrics import wrap_calculate_debug_metrics
from .verl_step import Auditor, wrap_prepare_model_outputs

VERL_PREFIXES = ("verl", "megatron")
TORCH_FUNCTIONAL = "verl.utils.torch_functional"
VERL_FSDP_ENGINE = "verl.workers.engine.fsdp.transformer_impl"
ENGINE_BASE = "verl.workers.engine.base"
MEGATRON_TP = "verl.utils.megatron.tensor_parallel"
MEGATRON_ENGINE = "verl.workers.engine.megatron.transformer_impl"
DEBUG_METRICS = "verl.utils.debug.metrics"
ENTROPY_ATTR = "compute_entropy_from_logits"
# The functions verl 0.9.1's FSDP prepare_model_outputs looks up when it runs.
STEP_SITES = (
    f"{VERL_FSDP_ENGINE}._scale_logits_by_temperature",
    f"{VERL_FSDP_ENGINE}.logprobs_from_logits",
    f"{TORCH_FUNCTIONAL}.entropy_from_logits",
    f"{TORCH_FUNCTIONAL}.calculate_sum_pi_squared_from_logits",
)
# Engines whose prepare_model_outputs divides the logits by the temperature inline before rl-logp sees
# them (bf16 x / bf16(T), or in place); see docs/verl.md.
INLINE_TEMPERATURE_ENGINES = {
    "AutomodelEngineWithLMHead": "verl/workers/engine/automodel/transformer_impl.py:612,657",
    "TorchTitanEngineWithLMHead": "verl/workers/engine/torchtitan/transformer_impl.py:807,834",
}

logger = logging.getLogger("rl_logp.verl")


@dataclasses.dataclass
class PatchReport:
    """What the last `apply` replaced, and what it found but could not or did not replace."""

    patched: list[str] = dataclasses.field(default_factory=list)
    not_patched: dict[str, str] = dataclasses.field(default_factory=dict)
    engines: int = 0


_patches = PatchSet()
_active: LogpConfig | None = None
_report = PatchReport()
_adopted: weakref.WeakSet = weakref.WeakSet()


def apply(backend: str | None = None, config: LogpConfig | dict[str, Any] | None = None, **options: Any) -> LogpConfig:
    """Patch verl (idempotent: a second call re-points the patches at the new config). Returns the config.
    If it raises (strict mode refusing a live engine, say), verl is left unpatched."""
    global _active
    cfg = resolve_config(config, backend=backend, **options)
    revert()
    try:
        _apply(cfg)
    except BaseException:
        revert()
        raise
    _active = cfg
    where = "cuda" if torch.cuda.is_available() else "cpu"
    logger.warning(
        "rl_logp: verl -> rl_logp backend=%s (%s on %s)%s: %d sites patched, %d engines adopted; not patched: %s",
        cfg.backend, resolve_backend(cfg.backend, torch.device(where)), where, ", strict" if cfg.strict else "",
        len(_report.patched), _report.engines, "; ".join(f"{k} ({v})" for k, v in _report.not_patched.items()) or "none",
    )
    return cfg


def _apply(cfg: LogpConfig) -> None:
    auditor = Auditor(cfg.strict)
    entropy = fn.make_entropy_from_logits(cfg)
    _install(
        {
            f"{TORCH_FUNCTIONAL}.logprobs_from_logits": fn.make_logprobs_from_logits(cfg),
            f"{TORCH_FUNCTIONAL}.entropy_from_logits": entropy,
            f"{TORCH_FUNCTIONAL}.entropy_from_logits_with_chunking": entropy,
            f"{TORCH_FUNCTIONAL}.calculate_sum_pi_squared_from_logits": fn.make_sum_pi_squared(cfg),
            f"{VERL_FSDP_ENGINE}._scale_logits_by_temperature": fn.scale_logits_by_temperature,
            f"{MEGATRON_TP}.vocab_parallel_log_probs_from_logits": fn.make_vocab_parallel_log_probs_from_logits(cfg),
            f"{MEGATRON_TP}.vocab_parallel_entropy": fn.make_vocab_parallel_entropy(cfg),
            f"{MEGATRON_TP}.vocab_parallel_entropy_with_chunking": fn.make_vocab_parallel_entropy(cfg),
        }
    )
    adopt = _make_adopt(entropy, auditor)
    for site in STEP_SITES:  # what the FSDP step reads at call time: checked at every step
        module_name, attr = site.rsplit(".", 1)
        if module_name in sys.modules and hasattr(sys.modules[module_name], attr):
            auditor.expect(site, sys.modules[module_name], attr, getattr(sys.modules[module_name], attr))
    auditor.expect(f"FSDPEngineWithLMHead.{ENTROPY_ATTR} (the engine's)", None, ENTROPY_ATTR, entropy)
    _wrap_method(f"{VERL_FSDP_ENGINE}.FSDPEngineWithLMHead.prepare_model_outputs",
                 lambda original: wrap_prepare_model_outputs(original, adopt, auditor))
    _wrap_method(f"{MEGATRON_ENGINE}.MegatronEngineWithLMHead._lm_head_logits_processor",
                 lambda original: wrap_lm_head_logits_processor(original, cfg, auditor))
    _wrap_method(f"{ENGINE_BASE}.EngineRegistry.new", lambda original: _wrap_registry_new(original, adopt))
    _install({f"{DEBUG_METRICS}.calculate_debug_metrics": None}, wrapper=wrap_calculate_debug_metrics)
    _adopt_live_engines(adopt)


def refuse(message: str) -> None:
    """Fail closed: rl-logp was asked for (an `RL_LOGP_*` variable) but its configuration is invalid.
    Replace the same verl functions with stand-ins that raise `message`, so verl never runs unpatched."""
    global _active
    revert()
    logger.error("%s; verl's logp functions in this process raise until it is fixed", message)
    sites = [
        f"{TORCH_FUNCTIONAL}.logprobs_from_logits",
        f"{TORCH_FUNCTIONAL}.entropy_from_logits",
        f"{TORCH_FUNCTIONAL}.entropy_from_logits_with_chunking",
        f"{TORCH_FUNCTIONAL}.calculate_sum_pi_squared_from_logits",
        f"{VERL_FSDP_ENGINE}._scale_logits_by_temperature",
        f"{MEGATRON_TP}.vocab_parallel_log_probs_from_logits",
        f"{MEGATRON_TP}.vocab_parallel_entropy",
        f"{MEGATRON_TP}.vocab_parallel_entropy_with_chunking",
    ]
    _install({site: fn.make_refusal(site, message) for site in sites})
    refusal = fn.make_refusal(ENTROPY_ATTR, message)
    _adopt_live_engines(_make_adopt(refusal, Auditor(strict=False)))
    _active = None


def revert() -> None:
    """Restore every verl binding, method and engine attribute `apply` replaced, exactly."""
    global _active, _report
    _patches.revert()
    _adopted.clear()
    _report = PatchReport()
    _active = None


def active_config() -> LogpConfig | None:
    """The config of the current patch, or None when verl is not patched."""
    return _active


def report() -> PatchReport:
    """What the current patch covers (sites, engines) and what it left alone, with the reason."""
    return _report


def _import(module_name: str, site: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        _report.not_patched[site] = f"{module_name} does not import here: {err}"
        return None


def _install(replacements: dict[str, Callable | None], wrapper: Callable | None = None) -> None:
    """Replace each `module.attr` in every verl/Megatron module that binds it. With `wrapper`, the
    replacement is `wrapper(original)`. All modules are imported first, so every binding is counted."""
    modules = {site: _import(site.rsplit(".", 1)[0], site) for site in replacements}
    for site, replacement in replacements.items():
        module, attr = modules[site], site.rsplit(".", 1)[1]
        if module is None:
            continue
        original = getattr(module, attr, None)
        if original is None:
            _report.not_patched[site] = f"this verl has no {attr} (verl 0.9.1 has)"
            continue
        count = _patches.replace_in_modules(original, replacement or wrapper(original), VERL_PREFIXES)
        _report.patched.append(f"{site} ({count} bindings)")


def _wrap_method(site: str, make: Callable[[Callable], Callable]) -> None:
    module_name, cls_name, attr = site.rsplit(".", 2)
    module = _import(module_name, site)
    if module is None:
        return
    cls = getattr(module, cls_name)
    original = cls.__dict__[attr]
    if isinstance(original, classmethod):
        _patches.set_attr(cls, attr, classmethod(make(original.__func__)))
    else:
        _patches.set_attr(cls, attr, make(original))
    _report.patched.append(site)


def _make_adopt(entropy: Callable, auditor: Auditor) -> Callable[[Any], None]:
    """Patch one engine instance: its captured `compute_entropy_from_logits` (kept uncompiled: rl-logp's
    op is one opaque op already) and the start-up audit (fused kernels, inline temperature)."""

    def adopt(engine: Any) -> None:
        if engine in _adopted:
            return
        _adopted.add(engine)
        name = type(engine).__name__
        model_config = getattr(engine, "model_config", None)
        if getattr(model_config, "use_fused_kernels", False):
            auditor.bypass(
                f"actor_rollout_ref.model.use_fused_kernels=True ({name})",
                "verl's fused linear + cross entropy computes logp and entropy without materialising the logits",
                "set actor_rollout_ref.model.use_fused_kernels=False",
            )
        for cls in type(engine).__mro__:
            if cls.__name__ in INLINE_TEMPERATURE_ENGINES:
                auditor.bypass(
                    f"{cls.__name__}.prepare_model_outputs temperature step",
                    f"it divides the logits by the temperature inline ({INLINE_TEMPERATURE_ENGINES[cls.__name__]}), "
                    "so at T != 1 its logp and entropy are of bf16-rounded logits, not the contract's fp32(x)/T",
                    "use the FSDP engine (actor_rollout_ref.actor.strategy=fsdp2), or T = 1",
                )
                break
        if ENTROPY_ATTR in vars(engine):
            try:
                _patches.set_attr(engine, ENTROPY_ATTR, entropy)
            except (AttributeError, TypeError) as err:
                _report.not_patched[f"{name}.{ENTROPY_ATTR} at {id(engine):#x}"] = f"cannot set it: {err}"
                auditor.bypass(f"{name}.{ENTROPY_ATTR}", f"the engine refused the patch ({err})",
                               "call rl_logp.integrations.verl.apply() before the engine is built")
                return
        _report.engines += 1

    return adopt


def _wrap_registry_new(original: Callable, adopt: Callable[[Any], None]) -> Callable:
    def new(cls, model_type, backend, *args, **kwargs):
        engine = original(cls, model_type, backend, *args, **kwargs)
        adopt(engine)
        return engine

    return new


def _adopt_live_engines(adopt: Callable[[Any], None]) -> None:
    base = _import(ENGINE_BASE, "live engines")
    if base is None:
        return
    for obj in gc.get_objects():
        if issubclass(type(obj), base.BaseEngine):  # type(), not isinstance: no __class__ properties run
            adopt(obj)
