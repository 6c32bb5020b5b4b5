"""The invariant-logp contract (docs/design.md) as small torch functions on one block of rows.

Every invariant path (the `chunked` torch path, the `fused` GPU kernels, the vocab-parallel provider)
produces its per-row statistics with the same arithmetic, so the order-free parts (exact max, int64
fixed-point sums) are the only parts that differ in how they are reduced:

    z      = fp32(x) / T                              (IEEE division; skipped without a temperature)
    M      = max_j z[j] + 0.0                         (exact, order-free; -0.0 becomes +0.0)
    S      = sum_j trunc(exp(z[j] - M) * 2^F)         (int64: order-free)
    E      = sum_j trunc(exp(z[j] - M) (z[j] - M) 2^F)  (int64, <= 0; only for the entropy)
    L      = fp32(log(fp64(S) * 2^-F))                (the log of the normaliser, relative to M)
    lse    = fp32(fp64(M) + log(fp64(S) * 2^-F))
    logp   = (z[y] - M) - L, or 0 where y is outside [0, V) or the row is entirely -inf
    H      = fp32(log(fp64(S) 2^-F) - fp64(E) / fp64(S)), 0 for an entirely -inf row
    lp[j]  = (z[j] - M) - L,  p[j] = exp(lp[j])
    dz[j]  = ((0 - p[j]) + onehot(y)[j]) * (g_lp / T)     (+ (p[j] (lp[j] + H)) * -(g_h / T) for entropy)

Subtracting M before L keeps logp right when |M| is huge (logits of 1e30: lse rounds to M, but
(z[y] - M) - L is still -log V for a uniform row). A row holding NaN or +inf, or a per-row temperature that
is not finite and > 0, has M = NaN or +inf and gets NaN for L, lse, H and, where its label is valid, logp.
A vocabulary shard computes its max, then its sums given the all-reduced max; max/sum/sum all-reduced
over the shards give the same bits as the unsplit row.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def exp32(t: torch.Tensor) -> torch.Tensor:
    """The contract's fp32 exponential: torch's CUDA `exp` on a GPU (libdevice's `expf`, the kernels' own);
    on the CPU the fp64 `exp` rounded to fp32 (the correctly rounded `expf` but where a result lies within
    an fp64 ulp of an fp32 rounding boundary). Why not torch's CPU fp32 `exp`: with it, the vocab-parallel
    tests whose ranks are separate processes failed now and then (ranks of one call disagreeing; 2 of 5
    runs of `pytest tests/test_tp_agreement.py tests/test_api_and_config.py -k "workspace or world2"`,
    0 of 4 with this route). A direct probe (`benchmarks/cpu_exp_determinism.py`: 120 processes, one
    result each way) did not reproduce a difference, so the cause is not pinned down; this route does not
    depend on the CPU's vector-math dispatch either way."""
    if t.device.type == "cpu":
        return torch.exp(t.double()).to(torch.float32)
    return torch.exp(t)


def scaled_logits(x: torch.Tensor, divisor: torch.Tensor | None) -> torch.Tensor:
    """A fresh fp32 copy of a [n, c] block of logits, divided by the per-row (or 0-d) temperature."""
    z = x.to(torch.float32, copy=True)
    if divisor is not None:
        z.div_(divisor.unsqueeze(1) if divisor.dim() == 1 else divisor)
    return z


def block_row_max(z: torch.Tensor) -> torch.Tensor:
    """Row max of a [n, c] fp32 block (c >= 1), with -0.0 made +0.0."""
    return z.amax(dim=1) + 0.0


def mark_bad_rows(row_max: torch.Tensor, bad_rows: torch.Tensor | None) -> torch.Tensor:
    """NaN as the max of rows whose temperature is bad (see rl_logp.temperature)."""
    if bad_rows is None:
        return row_max
    return torch.where(bad_rows, torch.full_like(row_max, float("nan")), row_max)


def nan_as_inf(row_max: torch.Tensor) -> torch.Tensor:
    """A shard's max for an all-reduce MAX: NaN becomes +inf (both mark a NaN row; MAX carries +inf)."""
    return torch.where(torch.isnan(row_max), torch.full_like(row_max, float("inf")), row_max)


