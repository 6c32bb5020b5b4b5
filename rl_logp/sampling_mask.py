"""The top-k / top-p kept set as a contract: the same tokens on the rollout side and in the trainer.

vLLM's `processed_logprobs` mode scores the sampled token under the distribution it sampled from: the
logits divided by T, with every token outside the top-k / top-p set at -inf. To match it bit for bit the
trainer must mask the same tokens. vLLM's own rules are float rules (a Triton pivot search, or a sort
and an fp32 cumulative sum whose ties split by sort order), so this module defines the kept set exactly
and the rl-logp vLLM adapter makes vLLM sample from it. For one row `z = fp32(x) / T` (IEEE division):

- Top-k (k an integer; k <= 0 or k >= V means none): `tau_k` = the k-th largest value of z, counting
  repeated values; keep `{j : z[j] >= tau_k}`. Ties at the boundary are all kept (so more than k tokens
  may survive), exactly vLLM's PyTorch rule (`logits < sorted[V - k]` is masked); vLLM's Triton kernel
  keeps exactly k, choosing among tied values by column.
- Top-p (p an fp32 value; p >= 1 or NaN means none), applied after top-k as vLLM does: with
  `M = max z`, `q[j] = trunc(exp(z[j] - M) * 2^F)` (int64, the fixed-point terms of rl-logp's sum `S`)
  over the top-k set K and `S_K = sum_{j in K} q[j]`, let `P = ceil(p * S_K)`, computed exactly in
  integers from p's binary expansion. Token j in K is kept iff the mass of the tokens of K with a
  strictly larger q is below P: `sum_{i in K, q[i] > q[j]} q[i] < P`. That is the smallest set of top
  tokens whose mass reaches `p * S_K`, with tokens of equal q kept or dropped together; the top token
  is always kept. vLLM's rule is the same up to its fp32 softmax and cumulative sum.
- Rows whose max is not finite (all -inf, or holding NaN / +inf) are not masked.

Every quantity is a pure function of the row's values (exact max, exact integer sums, and integer
comparisons), so the kept set does not depend on the batch, the row's position, the chunking or the
column order. It does depend on the device's `exp` (as rl-logp's own sums do): compute it on the same
device type on both sides.

Two implementations of one rule: on CUDA (with Triton) the kernel `rl_logp.kernels.kept_set`, which
finds the top-k value and the top-p cut from per-row histograms of the fixed-point terms without sorting
the row; elsewhere `reference_thresholds`, pure torch (a sort per row block), the CPU path and the
reference the kernel is tested against (same tokens, same bits).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from rl_logp import rollout_calls
from rl_logp.config import LogpConfig, resolve_config
from rl_logp.contract import exp32
from rl_logp.engines import fused_runs_on

NEG_INF = float("-inf")
SORT_BYTES_PER_ELEMENT = 40
"""Workspace of one masked element: sorted fp32 value and its int64 index, int64 q, its prefix sum,
and compares."""

_LOW31 = (1 << 31) - 1


def apply_top_k_top_p(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor | None = None,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    config: LogpConfig | Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """`z = fp32(logits) / T` with -inf outside the kept set: a fresh fp32 tensor of the logits' shape.

    `temperature`, `top_k` and `top_p` are a number for every row or a tensor with one value per row
    (the logits' leading shape). `rl_logp.logprobs(apply_top_k_top_p(x, temperature=T, top_k=k,
    top_p=p), tokens)` gives the bits the patched vLLM reports in `processed_logprobs` mode with these
    sampling parameters. Differentiable with respect to `logits` (masked columns get a zero gradient).
    """
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"rl_logp: logits of shape {tuple(logits.shape)} have no vocabulary dimension")
    vocab = logits.shape[-1]
    _check_number("temperature", temperature, float("inf"))
    _check_number("top_p", top_p, 1.0)
    z = logits.reshape(-1, vocab).to(torch.float32)
    n = z.shape[0]
    divisor = _per_row("temperature", temperature, n, z.device, torch.float32)
    if divisor is not None:
        z = z / divisor.unsqueeze(1)  # a tensor divisor: IEEE division on every device
    k = _per_row("top_k", top_k, n, z.device, torch.int64)
    p = _per_row("top_p", top_p, n, z.device, torch.float32)
    cfg = resolve_config(config)
    threshold = kept_thresholds(z.detach(), k, p, cfg.fixed_point_bits, cfg.chunk_bytes)
    return z.masked_fill(z < threshold.unsqueeze(1), NEG_INF).reshape(logits.shape)  # a fresh tensor


def mask_logits_(
    z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, config: LogpConfig
) -> torch.Tensor:
    """Set the [n, V] fp32 `z` (already divided by T) to -inf outside the kept set, in place, and return it.

    `top_k` / `top_p`: one value per row or None (vLLM's convention; k = V or p = 1 leave a row alone).
    No host synchronisation, fixed shapes: safe inside a CUDA graph.
    """
    if _uses_kernel(z):
        _kernel(z, top_k, top_p, config.fixed_point_bits, write=True)
        return z
    threshold = kept_thresholds(z, top_k, top_p, config.fixed_point_bits, config.chunk_bytes)
    return z.masked_fill_(z < threshold.unsqueeze(1), NEG_INF)


def sample_kept(z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, noise: torch.Tensor,
                config: LogpConfig) -> torch.Tensor:
    """One draw per row of the [n, V] fp32 `z` (already divided by T) from its kept set, given exponential
    `noise` of z's shape: the kept column with the largest `z - log(noise)` (int64 [n]; the first on a tie),
    vLLM's native `argmax(probs / noise)` in Gumbel-max form (the same ranking of the columns). `z` is left
    as it is. On CUDA the kept-set kernel draws in its last pass (`rl_logp.kernels.kept_set` with a draw),
    elsewhere torch, with the same draw on the same device."""
    if _uses_kernel(z) and noise.device == z.device and noise.dtype == torch.float32 and noise.stride(1) == 1:
        return _kernel(z, top_k, top_p, config.fixed_point_bits, write=False, noise=noise)
    threshold = kept_thresholds(z, top_k, top_p, config.fixed_point_bits, config.chunk_bytes)
    return torch.where(z >= threshold.unsqueeze(1), z - noise.log(), NEG_INF).argmax(dim=-1)


def kept_thresholds(
    z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, bits: int, chunk_bytes: int
) -> torch.Tensor:
    """Per row of the [n, V] fp32 `z`, the smallest kept value: the row keeps `z >= threshold` (-inf for
    a row left alone). The Triton kernel on CUDA, else `reference_thresholds`."""
    if _uses_kernel(z):
        return _kernel(z, top_k, top_p, bits, write=False)
    return reference_thresholds(z, top_k, top_p, bits, chunk_bytes)


def _uses_kernel(z: torch.Tensor) -> bool:
    return z.is_cuda and z.stride(1) == 1 and fused_runs_on(z.device)


def _kernel(z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, bits: int, *,
            write: bool, noise: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's thresholds (and with `write` z masked), or given `noise` its draws (int64 [n]); a call
    whose signature was seen before (the shapes, strides, dtypes and devices of z, k, p and the noise, the
    bits, `write`) runs its plan (`rl_logp.rollout_calls`): the allocations and the launches without the
    set-up."""
    from rl_logp.engines.fused import config_from_environment
    from rl_logp.kernels.kept_set import bind_kept_set, kept_set

    k = None if top_k is None else top_k.contiguous()
    p = None if top_p is None else top_p.to(torch.float32).contiguous()
    key = rollout_calls.signature(("kept_set", bits, write), z, k, p, noise)
    if key is not None:
        out = rollout_calls.run(key, [t for t in (z, k, p, noise) if t is not None])
        if out is not None:
            return out
    n = z.shape[0]
    if noise is None:
        threshold = out = torch.empty(n, dtype=torch.float32, device=z.device)
        draw = None
    else:
        threshold, out = None, torch.empty(n, dtype=torch.int64, device=z.device)
        draw = (noise, out)
    kept_set(z, k, p, bits, threshold, write=write, draw=draw)
    if key is not None:
        bound = bind_kept_set(z, k, p, bits, threshold, write=write, draw=draw,
                              direct=config_from_environment().driver)
        rollout_calls.remember(key, None, bound, out)
    return out


def reference_thresholds(
    z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, bits: int, chunk_bytes: int
) -> torch.Tensor:
    """`kept_thresholds` in pure torch: the kept set is an upper set of z (top-k by value; q is monotone
    in z), so one threshold per row describes it, read off each row sorted. Rows are processed in blocks
    of at most `chunk_bytes` of workspace. A row left alone gets its smallest value or -inf."""
    top_k = None if top_k is None else top_k.to(torch.int64)
    top_p = None if top_p is None else top_p.to(torch.float32)
    n, vocab = z.shape
    out = torch.full((n,), NEG_INF, dtype=torch.float32, device=z.device)
    if n == 0 or (top_k is None and top_p is None):
        return out
    rows = max(1, chunk_bytes // (SORT_BYTES_PER_ELEMENT * vocab))
    for start in range(0, n, rows):
        block = slice(start, min(n, start + rows))
        k = None if top_k is None else top_k[block]
        p = None if top_p is None else top_p[block]
        out[block] = _block_thresholds(z[block], k, p, bits)
    return out


def _block_thresholds(
    z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, bits: int
) -> torch.Tensor:
    vocab = z.shape[1]
    ordered = torch.sort(z, dim=1, descending=True).values  # NaN sorts first: such rows are left alone
    row_max = ordered[:, 0] + 0.0
    threshold = torch.full_like(row_max, NEG_INF)
    in_k = None
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)
        threshold = ordered.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
        in_k = ordered >= threshold.unsqueeze(1)
    if top_p is not None:
        shift = torch.where(row_max == NEG_INF, torch.zeros_like(row_max), row_max)
        q = exp32(ordered - shift.unsqueeze(1)).mul_(2.0**bits).to(torch.int64)  # non-increasing
        if in_k is not None:
            q.masked_fill_(~in_k, 0)
        target = ceil_times(top_p, q.sum(dim=1))
        above = torch.cumsum(q, dim=1).sub_(q)  # mass of the positions before each one
        count = (above < target.unsqueeze(1)).sum(dim=1).clamp_(min=1)
        smallest_q = q.gather(1, (count - 1).unsqueeze(1))
        kept = (q >= smallest_q).sum(dim=1)  # the whole tie group of the last kept position
        by_p = ordered.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
        threshold = torch.where(top_p < 1.0, by_p, threshold)
    return torch.where(torch.isfinite(row_max), threshold, torch.full_like(threshold, NEG_INF))


def ceil_times(p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """`ceil(p * s)` exactly, for fp32 `p` in [0, 1] and int64 `s` >= 0 (elementwise; int64 result).

    p = m / 2^e with m < 2^24 an integer (`frexp`); m * s needs up to 87 bits, so s is split at bit 31:
    m * s = c * 2^31 + r with c, r in int64, and the quotient by 2^e is rounded up from (c, r). The
    result is at most s, so nothing overflows for p <= 1. Values of p outside [0, 1] give unspecified
    results (callers skip rows with p >= 1).
    """
    mantissa, exponent = torch.frexp(p.to(torch.float32))
    m = (mantissa * 2.0**24).to(torch.int64)
    e = 24 - exponent.to(torch.int64)
    low = m * (s & _LOW31)
    c = m * (s >> 31) + (low >> 31)
    r = low & _LOW31
    # e >= 31: ceil((c + r / 2^31) / 2^t) with t = e - 31 (c < 2^57, so t is capped at 62 harmlessly)
    t = (e - 31).clamp(0, 62)
    one = torch.ones_like(t)
    rest = (c & (torch.bitwise_left_shift(one, t) - 1)) | r
    wide = torch.bitwise_right_shift(c, t) + (rest != 0).to(torch.int64)
    # e < 31: c * 2^(31 - e) + ceil(r / 2^e)
    u = (31 - e).clamp(0, 31)
    e_small = e.clamp(0, 31)
    narrow = torch.bitwise_left_shift(c, u) + torch.bitwise_right_shift(
        r + torch.bitwise_left_shift(one, e_small) - 1, e_small
    )
    return torch.where(e >= 31, wide, narrow)


def _per_row(
    name: str, value: float | int | torch.Tensor | None, n: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor | None:
    """A number or a per-row parameter as an [n] tensor on `device`, or None when it is not set."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.device != device:
            raise ValueError(f"rl_logp: {name} is on {value.device} but logits on {device}; move it there")
        if value.dim() == 0:
            return value.to(dtype).expand(n)
        if value.numel() != n:
            raise ValueError(
                f"rl_logp: {name} has shape {tuple(value.shape)}; give a number or one value per row ({n} rows)"
            )
        return value.reshape(n).to(dtype)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"rl_logp: {name} must be a number or a tensor, got {type(value).__name__}")
    if dtype == torch.int64 and not isinstance(value, int):
        raise TypeError(f"rl_logp: {name}={value!r} must be an integer")
    return torch.full((n,), value, dtype=dtype, device=device)


def _check_number(name: str, value: float | int | torch.Tensor | None, high: float) -> None:
    """A number given for every row must lie in (0, high] and be finite (tensors are not checked: no sync)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        as_float32 = float(torch.tensor(float(value), dtype=torch.float32))
        if not (math.isfinite(as_float32) and 0.0 < as_float32 <= high):
            raise ValueError(f"rl_logp: {name}={value} must be finite and in (0, {high}] (as float32)")
