"""rl-logp's operators, registered with `torch.library` so `torch.compile` sees each as one opaque op.

    rl_logp::row_stats   a request's rows -> (logp, entropy, lse, M, L); vocab-parallel with a group
    rl_logp::grad        the row-local gradient of logp and/or entropy (a new tensor)
    rl_logp::grad_       the same, written into the logits' own storage (inplace_backward)

The three share one schema for the request (`REQUEST_SCHEMA`); `_flatten` and `_request` are the one
place a `LogpRequest` becomes op arguments and back. The request's integers and flags travel as one
`int[]` and the grad ops' statistics as one `Tensor?[]`: torch's wrappers of a custom op with autograd
(and of a mutable one) fill in the op's defaults at every call in time quadratic in its argument count
(`torch._library.utils.fill_defaults`): 12 + 17 us for seven and eight arguments on a CPU where 12 and 17
cost 35 + 71 (`benchmarks/results/cpu_op_fill_defaults.json`). Each op has a fake implementation that only
builds output shapes, so the compiler never traces the engines: the chunk loop, the Triton launches, the
collectives and the validation stay out of the graph, one graph serves every row count, and compiled
code gives eager's bits. One autograd formula (`_setup_row_stats`, `_row_stats_backward`) serves every
path, single-device and vocab-parallel. Why `custom_op` and not `triton_op`: the ops dispatch to two
engines (one of them plain torch) and to collectives; inductor could not re-schedule anything useful in
a memory-bound single pass.

`row_stats(req)` is what the public functions call. Under torch.compile it goes through the op, whose
autograd formula is registered (`register_autograd`). Eager, it runs the ops' bodies without torch's
dispatcher: directly where there is nothing to differentiate (the rollout-size calls vLLM makes at every
decode step), and through `_EagerRowStats`, an `autograd.Function` with the same formula, where autograd
records the call (a training step's forward and backward: the custom-op wrappers cost them about 165 us
of host time per step on this repository's CPU, `benchmarks/results/cpu_op_dispatch.json`). Same bodies,
same bits; the in-place backward bumps the logits' version counter as the mutable op does, so a later
reader of the overwritten logits still gets autograd's in-place error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl_logp.engines import RowStats, make_engine
from rl_logp.request import LogpRequest
from rl_logp.shard_layout import VocabShard, comm_device
from rl_logp.temperature import Temperature
from rl_logp.vocab_parallel import vocab_parallel_row_stats

# `ints`: entropy, bits, chunk_bytes, inplace_backward, vocab_start, vocab_size (`_flatten`).
REQUEST_SCHEMA = "Tensor? labels, Tensor? temp_rows, float t_scalar, str engine, str group_name, int[] ints"
# `stats`: row_max, log_sum, the forward's entropy (or None), g_logp, g_entropy (`_grad_request`).
STATS_SCHEMA = "Tensor?[] stats"
_F32 = torch.float32


def _flatten(req: LogpRequest) -> tuple:
    """The request as the ops' arguments (x first)."""
    shard = req.shard
    return (
        req.logits, req.labels, req.temperature.rows, float(req.temperature.scalar), req.engine,
        "" if shard is None else shard.group.group_name,
        [int(req.entropy), req.bits, req.chunk_bytes, int(req.inplace_backward),
         0 if shard is None else shard.start, 0 if shard is None else shard.vocab_size],
    )


def _request(x, labels, temp_rows, t_scalar, engine, group_name, ints) -> LogpRequest:
    """The ops' arguments as the request they came from (the op always computes M, L and lse: a backward
    needs M and L)."""
    entropy, bits, chunk_bytes, inplace_backward, vocab_start, vocab_size = ints
    shard = None
    if group_name:
        group = dist.distributed_c10d._resolve_process_group(group_name)
        shard = VocabShard(group=group, start=vocab_start, width=x.shape[1], vocab_size=vocab_size,
                           comm_device=comm_device(group, x.device))
    return LogpRequest(x, labels, Temperature(rows=temp_rows, scalar=t_scalar), bool(entropy), True, engine, bits,
                       chunk_bytes, torch.Size([x.shape[0]]), bool(inplace_backward), shard)


def row_stats(req: LogpRequest) -> RowStats:
    """The statistics of a request: through `rl_logp::row_stats` under the compiler; eager, the engine's
    where nothing is differentiated, else `_EagerRowStats` (the op's body and autograd formula)."""
    if torch.compiler.is_compiling():
        logp, ent, lse, row_max, log_sum = torch.ops.rl_logp.row_stats(*_flatten(req))
    elif not (torch.is_grad_enabled() and req.logits.requires_grad):
        return _engine_row_stats(req)
    else:
        logp, ent, lse, row_max, log_sum = _EagerRowStats.apply(*_flatten(req))
    return RowStats(row_max=row_max, log_sum=log_sum, lse=lse, logp=logp if req.labels is not None else None,
                    entropy=ent if req.entropy else None)