def block_fixed_sums_(
    z: torch.Tensor, row_max: torch.Tensor, bits: int, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(S, E) of a block as int64 per row given the (global) max M; consumes z. E is None without entropy.

    Rows whose max is -inf (fully masked) shift by 0 instead, so every term is exp(-inf) = 0; terms with
    exp(d) == 0 (masked columns) add exactly 0 to E.
    """
    shift = torch.where(row_max == NEG_INF, torch.zeros_like(row_max), row_max)
    d = z.sub_(shift.unsqueeze(1))
    e = exp32(d)
    entropy_sum = None
    if entropy:
        term = (e * d).mul_(2.0**bits)
        term.masked_fill_(torch.isnan(term), 0.0)
        entropy_sum = term.to(torch.int64).sum(dim=1)
    fixed_sum = e.mul_(2.0**bits).to(torch.int64).sum(dim=1)
    return fixed_sum, entropy_sum


def finalize(
    row_max: torch.Tensor, fixed_sum: torch.Tensor, entropy_sum: torch.Tensor | None, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(L, lse, H) per row from (M, S, E); NaN for rows whose M is NaN or +inf."""
    s = fixed_sum.to(torch.float64)
    log_sum = torch.log(s * 2.0**-bits)
    bad = torch.isnan(row_max) | torch.isposinf(row_max)
    nan = torch.full_like(row_max, float("nan"))
    log_sum32 = torch.where(bad, nan, log_sum.to(torch.float32))
    lse = torch.where(bad, nan, (row_max.to(torch.float64) + log_sum).to(torch.float32))
    entropy = None
    if entropy_sum is not None:
        h = log_sum - entropy_sum.to(torch.float64) / s
        h32 = torch.where(fixed_sum > 0, h, torch.zeros_like(h)).to(torch.float32)
        entropy = torch.where(bad, nan, h32)
    return log_sum32, lse, entropy


def shard_target_logit(x: torch.Tensor, local_labels: torch.Tensor, divisor: torch.Tensor | None) -> torch.Tensor:
    """z[y] for each label inside this [n, c] block, +0.0 elsewhere (fp32, the labels' shape: [n], or
    [n, K] for K labels per row).

    `+ 0.0` maps -0.0 to +0.0, so summing the owner's value with other shards' zeros is exact.
    """
    n, width = x.shape
    if width == 0:
        return torch.zeros(local_labels.shape, dtype=torch.float32, device=x.device)
    labels = local_labels.reshape(n, -1)
    owned = (labels >= 0) & (labels < width)
    value = x.gather(1, torch.where(owned, labels, torch.zeros_like(labels))).to(torch.float32)
    if divisor is not None:
        value = value / (divisor.unsqueeze(1) if divisor.dim() == 1 else divisor)
    return (torch.where(owned, value, torch.zeros_like(value)) + 0.0).reshape(local_labels.shape)


def assemble_logp(
    target_logit: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor, labels: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """logp = (z[y] - M) - L for each label with a log-probability, 0 elsewhere (fp32, the labels' shape)."""
    rows = (row_max.shape[0], -1)
    logp = (target_logit.reshape(rows) - row_max.unsqueeze(1)) - log_sum.unsqueeze(1)
    flat = labels.reshape(rows)
    valid = (flat >= 0) & (flat < vocab_size) & (row_max.unsqueeze(1) != NEG_INF)
    return torch.where(valid, logp, torch.zeros_like(logp)).reshape(labels.shape)


def full_logprobs(x: torch.Tensor, divisor: torch.Tensor | None, row_max: torch.Tensor,
                  log_sum: torch.Tensor) -> torch.Tensor:
    """(z - M) - L for every column of a [n, c] block (fp32 [n, c]): column j holds what `assemble_logp`
    gives label j wherever M is finite (a row of -inf gives NaN, as log_softmax does)."""
    return scaled_logits(x, divisor).sub_(row_max.unsqueeze(1)).sub_(log_sum.unsqueeze(1))


def grad_scale(grad: torch.Tensor, divisor: torch.Tensor | None) -> torch.Tensor:
    """g / T per row in fp32 (IEEE division)."""
    g = grad.to(torch.float32)
    return g if divisor is None else g / divisor


def block_grad(
    x: torch.Tensor,
    divisor: torch.Tensor | None,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    logp_part: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    entropy_part: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """dz of a [n, c] block in fp32, in the operations of the module docstring.

    logp_part: (local label [n], label valid [n] bool, g_lp / T [n]); entropy_part: (H [n], g_h / T [n]).
    The onehot difference is formed as (0 - p) and then + 1 at the label, exactly the IEEE value of
    onehot - p (a plain `-p` would give -0.0 where p == 0).
    """
    lp = scaled_logits(x, divisor).sub_(row_max.unsqueeze(1)).sub_(log_sum.unsqueeze(1))
    p = exp32(lp)
    live = (row_max != NEG_INF).unsqueeze(1)
    out = None
    if logp_part is not None:
        local_labels, valid, scale = logp_part
        a = torch.zeros_like(p).sub_(p)
        owned = ((local_labels >= 0) & (local_labels < x.shape[1])).unsqueeze(1)
        # + 1 at the label (no host sync): rows without a label here add +0.0 at column 0, which leaves
        # every value of `a` (never -0.0: 0 - p is +0.0 or negative) unchanged.
        at = torch.where(owned, local_labels.unsqueeze(1), 0)
        a.scatter_add_(1, at, owned.to(a.dtype))
        a.mul_(scale.unsqueeze(1))
        out = a.masked_fill_(~(valid.unsqueeze(1) & live), 0.0)
    if entropy_part is not None:
        entropy, scale = entropy_part
        b = lp.add_(entropy.unsqueeze(1)).mul_(p).mul_((-scale).unsqueeze(1))
        b.masked_fill_((p == 0) | ~live, 0.0)
        out = b if out is None else out.add_(b)
    return out
