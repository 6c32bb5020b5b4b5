"""rl-logp's operators, registered with `torch.library` so `torch.compile` sees each as one opaque op.

    rl_logp::row_stats   whole rows -> (logp, entropy, lse, M, L); autograd registered (backward below)
    rl_logp::grad        the row-local gradient of logp and/or entropy (a new tensor)
    rl_logp::grad_       the same, written into the logits' own storage (inplace_backward)
    rl_logp::shard_max   a vocabulary shard's row max (the vocab-parallel provider all-reduces it)
    rl_logp::shard_sums  a shard's int64 sums S and E given the global max

Each has a fake (meta) implementation that only builds output shapes, so the compiler never traces the
engines: the chunk loop, the Triton launches and the validation stay out of the graph, one graph serves
every row count, and compiled code gives eager's bits. Why `custom_op` and not `triton_op`: the ops
dispatch to two engines (one of them plain torch) and the fused forward launches one or two kernels
depending on the device; `triton_op` would let inductor see and re-schedule the Triton launches, which
buys nothing here (each op is one memory-bound pass) and would expose the kernels' shape-derived launch
arguments to symbolic tracing.

Temperature crosses the op boundary as `temp_rows` (fp32 [N], or None) and `t_scalar` (a float, 1.0 for
none); see `rl_logp.temperature`.
"""

from __future__ import annotations

import torch

from rl_logp.backends import make_engine
from rl_logp.temperature import Temperature

_F32 = torch.float32


def _temperature(temp_rows: torch.Tensor | None, t_scalar: float) -> Temperature:
    return Temperature(rows=temp_rows, scalar=t_scalar)


def row_stats_impl(
    x: torch.Tensor, labels: torch.Tensor | None, temp_rows: torch.Tensor | None, t_scalar: float, bits: int,
    engine: str, chunk_bytes: int, entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's body (called directly on the eager no-grad path, where the dispatcher adds only cost)."""
    stats = make_engine(engine, chunk_bytes).row_stats(x, _temperature(temp_rows, t_scalar), labels, bits, entropy)
    empty = x.new_empty(0, dtype=_F32)
    return (
        empty if stats.logp is None else stats.logp,
        empty if stats.entropy is None else stats.entropy,
        stats.lse,
        stats.row_max,
        stats.log_sum,
    )


@torch.library.custom_op("rl_logp::row_stats", mutates_args=())
def row_stats(
    x: torch.Tensor, labels: torch.Tensor | None, temp_rows: torch.Tensor | None, t_scalar: float, bits: int,
    engine: str, chunk_bytes: int, entropy: bool, inplace_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp of `labels` or [0], entropy or [0], lse, M, L) of whole rows of `x` [N, V]."""
    return row_stats_impl(x, labels, temp_rows, t_scalar, bits, engine, chunk_bytes, entropy)


@row_stats.register_fake
def _row_stats_fake(x, labels, temp_rows, t_scalar, bits, engine, chunk_bytes, entropy, inplace_backward):
    n = x.shape[0]
    return (
        x.new_empty(n if labels is not None else 0, dtype=_F32),
        x.new_empty(n if entropy else 0, dtype=_F32),
        x.new_empty(n, dtype=_F32),
        x.new_empty(n, dtype=_F32),
        x.new_empty(n, dtype=_F32),
    )


def grad_impl(
    x: torch.Tensor, labels: torch.Tensor | None, label_offset: int, vocab_total: int,
    temp_rows: torch.Tensor | None, t_scalar: float, row_max: torch.Tensor, log_sum: torch.Tensor,
    entropy: torch.Tensor | None, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None,
    engine: str, chunk_bytes: int, out: torch.Tensor,
) -> None:
    make_engine(engine, chunk_bytes).grad(
        x, _temperature(temp_rows, t_scalar), labels, label_offset, vocab_total, row_max, log_sum, entropy,
        g_logp, g_entropy, out,
    )


@torch.library.custom_op("rl_logp::grad", mutates_args=())
def grad(
    x: torch.Tensor, labels: torch.Tensor | None, label_offset: int, vocab_total: int,
    temp_rows: torch.Tensor | None, t_scalar: float, row_max: torch.Tensor, log_sum: torch.Tensor,
    entropy: torch.Tensor | None, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None,
    engine: str, chunk_bytes: int,
) -> torch.Tensor:
    """dz of logp (g_logp given) and/or entropy (g_entropy given) for a block of columns of x."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    grad_impl(x, labels, label_offset, vocab_total, temp_rows, t_scalar, row_max, log_sum, entropy, g_logp,
              g_entropy, engine, chunk_bytes, out)
    return out


