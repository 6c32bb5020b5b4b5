"""The invariant-logp contract of DESIGN.md as small torch functions on one block of rows.

Every invariant path (the `chunked` torch path, the `fused` GPU kernel, the vocab-parallel provider)
produces its per-row statistics with the same arithmetic and then finishes here, so the order-free parts
(exact max, int64 fixed-point sum) are the only parts that differ in how they are reduced:

    z      = fp32(x) / T                        (IEEE division; skipped when there is no temperature)
    M      = max_j z[j]                         (exact, order-free)
    S      = sum_j trunc(exp(z[j] - M) * 2^F)   (int64: order-free)
    lse    = fp32(fp64(M) + log(fp64(S) * 2^-F))
    logp   = z[y] - lse, or 0 where y is outside [0, V) or the row is entirely -inf
    dz[j]  = (onehot(y)[j] - exp(z[j] - lse)) * (g / T), written in the logits' dtype; 0 on rows with logp 0

A vocabulary shard calls `shard_row_max`, `shard_fixed_sum` and `shard_target_logit` on its slice;
max/sum/sum all-reduced over the shards give the same bits as the unsplit row.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def scaled_logits(x: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """A fresh fp32 copy of a [n, c] block of logits, divided by the per-row temperature [n]."""
    z = x.to(torch.float32, copy=True)
    if temperature is not None:
        z.div_(temperature.unsqueeze(1))
    return z


def block_row_max(z: torch.Tensor) -> torch.Tensor:
    """Row max of a [n, c] fp32 block (c >= 1)."""
    return z.amax(dim=1)


def block_fixed_sum_(z: torch.Tensor, row_max: torch.Tensor, bits: int) -> torch.Tensor:
    """sum_j trunc(exp(z - M) * 2^F) as int64 per row; consumes z (modified in place).

    Rows whose max is -inf (fully masked) shift by 0 instead, so every term is exp(-inf) = 0.
    """
    shift = torch.where(row_max == NEG_INF, torch.zeros_like(row_max), row_max)
    z.sub_(shift.unsqueeze(1)).exp_().mul_(2.0**bits)
    return z.to(torch.int64).sum(dim=1)


def finalize_lse(row_max: torch.Tensor, fixed_sum: torch.Tensor, bits: int) -> torch.Tensor:
    """lse = M + log(S * 2^-F), in fp64 then rounded to fp32; -inf for fully masked rows, NaN for +inf/NaN."""
    lse = row_max.to(torch.float64) + torch.log(fixed_sum.to(torch.float64) * 2.0**-bits)
    lse = torch.where(torch.isposinf(row_max), torch.full_like(lse, float("nan")), lse)
    return lse.to(torch.float32)


def shard_target_logit(
    x: torch.Tensor, local_labels: torch.Tensor, temperature: torch.Tensor | None
) -> torch.Tensor:
    """z[y] for rows whose label falls inside this [n, c] block, +0.0 elsewhere (fp32 [n]).

    `+ 0.0` maps -0.0 to +0.0, so summing the owner's value with other shards' zeros is exact.
    """
    width = x.shape[1]
    owned = (local_labels >= 0) & (local_labels < width)
    if width == 0:
        return torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    index = torch.where(owned, local_labels, torch.zeros_like(local_labels)).unsqueeze(1)
    value = x.gather(1, index).squeeze(1).to(torch.float32)
    if temperature is not None:
        value = value / temperature
    return torch.where(owned, value, torch.zeros_like(value)) + 0.0


def has_logp(labels: torch.Tensor, vocab_size: int, lse: torch.Tensor) -> torch.Tensor:
    """Rows that get a log-probability: label in [0, V) and not a fully -inf row."""
    return (labels >= 0) & (labels < vocab_size) & (lse != NEG_INF)


def assemble_logp(
    target_logit: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """logp = z[y] - lse on rows with a log-probability, 0 elsewhere (fp32)."""
    logp = target_logit - lse
    return torch.where(has_logp(labels, vocab_size, lse), logp, torch.zeros_like(logp))


def grad_row_terms(
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    temperature: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row inputs of every backward: (lse, g / T), with lse = +inf marking rows of zero gradient."""
    valid = has_logp(labels, vocab_size, lse)
    scale = grad_out.to(torch.float32)
    if temperature is not None:
        scale = scale / temperature
    lse_for_grad = torch.where(valid, lse, torch.full_like(lse, float("inf")))
    return lse_for_grad, torch.where(valid, scale, torch.zeros_like(scale))


def block_grad(
    x: torch.Tensor,
    temperature: torch.Tensor | None,
    lse_for_grad: torch.Tensor,
    local_labels: torch.Tensor,
    grad_scale: torch.Tensor,
) -> torch.Tensor:
    """(onehot(y) - exp(z - lse)) * (g / T) for a [n, c] block, fp32, +0.0 on rows marked lse = +inf.

    The onehot difference is formed as (0 - p) everywhere and then (0 - p) + 1 at the label, which is
    exactly the IEEE value of onehot - p (a plain `-p` would give -0.0 where p == 0).
    """
    d = scaled_logits(x, temperature)
    d.sub_(lse_for_grad.unsqueeze(1)).exp_().neg_().add_(0.0)
    owned = (local_labels >= 0) & (local_labels < x.shape[1])
    rows = owned.nonzero().squeeze(1)
    cols = local_labels[rows]
    d[rows, cols] = d[rows, cols] + 1.0
    d.mul_(grad_scale.unsqueeze(1))
    return d.masked_fill_(torch.isposinf(lse_for_grad).unsqueeze(1), 0.0)


def block_entropy_sum_(z: torch.Tensor, row_max: torch.Tensor, bits: int) -> torch.Tensor:
    """sum_j trunc(exp(d) * d * 2^F) with d = z - M, as int64 per row (signed, order-free); consumes z.

    Terms with exp(d) == 0 (masked -inf columns) contribute exactly 0.
    """
    shift = torch.where(row_max == NEG_INF, torch.zeros_like(row_max), row_max)
    d = z.sub_(shift.unsqueeze(1))
    e = torch.exp(d)
    term = e.mul_(d).mul_(2.0**bits)
    term.masked_fill_(torch.isnan(term), 0.0)
    return term.to(torch.int64).sum(dim=1)


def finalize_entropy(fixed_sum: torch.Tensor, entropy_sum: torch.Tensor, bits: int) -> torch.Tensor:
    """H = log(S 2^-F) - E / S in fp64, rounded to fp32; 0 for fully masked rows (S == 0)."""
    s = fixed_sum.to(torch.float64)
    h = torch.log(s * 2.0**-bits) - entropy_sum.to(torch.float64) / s
    return torch.where(fixed_sum > 0, h, torch.zeros_like(h)).to(torch.float32)


def block_entropy_grad(
    x: torch.Tensor,
    temperature: torch.Tensor | None,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_scale: torch.Tensor,
) -> torch.Tensor:
    """dH/dz = -p * (z - lse + H), times g/T: formed as (p * ((z - lse) + H)) * (-(g/T)), 0 where p == 0."""
    d = scaled_logits(x, temperature)
    d.sub_(lse.unsqueeze(1))
    p = torch.exp(d)
    d.add_(entropy.unsqueeze(1)).mul_(p).mul_(grad_scale.unsqueeze(1))
    return d.masked_fill_(p == 0, 0.0)
