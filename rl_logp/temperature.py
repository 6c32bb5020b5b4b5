"""The sampling temperature every path applies inside: `z = fp32(x) / T`, an IEEE division.

A `Temperature` is either one Python float for every row (`scalar`; 1.0 means none) or one fp32 value
per row (`rows`, a contiguous [N] tensor on the logits' device). A float is validated on the host; a
tensor cannot be without a host sync, so it is not: a row whose temperature is not finite and > 0 is
scored as NaN (logp, lse, entropy and gradient), like a row whose logits hold NaN.
"""

from __future__ import annotations

import dataclasses
import math

import torch

FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclasses.dataclass(frozen=True)
class Temperature:
    """`rows` [N] fp32, or None with `scalar` applied to every row."""

    rows: torch.Tensor | None = None
    scalar: float = 1.0

    @property
    def is_one(self) -> bool:
        return self.rows is None and self.scalar == 1.0

    def divisor(self, rows: slice, device: torch.device) -> torch.Tensor | None:
        """The divisor of a block of rows as a tensor ([r] or 0-d), or None without a temperature.

        Always a tensor: torch's CUDA division by a Python scalar multiplies by its reciprocal, which is
        not the IEEE quotient the contract (and the kernel's `div_rn`) computes.
        """
        if self.rows is not None:
            return self.rows[rows]
        if self.scalar == 1.0:
            return None
        return torch.full((), self.scalar, dtype=torch.float32, device=device)  # a fill kernel: no host copy

    def bad_rows(self) -> torch.Tensor | None:
        """Rows whose (tensor) temperature is not finite and > 0; None for a validated float."""
        if self.rows is None:
            return None
        return ~((self.rows > 0) & torch.isfinite(self.rows))


def temperature_from_float(value: float) -> Temperature:
    """Check a float temperature on the host: finite, > 0, and a normal float32 (the kernels divide by it
    in float32). Under torch.compile these comparisons guard a symbolic float, so the checks hold per graph."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.SymFloat, torch.SymInt)):
        raise TypeError(
            f"rl_logp: temperature must be a float or a tensor, got {type(value).__name__}; "
            "pass e.g. temperature=0.7 or a tensor with one value per row"
        )
    if not (value > 0 and value < math.inf):  # comparisons only: a symbolic float under torch.compile
        raise ValueError(f"rl_logp: temperature={value} must be finite and > 0")
    if not FLOAT32_TINY <= value <= FLOAT32_MAX:
        raise ValueError(
            f"rl_logp: temperature={value} is outside float32's normal range (logits are divided by T in "
            f"float32, where it would underflow or overflow); use a temperature in [{FLOAT32_TINY:.3g}, "
            f"{FLOAT32_MAX:.3g}]"
        )
    return Temperature(scalar=value)


def temperature_from_tensor(value: torch.Tensor, lead_shape: torch.Size, n: int, device: torch.device) -> Temperature:
    """A 0-d tensor or one value per row (the logits' row shape, size-1 dimensions ignored)."""
    if value.device != device:
        raise ValueError(
            f"rl_logp: temperature is on {value.device} but logits on {device}; "
            "move it with temperature.to(logits.device)"
        )
    if not value.is_floating_point():
        raise TypeError(f"rl_logp: temperature has dtype {value.dtype}; give a floating-point tensor")
    if value.requires_grad:
        raise ValueError(
            "rl_logp: temperature requires grad, but rl-logp gives no gradient with respect to the "
            "temperature; pass temperature.detach()"
        )
    if value.dim() == 0:
        rows = value.reshape(1).expand(n)
    elif same_rows(value.shape, lead_shape):
        rows = value.reshape(n)
    else:
        raise ValueError(
            f"rl_logp: temperature has shape {tuple(value.shape)}; give a float, a 0-d tensor "
            f"or one value per row, shape {tuple(lead_shape)}"
        )
    return Temperature(rows=rows.to(torch.float32).contiguous())


def same_rows(shape: torch.Size, lead_shape: torch.Size) -> bool:
    """Whether `shape` holds one value per row of `lead_shape` in row order (size-1 dimensions ignored)."""
    if tuple(shape) == tuple(lead_shape):
        return True
    return [d for d in shape if d != 1] == [d for d in lead_shape if d != 1]