def _stats_outputs(stats: RowStats, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(logp, entropy, lse, M, L): distinct tensors (an op's outputs may not alias), [0] where not asked."""
    return tuple(
        x.new_empty(0, dtype=_F32) if t is None else t
        for t in (stats.logp, stats.entropy, stats.lse, stats.row_max, stats.log_sum)
    )


def _engine_row_stats(req: LogpRequest) -> RowStats:
    """The request's statistics from its engine (vocab-parallel with a shard)."""
    if req.shard is not None:
        return vocab_parallel_row_stats(req)
    return make_engine(req.engine, req.chunk_bytes).row_stats(req)


def _row_stats(*args) -> tuple[torch.Tensor, ...]:
    """The body of `rl_logp::row_stats`."""
    req = _request(*args)
    return _stats_outputs(_engine_row_stats(req), req.logits)


_row_stats_op = torch.library.custom_op(
    "rl_logp::row_stats", _row_stats, mutates_args=(),
    schema=f"(Tensor x, {REQUEST_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


@_row_stats_op.register_fake
def _row_stats_fake(x, labels, temp_rows, t_scalar, engine, group_name, ints):
    n, entropy = x.shape[0], ints[0]
    return tuple(x.new_empty(n if wanted else 0, dtype=_F32) for wanted in (labels is not None, entropy, True, True, True))


def _grad_request(x, *args) -> tuple[LogpRequest, RowStats, torch.Tensor | None, torch.Tensor | None]:
    """The grad ops' arguments as (request, the forward's statistics, g_logp, g_entropy)."""
    *request_args, (row_max, log_sum, ent, g_logp, g_entropy) = args
    return _request(x, *request_args), RowStats(row_max=row_max, log_sum=log_sum, entropy=ent), g_logp, g_entropy


def _write_grad(x: torch.Tensor, out: torch.Tensor, args: tuple) -> None:
    """dz of logp (g_logp given) and/or entropy (g_entropy given) for this block of columns, into `out`."""
    req, stats, g_logp, g_entropy = _grad_request(x, *args)
    make_engine(req.engine, req.chunk_bytes).grad(req, stats, g_logp, g_entropy, out)


def _grad(x, *args) -> torch.Tensor:
    """The body of `rl_logp::grad`: the gradient in a new tensor."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _write_grad(x, out, args)
    return out


_grad_op = torch.library.custom_op(
    "rl_logp::grad", _grad, mutates_args=(), schema=f"(Tensor x, {REQUEST_SCHEMA}, {STATS_SCHEMA}) -> Tensor")


@_grad_op.register_fake
def _grad_fake(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _grad_into(x, *args) -> None:
    """The body of `rl_logp::grad_`: the gradient written over `x` (it replaces the logits it was computed
    from)."""
    _write_grad(x, x, args)


_grad_inplace_op = torch.library.custom_op(
    "rl_logp::grad_", _grad_into, mutates_args=("x",),
    schema=f"(Tensor(a!) x, {REQUEST_SCHEMA}, {STATS_SCHEMA}) -> ()")


@_grad_inplace_op.register_fake
def _grad_inplace_fake(x, *args):
    return None


def _setup_row_stats(ctx, inputs, output) -> None:
    x, labels, temp_rows, *_ = inputs
    _, ent, _, row_max, log_sum = output
    ctx.save_for_backward(x, labels, temp_rows, row_max, log_sum, ent)
    ctx.args = inputs[3:]
    ctx.mark_non_differentiable(output[2], output[3], output[4])
    ctx.eager = False


def _row_stats_backward(ctx, g_logp, g_entropy, g_lse, g_max, g_log_sum):
    x, labels, temp_rows, row_max, log_sum, ent = ctx.saved_tensors
    req = _request(x, labels, temp_rows, *ctx.args)
    g_logp = None if labels is None or g_logp is None or g_logp.numel() == 0 else g_logp
    g_entropy = None if not req.entropy or g_entropy is None or g_entropy.numel() == 0 else g_entropy
    none = (None,) * (2 + len(ctx.args))  # labels, temp_rows and the non-tensor arguments
    if g_logp is None and g_entropy is None:
        return None, *none
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # backward(create_graph=True)
        raise RuntimeError(
            "rl_logp: double backward (backward with create_graph=True through logprobs/entropy) is not "
            "supported; compute higher derivatives with backend='torch'"
        )
    args = (labels, temp_rows, *ctx.args, [row_max, log_sum, ent if req.entropy else None, g_logp, g_entropy])
    eager = ctx.eager and not torch.compiler.is_compiling()  # compiled autograd traces the ops
    if req.inplace_backward:
        if eager:
            _grad_into(x, *args)
            torch.autograd.graph.increment_version(x)  # what the mutable op's wrapper does
        else:
            torch.ops.rl_logp.grad_(x, *args)
        # A new tensor over x's storage: autograd may then take it as the leaf's .grad as it is, where
        # x itself (still referenced by the caller) would be copied into a logits-sized buffer.
        return x.detach(), *none
    return (_grad(x, *args) if eager else torch.ops.rl_logp.grad(x, *args)), *none


torch.library.register_autograd("rl_logp::row_stats", _row_stats_backward, setup_context=_setup_row_stats)


class _EagerRowStats(torch.autograd.Function):
    """`rl_logp::row_stats` with its autograd formula, eager and without torch's dispatcher: the op's body,
    setup and backward, the backward running the grad ops' bodies. The forward takes `ctx` (no separate
    `setup_context`: with one, `apply` binds the arguments through `inspect.signature` at every call).
    The gradients of outputs the loss does not use reach the formula as zeros, as they reach it through the
    op: an unused entropy's zero gradient still takes the kernel's entropy term (a zero that can turn a -0
    of the logp's gradient into +0), so both paths write the same bits."""

    @staticmethod
    def forward(ctx, *args):
        output = _row_stats(*args)
        _setup_row_stats(ctx, args, output)
        ctx.eager = True
        return output

    backward = staticmethod(_row_stats_backward)
