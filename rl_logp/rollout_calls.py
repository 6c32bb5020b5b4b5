"""Calls without repeated set-up: an eager single-device call with nothing to differentiate and one output
(`logprobs` without autograd, and `column_logprobs` / `full_logprobs`, which vLLM's adapter calls at every
decode step) keeps what the first call of a signature worked out for the calls after it.

A call's signature is all that its set-up reads: which output ("logp", "columns" or "full"), the resolved
`LogpConfig` (the object: a plan keeps it alive, so no other config can take its id), the temperature (None
or a float), and the exact type, shape, strides, dtype and device of the logits and of the labels. No check
of the set-up reads a tensor's values, so a call with a known signature passes every check its first call
passed. A signature gets a plan when its first call ran one launch of the engine on the caller's own
tensors (no reshape, cast or copy of them) that the engine can repeat (`LogpEngine.bind_scores`: on the
fused engine a `kernels.launcher.BoundLaunch`). A plan allocates the output and launches; where the bound
launch declines (a tensor of another alignment, another current device, a launch hook, a changed knob, the
engine's launch parameters replaced), the plan is dropped and the call takes the ordinary path, which binds
the signature anew. Calls with a tensor temperature, on the chunked engine or a baseline, or
while the current stream is being captured in a CUDA graph (where the split plan runs and replay costs no
host time) always take the ordinary path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rl_logp.config import LogpConfig
from rl_logp.engines import LogpEngine
from rl_logp.request import LogpRequest

MAX_PLANS = 4096  # signatures kept; all are dropped when a new one would exceed it


class Plan:
    """A signature's call: an fp32 output of `shape` on `device`, written by `bound`."""

    __slots__ = ("bound", "config", "device", "shape")

    def __init__(self, config: LogpConfig, bound: Callable[[Sequence[torch.Tensor]], bool], shape: torch.Size,
                 device: torch.device) -> None:
        self.config, self.bound, self.shape, self.device = config, bound, shape, device

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor | None:
        out = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        return out if self.bound((logits, out) if labels is None else (logits, labels, out)) else None


_plans: dict[tuple, Plan] = {}


def signature(logits: object, labels: object, temperature: object, config: LogpConfig, kind: str) -> tuple | None:
    """The call's signature, or None for a call that always takes the ordinary path."""
    if type(logits) is not torch.Tensor or not (labels is None or type(labels) is torch.Tensor):
        return None
    if not (temperature is None or type(temperature) is float):
        return None
    if logits.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    key = (kind, id(config), temperature, logits.shape, logits.stride(), logits.dtype, logits.device)
    if labels is None:
        return key
    return (*key, labels.shape, labels.stride(), labels.dtype, labels.device)


def run(key: tuple, logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor | None:
    """The output of the signature's plan, or None: no plan, or its launch declined (the plan is then
    dropped, and the ordinary path that follows binds the signature anew)."""
    plan = _plans.get(key)
    if plan is None:
        return None
    out = plan(logits, labels)
    if out is None:
        del _plans[key]
    return out


def remember(key: tuple, config: LogpConfig, engine: LogpEngine, req: LogpRequest, logits: torch.Tensor,
             labels: torch.Tensor | None, out: torch.Tensor) -> None:
    """Keep a plan for `key` after its call (`req`, which wrote `out`) ran, where the engine can repeat it
    on the caller's own tensors."""
    if req.logits is not logits or req.labels is not labels or req.rows == 0:
        return
    bound = engine.bind_scores(req, out)
    if bound is None:
        return
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[key] = Plan(config, bound, out.shape, out.device)


def clear() -> None:
    """Drop every plan."""
    _plans.clear()
