"""verl adapter: every verl 0.9.1 call site that scores logits in the training step goes through rl-logp.

    from rl_logp.integrations import verl as rl_logp_verl
    rl_logp_verl.apply(backend="auto")    # ... and rl_logp_verl.revert()

`SITES` names every site `apply` replaces, once: where it is, what replaces it, whether `refuse` puts a
raising stand-in there and whether verl's FSDP step reads it (checked before every step; see
`integrations.verl_step` for what a step does when one is not rl-logp's). Functions are replaced only in
modules named `verl[.*]` or `megatron[.*]` (a user's own reference keeps verl's); engines that captured
`compute_entropy_from_logits` when they were built are patched when found: live ones at `apply`, new ones
from `EngineRegistry.new`, any other on its first FSDP step.

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
from .patching import KEEP, PatchSet
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
FUSED_PPO = "verl.utils.experimental.torch_functional.FusedLinearForPPO"
LINEAR_CE = "verl.utils.kernel.linear_cross_entropy"
FUSED_FLAG = "use_fused_kernels"
# Engines whose prepare_model_outputs divides the logits by the temperature inline before rl-logp sees
# them (bf16 x / bf16(T), or in place); see docs/verl.md.
INLINE_TEMPERATURE_ENGINES = {
    "AutomodelEngineWithLMHead": "verl/workers/engine/automodel/transformer_impl.py:612,657",
    "TorchTitanEngineWithLMHead": "verl/workers/engine/torchtitan/transformer_impl.py:807,834",
}

logger = logging.getLogger("rl_logp.verl")

FUNCTION, METHOD, ENGINE = "function", "method", "engine"


@dataclasses.dataclass
class _Parts:
    """What one `apply` builds its replacements from."""

    config: LogpConfig
    auditor: Auditor
    adopt: Callable[[Any], None] | None = None


@dataclasses.dataclass(frozen=True)
class Site:
    """One verl 0.9.1 site the adapter replaces.

    - `kind`: FUNCTION (`owner` a module; every verl/Megatron module binding the same object is rebound),
      METHOD (`owner` "module.Class"; the class attribute is wrapped) or ENGINE (the attribute of each
      engine instance, set when the engine is adopted).
    - `make(parts, original)`: the replacement for one `apply`, from its config, auditor and adopt and
      verl's original.
    - `scores`: it scores logits, so `refuse` puts a raising stand-in there.
    - `step`: where verl's FSDP step looks it up when it runs (a module, a class for METHOD, or ENGINE: the
      step's engine); checked before every step, a binding that is not rl-logp's bypasses the step. None:
      not read there.
    - `flag`: checked only in steps whose micro-batch sets this flag (verl's fused heads run only with
      `use_fused_kernels`).
    """

    kind: str
    owner: str
    attr: str
    make: Callable[[_Parts, Callable | None], Callable]
    scores: bool = False
    step: str | None = None
    flag: str | None = None

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.attr}"


def _drop_in(make: Callable[[LogpConfig], Callable]) -> Callable[[_Parts, Callable | None], Callable]:
    """A `Site.make` for a drop-in built from the config alone."""
    return lambda parts, _original: make(parts.config)


TF, FSDP, MCORE = TORCH_FUNCTIONAL, VERL_FSDP_ENGINE, MEGATRON_TP
SITES = (
    Site(FUNCTION, TF, "logprobs_from_logits", _drop_in(fn.make_logprobs_from_logits), scores=True, step=FSDP),
    Site(FUNCTION, TF, "entropy_from_logits", _drop_in(fn.make_entropy_from_logits), scores=True, step=TF),
    Site(FUNCTION, TF, "entropy_from_logits_with_chunking", _drop_in(fn.make_entropy_from_logits), scores=True),
    Site(FUNCTION, TF, "calculate_sum_pi_squared_from_logits", _drop_in(fn.make_sum_pi_squared), scores=True,
         step=TF),
    Site(FUNCTION, FSDP, "_scale_logits_by_temperature",
         lambda parts, verl: fn.make_scale_logits_by_temperature(verl), scores=True, step=FSDP),
    Site(FUNCTION, MCORE, "vocab_parallel_log_probs_from_logits",
         _drop_in(fn.make_vocab_parallel_log_probs_from_logits), scores=True),
    Site(FUNCTION, MCORE, "vocab_parallel_entropy", _drop_in(fn.make_vocab_parallel_entropy), scores=True),
    Site(FUNCTION, MCORE, "vocab_parallel_entropy_with_chunking", _drop_in(fn.make_vocab_parallel_entropy),
         scores=True),
    # bound, torch.compile'd, in __init__ by the FSDP (l. 183), veomni, automodel and torchtitan engines
    Site(ENGINE, "engine", "compute_entropy_from_logits", _drop_in(fn.make_entropy_from_logits), scores=True,
         step=ENGINE),
    Site(METHOD, f"{FSDP}.FSDPEngineWithLMHead", "prepare_model_outputs",
         lambda parts, verl: wrap_prepare_model_outputs(verl, parts.adopt, parts.auditor)),
    Site(METHOD, f"{MEGATRON_ENGINE}.MegatronEngineWithLMHead", "_lm_head_logits_processor",
         lambda parts, verl: wrap_lm_head_logits_processor(verl, parts.config, parts.auditor)),
    Site(METHOD, f"{ENGINE_BASE}.EngineRegistry", "new", lambda parts, verl: _wrap_registry_new(verl, parts.adopt)),
    Site(FUNCTION, DEBUG_METRICS, "calculate_debug_metrics", lambda parts, verl: wrap_calculate_debug_metrics(verl)),
    # verl's fused heads (use_fused_kernels=True), looked up when the model's patched forward runs: every
    # model family's torch/liger forward builds a FusedLinearForPPO, every triton one calls linear_cross_entropy
    Site(METHOD, FUSED_PPO, "forward", _drop_in(fn.make_fused_linear_for_ppo), scores=True, step=FUSED_PPO,
         flag=FUSED_FLAG),
    Site(FUNCTION, LINEAR_CE, "linear_cross_entropy", _drop_in(fn.make_linear_cross_entropy), scores=True,
         step=LINEAR_CE, flag=FUSED_FLAG),
)
ENGINE_SITE = next(site for site in SITES if site.kind == ENGINE)


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
    parts = _Parts(cfg, Auditor(cfg.strict))
    engine_value = ENGINE_SITE.make(parts, None)
    parts.adopt = _make_adopt(engine_value, parts.auditor)
    _expect(parts.auditor, ENGINE_SITE, engine_value)
    _install([site for site in SITES if site.kind != ENGINE], lambda site, original: site.make(parts, original),
             parts.auditor)
    _adopt_live_engines(parts.adopt)


def refuse(message: str) -> None:
    """Fail closed: rl-logp was asked for (an `RL_LOGP_*` variable) but its configuration is invalid.
    Replace every site that scores logits with a stand-in that raises `message`, so verl never runs unpatched."""
    global _active
    revert()
    logger.error("%s; verl's logp functions in this process raise until it is fixed", message)
    _install([site for site in SITES if site.scores and site.kind != ENGINE],
             lambda site, _original: fn.make_refusal(site.name, message))
    _adopt_live_engines(_make_adopt(fn.make_refusal(ENGINE_SITE.attr, message), Auditor(strict=False)))
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


def _install(sites: list[Site], make: Callable[[Site, Callable], Callable], auditor: Auditor | None = None) -> None:
    """Replace each site with `make(site, original)`; with `auditor`, register the bindings the FSDP step
    reads. Every module is imported first, so every binding of a function is counted."""
    found = [(site, _resolve(site)) for site in sites]
    for site, (owner, original) in found:
        if owner is None:
            continue
        if site.kind == FUNCTION:
            value = make(site, original)
            count = _patches.replace_in_modules(original, value, VERL_PREFIXES)
            _report.patched.append(f"{site.name} ({count} bindings)")
        elif isinstance(original, classmethod):
            value = make(site, original.__func__)
            _patches.set_attr(owner, site.attr, classmethod(value))
            _report.patched.append(site.name)
        else:
            value = make(site, original)
            _patches.set_attr(owner, site.attr, value)
            _report.patched.append(site.name)
        if auditor is not None:
            _expect(auditor, site, value, owner)


def _expect(auditor: Auditor, site: Site, value: Callable, owner: Any = None) -> None:
    """Register the binding verl's FSDP step will look up for `site` (if it reads it): it must be `value`."""
    if site.step == ENGINE:
        auditor.expect(f"the FSDP engine's {site.attr}", None, site.attr, value)
    elif site.kind == METHOD and site.step is not None:
        auditor.expect(site.name, owner, site.attr, value, site.flag)
    elif site.step is not None and hasattr(sys.modules.get(site.step), site.attr):
        auditor.expect(f"{site.step}.{site.attr}", sys.modules[site.step], site.attr, value, site.flag)


