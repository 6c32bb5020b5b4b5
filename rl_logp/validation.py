"""Input checks of the public API: every message names the argument and says how to fix it.

Nothing here reads a tensor's values, so nothing here syncs with a GPU. `rl_logp.request.prepare_inputs`
runs these checks and flattens the inputs.
"""

from __future__ import annotations

import torch

from rl_logp.temperature import Temperature, same_rows, temperature_from_float, temperature_from_tensor

LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
LABEL_DTYPES = (torch.int32, torch.int64)


def check_logits(logits: object) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"rl_logp: logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(
            f"rl_logp: logits have dtype {logits.dtype}; bf16, fp16, fp32 or fp64 are supported "
            "(cast with logits.float())"
        )
    if logits.dim() < 1:
        raise ValueError("rl_logp: logits must have a vocabulary dimension, shape [..., V]")
    return logits


def check_labels(labels: object, logits: torch.Tensor, *, columns: bool = False, against: str = "logits") -> torch.Tensor:
    """Labels of the row shape of `logits` (named `against` in the messages: `hidden` for the fused lm_head);
    with `columns`, that shape + [K] (K ids per row)."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"rl_logp: labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype not in LABEL_DTYPES:
        raise TypeError(f"rl_logp: labels have dtype {labels.dtype}; use int64 or int32 (labels.long())")
    if labels.device != logits.device:
        raise ValueError(
            f"rl_logp: labels are on {labels.device} but {against} on {logits.device}; "
            f"move them with labels.to({against}.device)"
        )
    if columns:
        if labels.dim() != logits.dim() or labels.shape[:-1] != logits.shape[:-1]:
            raise ValueError(
                f"rl_logp: columns have shape {tuple(labels.shape)} but logits {tuple(logits.shape)}; columns "
                "must have the logits' shape with the last dimension holding K column ids per row, e.g. [N, K] "
                "for [N, V] logits"
            )
        return labels
    if not same_rows(labels.shape, logits.shape[:-1]):
        raise ValueError(
            f"rl_logp: labels have shape {tuple(labels.shape)} but {against} {tuple(logits.shape)}; "
            f"labels must have the shape of {against} without its last dimension "
            f"(size-1 dimensions aside, e.g. [1, N] labels with [N, {'V' if against == 'logits' else 'H'}] {against})"
        )
    return labels


def check_temperature(temperature: float | torch.Tensor | None, logits: torch.Tensor, n: int) -> Temperature:
    if temperature is None:
        return Temperature()
    if isinstance(temperature, torch.Tensor):
        return temperature_from_tensor(temperature, logits.shape[:-1], n, logits.device)
    return temperature_from_float(temperature)


def check_vocab_fits(vocab_size: int, bits: int) -> None:
    """The int64 sum of V terms below 2^F each cannot overflow while V < 2^(63-F)."""
    if vocab_size == 0:
        raise ValueError("rl_logp: logits have an empty vocabulary dimension (V == 0)")
    if vocab_size >= 2 ** (63 - bits):
        raise ValueError(
            f"rl_logp: a vocabulary of {vocab_size} columns can overflow the int64 sum with "
            f"fixed_point_bits={bits}; use fixed_point_bits <= {63 - max(1, vocab_size).bit_length()}"
        )
