"""One FSDP-engine step seen from inside: which consumers read the scaled logits, and what that allows.

verl 0.9.1's `FSDPEngineWithLMHead.prepare_model_outputs` (verl/workers/engine/fsdp/transformer_impl.py,
lines 1332-1547) scales the logits by the temperature (`_scale_logits_by_temperature`, line 98: bf16
`x / bf16(T)`), then hands the result to `calculate_sum_pi_squared_from_logits`, the engine's
`compute_entropy_from_logits` (remove-padding) or `verl_F.entropy_from_logits` (padded), the distillation
`logits_processor_func` and `logprobs_from_logits`. The adapter wraps that method: before verl's body
runs, a `StepPlan` is built from the micro-batch's flags and the bindings the step will look up, and set
for the duration of the call (a context variable). The patched functions consult it:

- temperature deferred: when every consumer of the scaled logits is an rl-logp function (no distillation
  top-k, no entropy checkpointing, remove-padding on, nothing bypassed), the patched scale step returns
  the logits unchanged and records T; the consumers pass `temperature=T` to rl-logp (the contract's
  `fp32(x) / T`, computed inside: no logits-sized buffer). Otherwise the scale step materialises
  `fp32(x) / T`.
- one read for logp and entropy: when verl asks for both on the same logits (remove-padding on, no
  entropy checkpointing, nothing bypassed), the entropy call runs `rl_logp.logprobs_and_entropy` with the
  step's labels and the logp call that follows returns the stored logp: one forward read, one combined
  backward.
- in-place backward only where rl-logp's node is the only autograd consumer of those logits (no
  distillation top-k, entropy served by the same node or not computed); anything else is out of place.

Fail closed. A step that meets a consumer rl-logp does not serve (a binding the step looks up that is not
rl-logp's: rebound after `apply`, or an engine that refused the patch; with `use_fused_kernels`, verl's
fused head when it is not rl-logp's `linear_logprobs`; the distillation top-k processor; anything the
`Auditor` flagged on the engine) is a *bypassed* step: the
scale step is verl's own (bf16 `x / bf16(T)`), nothing is deferred or combined, so every consumer, rl-logp's
or not, gets exactly the logits verl gives it. The `Auditor` reports the site first: a warning once per
site, or `StrictModeError` under `RL_LOGP_STRICT=1` (the step does not run). A consumer of rl-logp's that
receives other logits than the scale step returned while T is deferred raises (never scores them at T=1).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("rl_logp.verl")
_plan: contextvars.ContextVar[StepPlan | None] = contextvars.ContextVar("rl_logp_verl_step", default=None)

# Micro-batch flags that take the step's logits away from rl-logp: flag -> (site, why, fix). verl's
# `use_fused_kernels` is not one: its fused heads are sites of their own (`integrations.verl.SITES`), audited
# in the steps that set it.
FLAG_BYPASSES = {
    "distillation_use_topk": (
        "distillation top-k logits processor (distillation_use_topk=True)",
        "verl's top-k distillation loss scores the student logits with torch's log_softmax/logsumexp",
        "use a distillation loss without top-k, or accept these logits scored by torch",
    ),
}


class StrictModeError(RuntimeError):
    """A verl call site that scores logits does not route through rl-logp while strict mode is on."""


class Auditor:
    """Reports call sites that bypass rl-logp: a warning once per site, or `StrictModeError` if strict.

    `expect` registers a binding the FSDP step looks up (a verl module's function, or an engine
    attribute); `unrouted` checks them at every step, so a function rebound after `apply` is caught.
    `bypass(..., engine=e)` also marks the engine, whose steps are then bypassed (`flagged`)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self._warned: set[str] = set()
        self._expected: list[tuple[str, Any, str, object, str | None]] = []
        self._engines: weakref.WeakSet = weakref.WeakSet()

    def bypass(self, site: str, why: str, fix: str, engine: Any = None) -> None:
        message = f"rl_logp: verl call site {site} does not route through rl-logp: {why}. Fix: {fix}"
        if engine is not None:
            self._engines.add(engine)
        if self.strict:
            raise StrictModeError(message + " (RL_LOGP_STRICT=1 refuses to run it; unset it to only warn)")
        if site not in self._warned:
            self._warned.add(site)
            logger.warning(
                "%s. Until then each step that meets it runs verl's own temperature step, nothing deferred to "
                "rl-logp or combined: this site gets exactly the logits verl gives it, every value is at the "
                "right temperature, none has the contract's bits at T != 1 (warned once; RL_LOGP_STRICT=1 "
                "makes this an error)",
                message,
            )

    def expect(self, site: str, owner: Any, attr: str, value: object, flag: str | None = None) -> None:
        """`owner.attr` must be `value` when a step runs (`owner` None: the step's engine); with `flag`, only
        in steps whose micro-batch sets that flag."""
        self._expected.append((site, owner, attr, value, flag))

    def unrouted(self, engine: Any, flagged: Callable[[str], bool]) -> list[str]:
        """The expected bindings this engine's step would not find (`flagged(flag)`: whether the step sets a
        flag), each reported through `bypass`."""
        unrouted = []
        for site, owner, attr, value, flag in self._expected:
            if flag is not None and not flagged(flag):
                continue
            found = getattr(engine if owner is None else owner, attr, value)
            if found is not value:
                where = f"{getattr(found, '__module__', '?')}.{getattr(found, '__qualname__', found)}"
                self.bypass(site, f"it is bound to {where}, not rl-logp's replacement",
                            "call rl_logp.integrations.verl.apply() after whatever rebinds it")
                unrouted.append(site)
        return unrouted

    def flagged(self, engine: Any) -> bool:
        """Whether a bypass was reported for this engine itself (at adoption: fused kernels, a refused patch)."""
        return engine in self._engines


