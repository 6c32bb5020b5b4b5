"""The vocab-parallel (TP) provider: logp and entropy of rows whose vocabulary is split over ranks.

DESIGN.md point 6: all-reduce MAX of the row max, all-reduce SUM of the int64 fixed-point sums S (and E
for the entropy) computed with the global max, and SUM of the target logit from its owner (one value and
zeros: exact). The statistics are the `rl_logp::shard_max` / `rl_logp::shard_sums` ops, the finish is
`rl_logp.contract`; the backward is row-local (`rl_logp::grad` on this rank's columns) and needs no
communication. The layout and every argument that must match are agreed first (`rl_logp.shard_layout`).
Collectives are kept out of `torch.compile` graphs (`torch.compiler.disable`).
"""

from __future__ import annotations

import torch

from rl_logp import contract
from rl_logp.ops import gradient
from rl_logp.shard_layout import VocabShard
from rl_logp.temperature import Temperature


class VocabParallelStats(torch.autograd.Function):
    """(logp or [0], entropy or [0], lse) of this rank's shard rows; gradient w.r.t. the shard."""

    @staticmethod
    def forward(ctx, x, labels, temp_rows, t_scalar, bits, engine, chunk_bytes, shard, entropy, inplace_backward):
        ops = torch.ops.rl_logp
        row_max = ops.shard_max(x, temp_rows, t_scalar, engine, chunk_bytes)
        shard.all_reduce_max(row_max)
        fixed, entropy_fixed = ops.shard_sums(x, temp_rows, t_scalar, row_max, bits, entropy, engine, chunk_bytes)
        shard.all_reduce_sum(fixed)
        if entropy:
            shard.all_reduce_sum(entropy_fixed)
        log_sum, lse, ent = contract.finalize(row_max, fixed, entropy_fixed if entropy else None, bits)
        empty = x.new_empty(0, dtype=torch.float32)
        logp = empty
        if labels is not None:
            divisor = Temperature(rows=temp_rows, scalar=t_scalar).divisor(slice(0, x.shape[0]), x.device)
            target = contract.shard_target_logit(x, labels - shard.start, divisor)
            shard.all_reduce_sum(target)
            logp = contract.assemble_logp(target, row_max, log_sum, labels, shard.vocab_size)
        ctx.save_for_backward(x, labels, temp_rows, row_max, log_sum, ent)
        ctx.args = (t_scalar, engine, chunk_bytes, shard, inplace_backward)
        ctx.mark_non_differentiable(lse)
        return logp, (empty if ent is None else ent), lse

    @staticmethod
    def backward(ctx, g_logp, g_entropy, g_lse):
        x, labels, temp_rows, row_max, log_sum, ent = ctx.saved_tensors
        t_scalar, engine, chunk_bytes, shard, inplace_backward = ctx.args
        g_logp = None if labels is None or g_logp is None else g_logp
        g_entropy = None if ent is None or g_entropy is None else g_entropy
        if g_logp is None and g_entropy is None:
            return (None,) * 10
        args = (labels, shard.start, shard.vocab_size, temp_rows, t_scalar, row_max, log_sum, ent, g_logp,
                g_entropy, engine, chunk_bytes)
        return (gradient(x, args, inplace_backward),) + (None,) * 9


@torch.compiler.disable
def vocab_parallel_stats(
    x: torch.Tensor, labels: torch.Tensor | None, temp_rows: torch.Tensor | None, t_scalar: float, bits: int,
    engine: str, chunk_bytes: int, shard: VocabShard, entropy: bool, inplace_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return VocabParallelStats.apply(x, labels, temp_rows, t_scalar, bits, engine, chunk_bytes, shard, entropy,
                                    inplace_backward)
