"""Input checks of the public API: every message names the argument and says how to fix it.

`prepare_inputs` turns `logits [..., V]`, `labels [...]` and a temperature into the 2-D/1-D tensors the
engines take, without copying unless the logits' last dimension is not contiguous.
"""

from __future__ import annotations

import dataclasses
import math

import torch

LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LABEL_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass
class PreparedInputs:
    logits: torch.Tensor  # [N, V_local], last dim contiguous
    labels: torch.Tensor  # [N] int64
    temperature: torch.Tensor | None  # [N] fp32, or None for T == 1
    lead_shape: torch.Size


def _check_logits(logits: object) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"rl_logp: logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(
            f"rl_logp: logits have dtype {logits.dtype}; bf16, fp16 or fp32 are supported "
            "(cast with logits.float() or logits.to(torch.bfloat16))"
        )
    if logits.dim() < 1:
        raise ValueError("rl_logp: logits must have a vocabulary dimension, shape [..., V]")
    return logits


def _check_labels(labels: object, logits: torch.Tensor) -> torch.Tensor:
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"rl_logp: labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype not in LABEL_DTYPES:
        raise TypeError(f"rl_logp: labels have dtype {labels.dtype}; use int64 or int32 (labels.long())")
    if labels.device != logits.device:
        raise ValueError(
            f"rl_logp: labels are on {labels.device} but logits on {logits.device}; "
            "move them with labels.to(logits.device)"
        )
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"rl_logp: labels have shape {tuple(labels.shape)} but logits {tuple(logits.shape)}; "
            "labels must have the logits' shape without the last (vocabulary) dimension"
        )
    return labels


def _check_temperature(
    temperature: float | torch.Tensor | None, logits: torch.Tensor, n: int
) -> torch.Tensor | None:
    if temperature is None:
        return None
    if isinstance(temperature, torch.Tensor):
        if temperature.device != logits.device:
            raise ValueError(
                f"rl_logp: temperature is on {temperature.device} but logits on {logits.device}; "
                "move it with temperature.to(logits.device)"
            )
        if temperature.dim() == 0:
            temperature = temperature.expand(n)
        elif temperature.shape == logits.shape[:-1]:
            temperature = temperature.reshape(n)
        else:
            raise ValueError(
                f"rl_logp: temperature has shape {tuple(temperature.shape)}; give a float, a 0-d tensor "
                f"or one value per row, shape {tuple(logits.shape[:-1])}"
            )
        temperature = temperature.to(torch.float32)
        if n and not bool((temperature > 0).all() & torch.isfinite(temperature).all()):
            raise ValueError("rl_logp: temperature must be finite and > 0 in every row")
        return temperature.contiguous()
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"rl_logp: temperature must be a float or a tensor, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"rl_logp: temperature={temperature} must be finite and > 0")
    if float(temperature) == 1.0:
        return None
    return torch.full((n,), float(temperature), dtype=torch.float32, device=logits.device)


def prepare_inputs(
    logits: object, labels: object, temperature: float | torch.Tensor | None = None
) -> PreparedInputs:
    """Validate and flatten. Logits whose last dimension is strided are copied to contiguous rows."""
    x = _check_logits(logits)
    y = _check_labels(labels, x)
    lead_shape = x.shape[:-1]
    vocab = x.shape[-1]
    n = math.prod(lead_shape)
    x2 = x.reshape(n, vocab)
    if vocab > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return PreparedInputs(
        logits=x2,
        labels=y.reshape(n).to(torch.int64),
        temperature=_check_temperature(temperature, x, n),
        lead_shape=lead_shape,
    )


def check_vocab_fits(vocab_size: int, bits: int) -> None:
    """The int64 sum of V terms below 2^F each cannot overflow while V < 2^(63-F)."""
    if vocab_size >= 2 ** (63 - bits):
        raise ValueError(
            f"rl_logp: a vocabulary of {vocab_size} columns can overflow the int64 sum with "
            f"fixed_point_bits={bits}; use fixed_point_bits <= {63 - max(1, vocab_size).bit_length()}"
        )
