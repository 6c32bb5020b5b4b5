"""The vocab-parallel (TP) forward: statistics of rows whose vocabulary is split over ranks.

docs/design.md, TP: all-reduce MAX of the row max, all-reduce SUM of the int64 fixed-point sums S (and E
for the entropy) computed with the global max, and SUM of the target logit from its owner (one value and
zeros: exact). The shard statistics come from the request's engine, the finish from `rl_logp.contract`.
The backward is row-local (the engine's `grad` on this rank's columns) and needs no communication; the op
that runs this forward and registers that backward is `rl_logp::row_stats` (`rl_logp.ops`).
"""

from __future__ import annotations

from rl_logp import contract
from rl_logp.engines import RowStats, make_engine
from rl_logp.request import LogpRequest


def vocab_parallel_row_stats(req: LogpRequest) -> RowStats:
    """(logp, entropy, lse, M, L) of this rank's shard rows, every rank getting the same bits."""
    shard, x = req.shard, req.logits
    engine = make_engine(req.engine, req.chunk_bytes)
    row_max = contract.nan_as_inf(engine.shard_max(req))
    shard.all_reduce_max(row_max)
    fixed, entropy_fixed = engine.shard_sums(req, row_max)
    shard.all_reduce_sum(fixed)
    if req.entropy:
        shard.all_reduce_sum(entropy_fixed)
    log_sum, lse, ent = contract.finalize(row_max, fixed, entropy_fixed, req.bits)
    logp = None
    if req.labels is not None:
        divisor = req.temperature.divisor(slice(0, x.shape[0]), x.device)
        target = contract.shard_target_logit(x, req.labels - shard.start, divisor)
        shard.all_reduce_sum(target)
        logp = contract.assemble_logp(target, row_max, log_sum, req.labels, shard.vocab_size)
    return RowStats(row_max=row_max, log_sum=log_sum, lse=lse, logp=logp, entropy=ent)