@dataclasses.dataclass
class StepPlan:
    """What one `prepare_model_outputs` call may do with its scaled logits (see the module docstring).
    `verl_scaling`: the step is bypassed, the scale step is verl's own."""

    verl_scaling: bool
    defer_temperature: bool
    combine: bool
    sole_consumer: bool
    labels: torch.Tensor | None
    logits: torch.Tensor | None = None
    temperature: torch.Tensor | None = None
    _logp: torch.Tensor | None = None

    def bind(self, logits: torch.Tensor, temperature: torch.Tensor | None) -> None:
        """The scale step returned `logits`; `temperature` is deferred to rl-logp (None: already applied)."""
        self.logits, self.temperature, self._logp = logits, temperature, None

    def temperature_for(self, logits: torch.Tensor, site: str) -> torch.Tensor | None:
        if logits is self.logits:
            return self.temperature
        if self.temperature is not None:
            raise RuntimeError(
                f"rl_logp: {site} received logits other than those verl's temperature step returned while the "
                "temperature is deferred to rl-logp, so they would be scored without it (this verl's "
                "prepare_model_outputs differs from 0.9.1's). Fix: pin verl==0.9.1, or run without "
                "RL_LOGP_BACKEND and report the verl version"
            )
        return None

    def inplace_ok(self, logits: torch.Tensor) -> bool:
        """True when rl-logp's node is the only autograd consumer of these logits."""
        return self.sole_consumer and logits is self.logits

    def combines(self, logits: torch.Tensor) -> bool:
        return self.combine and self._logp is None and logits is self.logits and self.labels is not None

    def keep_logp(self, logp: torch.Tensor) -> None:
        self._logp = logp

    def take_logp(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """The logp computed with the entropy of these logits and labels, once; else None."""
        if self._logp is None or logits is not self.logits or labels is not self.labels:
            return None
        logp, self._logp = self._logp, None
        return logp


def current_plan() -> StepPlan | None:
    """The plan of the FSDP-engine step running in this context, or None outside one."""
    return _plan.get()


def _flags(micro_batch: Any) -> Callable[..., Any]:
    """`flag(key, default=False)`: the micro-batch's non-tensor value of `key`, each key read from the
    tensordict once (several sites ask for the same flag; a read costs microseconds)."""
    from verl.utils import tensordict_utils as tu

    read: dict[str, Any] = {}

    def flag(key: str, default: Any = False) -> Any:
        if key not in read:
            read[key] = tu.get_non_tensor_data(data=micro_batch, key=key, default=default)
        return read[key]

    return flag


def fsdp_plan(engine: Any, micro_batch: Any, output_args: dict, auditor: Auditor) -> StepPlan:
    """The plan for one call of verl 0.9.1's FSDP `prepare_model_outputs`, auditing its bindings and flags
    (strict mode raises here, before verl's body runs)."""
    flag = _flags(micro_batch)
    bypassed = bool(auditor.unrouted(engine, lambda key: bool(flag(key))))
    for key, (site, why, fix) in FLAG_BYPASSES.items():
        if flag(key):
            auditor.bypass(site, why, fix)
            bypassed = True
    bypassed = bypassed or auditor.flagged(engine)
    distillation = bool(flag("distillation_use_topk"))
    rmpad = bool(flag("use_remove_padding", True))
    entropy = bool(flag("calculate_entropy"))
    checkpointing = bool(getattr(engine.engine_config, "entropy_checkpointing", False))
    # Entropy checkpointing recomputes the entropy in the backward, outside this call: T must be in the
    # logits by then. Without remove-padding verl repacks the logits (nested narrow + cat) before logp.
    combine = not bypassed and rmpad and entropy and not checkpointing and not flag("distillation_only")
    return StepPlan(
        verl_scaling=bypassed,
        defer_temperature=not bypassed and rmpad and not (entropy and checkpointing),
        combine=combine,
        sole_consumer=not distillation and (combine or not entropy),
        labels=output_args.get("input_ids_rmpad_rolled") if rmpad else None,
    )


def wrap_prepare_model_outputs(
    original: Callable, adopt: Callable[[Any], None], auditor: Auditor
) -> Callable:
    """`FSDPEngineWithLMHead.prepare_model_outputs` run under a `StepPlan` (its engine adopted first)."""

    @functools.wraps(original)
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        adopt(self)
        token = _plan.set(fsdp_plan(self, micro_batch, output_args, auditor))
        try:
            return original(self, output, output_args, micro_batch, logits_processor_func)
        finally:
            _plan.reset(token)

    return prepare_model_outputs
