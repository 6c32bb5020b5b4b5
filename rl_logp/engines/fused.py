"""The `fused` engine: the Triton kernels of `rl_logp.kernels` behind the engine interface.

It allocates the outputs a request asks for, turns the request's `Temperature` into the kernels' mode
and arguments, and launches (`rl_logp.kernels.launch`). Launch parameters: `LaunchConfig`, overridden by
`RL_LOGP_FUSED_CONFIG` (a JSON object of its fields; a tuning knob for other GPUs: every variant gives
the same bits). Same bits as `ChunkedEngine` on the same GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence

import torch

from rl_logp.engines.base import LogpEngine, RowStats
from rl_logp.kernels import launch
from rl_logp.kernels.fixed_point import TEMP_NONE, TEMP_ROWS, TEMP_SCALAR
from rl_logp.kernels.launch import LaunchConfig
from rl_logp.request import LogpRequest
from rl_logp.temperature import Temperature

TUNING_VARIABLE = "RL_LOGP_FUSED_CONFIG"


def config_from_environment() -> LaunchConfig:
    """`LaunchConfig()` with the overrides of RL_LOGP_FUSED_CONFIG. Unknown fields or types are an error."""
    raw = os.environ.get(TUNING_VARIABLE)
    if not raw:
        return LaunchConfig()
    try:
        overrides = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"rl_logp: {TUNING_VARIABLE}={raw!r} is not JSON ({err})") from None
    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    if not isinstance(overrides, dict) or set(overrides) - fields:
        raise ValueError(f"rl_logp: {TUNING_VARIABLE} must be a JSON object with keys among {sorted(fields)}, got {raw!r}")
    for key, value in overrides.items():
        if type(value) is not type(getattr(LaunchConfig, key)):
            raise ValueError(f"rl_logp: {TUNING_VARIABLE}: {key}={value!r} must be a {type(getattr(LaunchConfig, key)).__name__}")
    return LaunchConfig(**overrides)


def _temperature_args(temp: Temperature) -> tuple[int, torch.Tensor | None, float]:
    """(mode, per-row tensor or None, scalar) as the kernels take them."""
    if temp.rows is not None:
        return TEMP_ROWS.value, temp.rows, 1.0
    return (TEMP_NONE.value if temp.scalar == 1.0 else TEMP_SCALAR.value), None, temp.scalar


class FusedEngine(LogpEngine):
    """Same bits as `ChunkedEngine` on the same GPU (see the kernels' module docstrings)."""

    name = "fused"

    def __init__(self, config: LaunchConfig | None = None) -> None:
        self.config = config or config_from_environment()

    def row_stats(self, req: LogpRequest) -> RowStats:
        x = req.logits
        n, device = x.shape[0], x.device
        labels = req.labels
        stats = RowStats()  # separate tensors: op outputs may not alias each other
        if req.normalizer or self.config.two_pass:
            stats.row_max = torch.empty(n, dtype=torch.float32, device=device)
        if req.normalizer:
            stats.log_sum = torch.empty(n, dtype=torch.float32, device=device)
            stats.lse = torch.empty(n, dtype=torch.float32, device=device)
        if labels is not None:
            stats.logp = torch.empty(labels.shape, dtype=torch.float32, device=device)
        if req.entropy:
            stats.entropy = torch.empty(n, dtype=torch.float32, device=device)
        if req.full:
            stats.full = torch.empty(x.shape, dtype=torch.float32, device=device)
        launch.row_stats(x, labels, *_temperature_args(req.temperature), req.bits, req.entropy, stats.row_max,
                         stats.log_sum, stats.lse, stats.logp, stats.entropy, self.config, stats.full)
        return stats

    def bind_scores(self, req: LogpRequest, out: torch.Tensor) -> Callable[[Sequence[torch.Tensor]], bool] | None:
        """The request's one launch as a `BoundLaunch` (see `launch.bind_row_stats`), for a request of one
        output and a float temperature; it declines once `self.config` is another object than it was bound
        with (a tuning run replacing the launch parameters)."""
        if req.entropy or req.normalizer or req.temperature.rows is not None:
            return None
        temp_mode, _, t_scalar = _temperature_args(req.temperature)
        config = self.config
        bound = launch.bind_row_stats(req.logits, req.labels, temp_mode, t_scalar, req.bits, None if req.full else out,
                                      config, out if req.full else None)
        if bound is None:
            return None
        return lambda tensors: self.config is config and bound(tensors)

    def shard_max(self, req: LogpRequest) -> torch.Tensor:
        x = req.logits
        n = x.shape[0]
        if not (x.shape[1] and n):  # a zero-width shard: -inf, the identity of the all-reduce MAX
            return torch.full((n,), float("-inf"), dtype=torch.float32, device=x.device)
        row_max = torch.empty(n, dtype=torch.float32, device=x.device)  # the kernel writes every row
        launch.shard_max(x, *_temperature_args(req.temperature), row_max, self.config)
        return row_max

    def shard_sums(self, req: LogpRequest, row_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = req.logits
        n = x.shape[0]
        launching = bool(x.shape[1] and n)  # else zeros: a zero-width shard adds nothing to the all-reduce SUM
        alloc = torch.empty if launching else torch.zeros
        fixed = alloc(n, dtype=torch.int64, device=x.device)
        entropy_fixed = alloc(n, dtype=torch.int64, device=x.device) if req.entropy else None
        if launching:
            launch.shard_sums(x, *_temperature_args(req.temperature), row_max.contiguous(), req.bits, req.entropy,
                              fixed, entropy_fixed, self.config)
        return fixed, entropy_fixed

    def grad(self, req: LogpRequest, stats: RowStats, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None,
             out: torch.Tensor) -> None:
        x = req.logits
        if x.shape[0] == 0 or x.shape[1] == 0:
            return
        launch.grad(x, out, req.labels, req.vocab_offset, req.vocab_total, *_temperature_args(req.temperature),
                    stats.row_max, stats.log_sum, stats.entropy, g_logp, g_entropy, self.config)
