"""Calls without repeated set-up: a call made again and again with new tensors of the same shapes (what a
rollout makes at every decode step) keeps what its first call worked out, as a plan, for the calls after it.

Four kinds of call keep plans: the scores of an eager single-device call with nothing to differentiate
(`logprobs` without autograd, `column_logprobs`, `full_logprobs`: `rl_logp.api`, bound by the engine,
`LogpEngine.bind_scores`), the top-k / top-p kept set on the GPU (`rl_logp.sampling_mask`, bound by
`kernels.kept_set.bind_kept_set`), vLLM V2's temperature division in place (the adapter's
`apply_temperature`, bound by `kernels.temperature.bind_divide_rows`), and vLLM V1's gather of the sampled
token's logprob and rank (the adapter's `gather_logprobs`, three outputs, bound by
`kernels.sampled_rank.bind_sampled_rank`). A call's signature is all that its set-up reads: the caller's settings
(which call, the config, a float temperature...) and each tensor's exact type, shape, strides, dtype and
device. No check of the set-up reads a tensor's values, so a call with a known signature passes every
check its first call passed. A plan allocates the call's output and launches its kernels
(`kernels.launcher.BoundLaunch`: the cached launch with only the tensors left to each call); where a bound
launch declines (a tensor of another alignment, another current device, a launch hook, a changed knob, the
engine's launch parameters replaced) the plan is dropped and the call takes the ordinary path, which binds
the signature anew. Calls made while the current stream is being captured in a CUDA graph (where replay
costs no host time) have no signature and always take the ordinary path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

MAX_PLANS = 4096  # signatures kept; all are dropped when a new one would exceed it

Bound = Callable[[Sequence[torch.Tensor]], bool]  # (the call's tensors, its outputs) -> launched


class Plan:
    """A signature's call: an output like its first call's (or a tuple of outputs like its first call's),
    written by `bound`, or for a call in place (no output) its first tensor, which `bound` writes (`keep`:
    an object the signature names by id, kept alive so that no other object can take that id). Each output
    is allocated as `torch.empty_like` of its `like`, the first call's output's shape, dtype and device over
    one element (a microsecond less than `torch.empty` of the shape: the rollout pays it at every decode
    step)."""

    __slots__ = ("bound", "keep", "like", "likes")

    def __init__(self, keep: Any, bound: Bound, out: torch.Tensor | tuple[torch.Tensor, ...] | None) -> None:
        self.keep, self.bound = keep, bound
        self.like = self.likes = None
        if isinstance(out, tuple):
            self.likes = tuple(map(_like, out))
        elif out is not None:
            self.like = _like(out)

    def __call__(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        like = self.like
        if like is not None:
            out = torch.empty_like(like, memory_format=torch.contiguous_format)
            return out if self.bound((*tensors, out)) else None
        if self.likes is not None:
            outs = tuple(torch.empty_like(each, memory_format=torch.contiguous_format) for each in self.likes)
            return outs if self.bound((*tensors, *outs)) else None
        return tensors[0] if self.bound(tensors) else None


def _like(out: torch.Tensor) -> torch.Tensor:
    """A tensor of `out`'s shape, dtype and device over one element."""
    return torch.empty((), dtype=out.dtype, device=out.device).expand(out.shape)


_plans: dict[tuple, Plan] = {}


def signature(settings: tuple, *tensors: object) -> tuple | None:
    """The signature of a call: its `settings` (hashable) and each tensor's shape, strides, dtype and device
    (None for an absent one). None, the ordinary path, where the first argument is not exactly a
    torch.Tensor or its current CUDA stream is being captured, or another is neither None nor exactly a
    torch.Tensor."""
    first = tensors[0]
    if type(first) is not torch.Tensor or (first.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    key = list(settings)
    for t in tensors:
        if t is None:
            key.append(None)
        elif type(t) is torch.Tensor:
            key += (t.shape, t.stride(), t.dtype, t.device)
        else:
            return None
    return tuple(key)


def run(key: tuple, tensors: Sequence[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
    """The output (or outputs) of the signature's plan over `tensors` (those of the call that are not None;
    in place, the first of them), or None: no plan, or its launch declined (the plan is then dropped, and the ordinary path that follows binds the
    signature anew)."""
    plan = _plans.get(key)
    if plan is None:
        return None
    out = plan(tensors)
    if out is None:
        _plans.pop(key, None)  # another thread may have dropped it already
    return out


def remember(key: tuple, keep: Any, bound: Bound | None, out: torch.Tensor | tuple[torch.Tensor, ...] | None) -> None:
    """Keep a plan for `key`, whose first call wrote `out` (a tuple: several outputs, in the order `bound`
    takes them after the call's tensors; None: its first tensor, in place), where the call could be bound
    (`bound`)."""
    if bound is None:
        return
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[key] = Plan(keep, bound, out)


def clear() -> None:
    """Drop every plan."""
    _plans.clear()


@contextlib.contextmanager
def ordinary_path() -> Iterator[None]:
    """Every call in the block takes the ordinary path (no signature: no plan looked up or kept), for a
    measurement or a check of a plan against what it replaces."""
    global signature
    kept = signature
    signature = lambda *args: None  # noqa: E731
    try:
        yield
    finally:
        signature = kept