def _resolve(site: Site) -> tuple[Any, Any]:
    """(the module or class holding the site, verl's original there), or (None, None) with the reason in
    the report."""
    module_name, cls_name = (site.owner, None) if site.kind == FUNCTION else site.owner.rsplit(".", 1)
    try:
        owner = importlib.import_module(module_name)
    except ImportError as err:
        _report.not_patched[site.name] = f"{module_name} does not import here: {err}"
        return None, None
    if cls_name is not None:
        owner = getattr(owner, cls_name)
    original = vars(owner).get(site.attr)
    if original is None:
        _report.not_patched[site.name] = f"this verl has no {site.attr} (verl 0.9.1 has)"
        return None, None
    return owner, original


def _make_adopt(entropy: Callable, auditor: Auditor) -> Callable[[Any], None]:
    """Patch one engine instance: its captured `compute_entropy_from_logits` (kept uncompiled: rl-logp's
    op is one opaque op already) and the start-up audit (inline temperature)."""

    def adopt(engine: Any) -> None:
        if engine in _adopted:
            return
        _adopted.add(engine)
        name = type(engine).__name__
        for cls in type(engine).__mro__:
            if cls.__name__ in INLINE_TEMPERATURE_ENGINES:
                auditor.bypass(
                    f"{cls.__name__}.prepare_model_outputs temperature step",
                    f"it divides the logits by the temperature inline ({INLINE_TEMPERATURE_ENGINES[cls.__name__]}), "
                    "so at T != 1 its logp and entropy are of bf16-rounded logits, not the contract's fp32(x)/T",
                    "use the FSDP engine (actor_rollout_ref.actor.strategy=fsdp2), or T = 1",
                    engine,
                )
                break
        attr = ENGINE_SITE.attr
        if attr in vars(engine):
            try:
                _patches.set_attr(engine, attr, entropy, _verl_built(vars(engine)[attr]))
            except (AttributeError, TypeError) as err:
                _report.not_patched[f"{name}.{attr} at {id(engine):#x}"] = f"cannot set it: {err}"
                auditor.bypass(f"{name}.{attr}", f"the engine refused the patch ({err})",
                               "call rl_logp.integrations.verl.apply() before the engine is built", engine)
                return
        _report.engines += 1

    return adopt


def _verl_built(captured: Callable) -> Any:
    """What an engine built while verl was patched would hold unpatched: it captured (a `torch.compile` of)
    rl-logp's replacement, so revert gives it (a `torch.compile` of) verl's own function instead."""
    inner = getattr(captured, "_torchdynamo_orig_callable", captured)
    verl_own = _patches.original_of(inner)
    if verl_own is None:
        return KEEP
    return verl_own if inner is captured else torch.compile(verl_own, dynamic=True)


def _wrap_registry_new(original: Callable, adopt: Callable[[Any], None]) -> Callable:
    def new(cls, model_type, backend, *args, **kwargs):
        engine = original(cls, model_type, backend, *args, **kwargs)
        adopt(engine)
        return engine

    return new


def _adopt_live_engines(adopt: Callable[[Any], None]) -> None:
    try:
        base = importlib.import_module(ENGINE_BASE)
    except ImportError as err:
        _report.not_patched["live engines"] = f"{ENGINE_BASE} does not import here: {err}"
        return
    for obj in gc.get_objects():
        if issubclass(type(obj), base.BaseEngine):  # type(), not isinstance: no __class__ properties run
            adopt(obj)
