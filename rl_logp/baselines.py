"""The non-invariant backends, kept for comparison: `torch` (log_softmax + gather) and `flash_attn`.

Neither keeps the contract: their float reductions round differently with the batch shape (torch on
GPU), the tiling, or the TP layout. `rl_logp.check` reports them as diagnostics, never as failures.
Both take the validated 2-D inputs of `rl_logp.validation.prepare_inputs`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

FLASH_ATTN_INSTALL_HINT = (
    "backend='flash_attn' needs flash-attn's Triton cross entropy "
    "(flash_attn.ops.triton.cross_entropy); install flash-attn on a CUDA machine (pip install flash-attn), "
    "or use backend='fused' / 'chunked'"
)


def _masked_labels(labels: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    in_range = (labels >= 0) & (labels < vocab)
    return in_range, torch.where(in_range, labels, torch.zeros_like(labels))


def torch_logprobs(x: torch.Tensor, labels: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """log_softmax in fp32 then gather; out-of-range labels give 0 (and no gradient)."""
    z = x.float() if temperature is None else x.float() / temperature.unsqueeze(1)
    in_range, safe = _masked_labels(labels, x.shape[1])
    logp = torch.log_softmax(z, dim=-1).gather(1, safe.unsqueeze(1)).squeeze(1)
    return torch.where(in_range, logp, torch.zeros_like(logp))


def load_flash_attn_cross_entropy():
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss
    except ImportError as err:
        raise ImportError(f"rl_logp: {FLASH_ATTN_INSTALL_HINT} ({err})") from err
    return cross_entropy_loss


def flash_attn_logprobs(
    x: torch.Tensor, labels: torch.Tensor, temperature: torch.Tensor | None, inplace_backward: bool
) -> torch.Tensor:
    """-cross_entropy_loss(x, y) from flash-attn's Triton kernel; labels outside [0, V) are ignored."""
    cross_entropy_loss = load_flash_attn_cross_entropy()
    if not x.is_cuda:
        raise ValueError(f"rl_logp: backend='flash_attn' runs on CUDA tensors only, got {x.device}")
    z = x if temperature is None else x.float() / temperature.unsqueeze(1)
    in_range, _ = _masked_labels(labels, x.shape[1])
    ignored = torch.where(in_range, labels, torch.full_like(labels, -100))
    losses = cross_entropy_loss(z, ignored, inplace_backward=inplace_backward)[0]
    return -losses.float()


def vocab_parallel_torch_logprobs(
    x: torch.Tensor,
    labels: torch.Tensor,
    temperature: torch.Tensor | None,
    group: dist.ProcessGroup,
    vocab_start: int,
    vocab_size: int,
) -> torch.Tensor:
    """Megatron-style vocab-parallel logp with a float sum-exp (forward only): the TP-variant baseline."""
    with torch.no_grad():
        z = x.float() if temperature is None else x.float() / temperature.unsqueeze(1)
        row_max = z.amax(dim=1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        sum_exp = torch.exp(z - row_max.unsqueeze(1)).sum(dim=1)
        dist.all_reduce(sum_exp, group=group)
        local = labels - vocab_start
        owned = (local >= 0) & (local < x.shape[1])
        safe = torch.where(owned, local, torch.zeros_like(local))
        target = torch.where(owned, z.gather(1, safe.unsqueeze(1)).squeeze(1), torch.zeros_like(row_max))
        dist.all_reduce(target, group=group)
        logp = target - (row_max + torch.log(sum_exp))
        in_range = (labels >= 0) & (labels < vocab_size)
        return torch.where(in_range, logp, torch.zeros_like(logp))
