"""The non-invariant backends, kept for comparison: `torch` (log_softmax + gather) and `flash_attn`.

Neither keeps the contract: their float reductions round differently with the batch shape (torch on
GPU), the tiling, or the TP layout. `rl_logp.check` reports them as diagnostics, never as failures.
They take a `LogpRequest` (`rl_logp.request`) whose engine names them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl_logp.engines import RowStats
from rl_logp.request import LogpRequest

FLASH_ATTN_INSTALL_HINT = (
    "backend='flash_attn' needs flash-attn's Triton cross entropy "
    "(flash_attn.ops.triton.cross_entropy); install flash-attn on a CUDA machine (pip install flash-attn), "
    "or use backend='fused' / 'chunked'"
)


def _masked_labels(labels: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    in_range = (labels >= 0) & (labels < vocab)
    return in_range, torch.where(in_range, labels, torch.zeros_like(labels))


def _scaled(req: LogpRequest) -> torch.Tensor:
    x, temp = req.logits, req.temperature
    divisor = temp.divisor(slice(0, x.shape[0]), x.device)
    z = x.float()
    return z if divisor is None else z / (divisor.unsqueeze(1) if divisor.dim() else divisor)


def torch_logprobs(req: LogpRequest) -> torch.Tensor:
    """log_softmax in fp32 then gather; out-of-range labels give 0 (and no gradient)."""
    in_range, safe = _masked_labels(req.labels, req.logits.shape[1])
    logp = torch.log_softmax(_scaled(req), dim=-1).gather(1, safe.unsqueeze(1)).squeeze(1)
    return torch.where(in_range, logp, torch.zeros_like(logp))


def torch_entropy(req: LogpRequest) -> torch.Tensor:
    """logsumexp(z) - sum softmax(z) z, the formula of verl's `entropy_from_logits`."""
    z = _scaled(req)
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)


def load_flash_attn_cross_entropy():
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss
    except ImportError as err:
        raise ImportError(f"rl_logp: {FLASH_ATTN_INSTALL_HINT} ({err})") from err
    return cross_entropy_loss


def flash_attn_logprobs(req: LogpRequest, inplace_backward: bool) -> torch.Tensor:
    """-cross_entropy_loss(x, y) from flash-attn's Triton kernel; labels outside [0, V) are ignored."""
    cross_entropy_loss = load_flash_attn_cross_entropy()
    x = req.logits
    if not x.is_cuda:
        raise ValueError(f"rl_logp: backend='flash_attn' runs on CUDA tensors only, got {x.device}")
    z = x if req.temperature.is_one else _scaled(req)
    in_range, _ = _masked_labels(req.labels, x.shape[1])
    ignored = torch.where(in_range, req.labels, torch.full_like(req.labels, -100))
    return -cross_entropy_loss(z, ignored, inplace_backward=inplace_backward)[0].float()


def row_stats(req: LogpRequest) -> RowStats:
    """logp (labels given) and entropy (`req.entropy`) of a baseline backend, [N] each."""
    if req.entropy and req.engine == "flash_attn":
        raise ValueError("rl_logp: backend='flash_attn' has no entropy; use 'fused', 'chunked' or 'torch'")
    logp = None
    if req.labels is not None:
        logp = torch_logprobs(req) if req.engine == "torch" else flash_attn_logprobs(req, req.inplace_backward)
    return RowStats(logp=logp, entropy=torch_entropy(req) if req.entropy else None)


@torch.no_grad()
def vocab_parallel_torch_logprobs(req: LogpRequest) -> torch.Tensor:
    """Megatron-style vocab-parallel logp with a float sum-exp (forward only): the TP-variant baseline."""
    z = _scaled(req)
    labels, group, vocab_start, vocab_size = req.labels, req.shard.group, req.shard.start, req.shard.vocab_size
    row_max = z.amax(dim=1)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    sum_exp = torch.exp(z - row_max.unsqueeze(1)).sum(dim=1)
    dist.all_reduce(sum_exp, group=group)
    local = labels - vocab_start
    owned = (local >= 0) & (local < z.shape[1])
    safe = torch.where(owned, local, torch.zeros_like(local))
    target = torch.where(owned, z.gather(1, safe.unsqueeze(1)).squeeze(1), torch.zeros_like(row_max))
    dist.all_reduce(target, group=group)
    logp = target - (row_max + torch.log(sum_exp))
    in_range = (labels >= 0) & (labels < vocab_size)
    return torch.where(in_range, logp, torch.zeros_like(logp))