@grad.register_fake
def _grad_fake(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("rl_logp::grad_", mutates_args=("x",))
def grad_(
    x: torch.Tensor, labels: torch.Tensor | None, label_offset: int, vocab_total: int,
    temp_rows: torch.Tensor | None, t_scalar: float, row_max: torch.Tensor, log_sum: torch.Tensor,
    entropy: torch.Tensor | None, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None,
    engine: str, chunk_bytes: int,
) -> None:
    """`grad`, written over `x` (the gradient replaces the logits it was computed from)."""
    grad_impl(x, labels, label_offset, vocab_total, temp_rows, t_scalar, row_max, log_sum, entropy, g_logp,
              g_entropy, engine, chunk_bytes, x)


@grad_.register_fake
def _grad_inplace_fake(x, *args):
    return None


def gradient(x: torch.Tensor, args: tuple, inplace: bool) -> torch.Tensor:
    """`rl_logp::grad` of x with `args` (its remaining arguments), or `rl_logp::grad_` written over x."""
    if inplace:
        torch.ops.rl_logp.grad_(x, *args)
        return x
    return torch.ops.rl_logp.grad(x, *args)


def _setup_row_stats(ctx, inputs, output) -> None:
    x, labels, temp_rows, t_scalar, _bits, engine, chunk_bytes, entropy, inplace_backward = inputs
    _, ent, _, row_max, log_sum = output
    ctx.save_for_backward(x, labels, temp_rows, row_max, log_sum, ent if entropy else None)
    ctx.t_scalar, ctx.engine, ctx.chunk_bytes = t_scalar, engine, chunk_bytes
    ctx.inplace_backward = inplace_backward
    ctx.mark_non_differentiable(output[2], output[3], output[4])


def _row_stats_backward(ctx, g_logp, g_entropy, g_lse, g_max, g_log_sum):
    x, labels, temp_rows, row_max, log_sum, ent = ctx.saved_tensors
    if labels is None or g_logp is None or g_logp.numel() == 0:
        g_logp = None
    if ent is None or g_entropy is None or g_entropy.numel() == 0:
        g_entropy = None
    if g_logp is None and g_entropy is None:
        return (None,) * 9
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # backward(create_graph=True)
        raise RuntimeError(
            "rl_logp: double backward (backward with create_graph=True through logprobs/entropy) is not "
            "supported; compute higher derivatives with backend='torch'"
        )
    args = (labels, 0, x.shape[1], temp_rows, ctx.t_scalar, row_max, log_sum, ent, g_logp, g_entropy,
            ctx.engine, ctx.chunk_bytes)
    return gradient(x, args, ctx.inplace_backward), None, None, None, None, None, None, None, None


torch.library.register_autograd("rl_logp::row_stats", _row_stats_backward, setup_context=_setup_row_stats)


@torch.library.custom_op("rl_logp::shard_max", mutates_args=())
def shard_max(
    x: torch.Tensor, temp_rows: torch.Tensor | None, t_scalar: float, engine: str, chunk_bytes: int
) -> torch.Tensor:
    """Row max of z over this shard's columns (NaN rows as +inf), fp32 [N]."""
    return make_engine(engine, chunk_bytes).shard_max(x, _temperature(temp_rows, t_scalar))


@shard_max.register_fake
def _shard_max_fake(x, temp_rows, t_scalar, engine, chunk_bytes):
    return x.new_empty(x.shape[0], dtype=_F32)


@torch.library.custom_op("rl_logp::shard_sums", mutates_args=())
def shard_sums(
    x: torch.Tensor, temp_rows: torch.Tensor | None, t_scalar: float, row_max: torch.Tensor, bits: int,
    entropy: bool, engine: str, chunk_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, E) of this shard given the global max, int64 [N] each (E is [0] without entropy)."""
    s, e = make_engine(engine, chunk_bytes).shard_sums(x, _temperature(temp_rows, t_scalar), row_max, bits, entropy)
    return s, (x.new_empty(0, dtype=torch.int64) if e is None else e)


@shard_sums.register_fake
def _shard_sums_fake(x, temp_rows, t_scalar, row_max, bits, entropy, engine, chunk_bytes):
    n = x.shape[0]
    return x.new_empty(n, dtype=torch.int64), x.new_empty(n if entropy else 0, dtype=torch.int64)
