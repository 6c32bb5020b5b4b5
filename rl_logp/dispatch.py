"""The public entry point `logprobs`: config, validation, backend choice, autograd.

`InvariantLogp` is the one autograd function behind every invariant backend, TP or not: the forward
asks an engine for (M, S) per row (all-reducing them over the TP group when there is one), finishes
with `rl_logp.contract`, and saves only the fp32 lse per row; the backward is row-local and needs no
communication.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.distributed as dist

from rl_logp import baselines, contract
from rl_logp.chunked import ChunkedEngine
from rl_logp.config import LogpConfig, resolve_config
from rl_logp.engine import LogpEngine
from rl_logp.validation import check_vocab_fits, prepare_inputs
from rl_logp.vocab_parallel import VocabShard, resolve_shard

logger = logging.getLogger("rl_logp")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=1)
def fused_import_error() -> str | None:
    """Why the fused kernel cannot be imported here, or None when it can."""
    try:
        import rl_logp.kernels.fused_logp  # noqa: F401
    except ImportError as err:
        return str(err)
    return None


def fused_runs_on(device: torch.device) -> bool:
    """True where `fused` can run: a CUDA device with Triton, or the CPU under TRITON_INTERPRET=1."""
    if fused_import_error() is not None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and _interpreting())


def resolve_backend(backend: str, device: torch.device) -> str:
    """`auto` becomes `fused` where the kernel runs on `device`, else `chunked`; others are checked."""
    if backend == "auto":
        return "fused" if device.type == "cuda" and fused_runs_on(device) else "chunked"
    if backend == "fused" and not fused_runs_on(device):
        reason = fused_import_error() or f"the logits are on {device}"
        raise ValueError(
            f"rl_logp: backend='fused' needs CUDA logits and Triton ({reason}); "
            "use backend='chunked' (any device) or 'auto'"
        )
    return backend


def make_engine(name: str, config: LogpConfig) -> LogpEngine:
    if name == "fused":
        from rl_logp.kernels.fused_logp import FusedEngine

        return FusedEngine()
    return ChunkedEngine(config.chunk_bytes)


class InvariantLogp(torch.autograd.Function):
    """logp = z[y] - lse per row, with lse from the order-free statistics of an engine."""

    @staticmethod
    def forward(ctx, x, labels, temperature, engine, bits, shard, inplace_backward):
        vocab = x.shape[1] if shard is None else shard.vocab_size
        local_labels = labels if shard is None else labels - shard.start
        if shard is None:
            row_max, fixed = engine.row_stats(x, temperature, bits)
        else:
            row_max = engine.row_max(x, temperature)
            shard.all_reduce_max(row_max)
            fixed = engine.fixed_sum(x, temperature, row_max, bits)
            shard.all_reduce_sum(fixed)
        lse = contract.finalize_lse(row_max, fixed, bits)
        target = contract.shard_target_logit(x, local_labels, temperature)
        if shard is not None:
            shard.all_reduce_sum(target)
        ctx.save_for_backward(x, labels, local_labels, lse, temperature)
        ctx.engine, ctx.vocab, ctx.inplace_backward = engine, vocab, inplace_backward
        return contract.assemble_logp(target, lse, labels, vocab)

    @staticmethod
    def backward(ctx, grad_out):
        x, labels, local_labels, lse, temperature = ctx.saved_tensors
        lse_for_grad, grad_scale = contract.grad_row_terms(grad_out, lse, labels, ctx.vocab, temperature)
        out = x if ctx.inplace_backward else torch.empty_like(x, memory_format=torch.contiguous_format)
        ctx.engine.grad(x, temperature, lse_for_grad, local_labels, grad_scale, out)
        if ctx.inplace_backward:
            # Anything else that saved these logits for its backward now fails loudly instead of
            # reading the gradient we wrote over them.
            torch._C._increment_version(x)
        return out, None, None, None, None, None, None


def logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    backend: str | None = None,
    temperature: float | torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    inplace_backward: bool = False,
    config: LogpConfig | dict | None = None,
    chunk_bytes: int | None = None,
    fixed_point_bits: int | None = None,
    strict: bool | None = None,
) -> torch.Tensor:
    """Log-probability of `labels` under `softmax(logits / temperature)`, fp32, shape `labels.shape`.

    logits: [..., V] bf16/fp16/fp32 (with `tp_group`: this rank's contiguous slice of the vocabulary).
    labels: [...] int64/int32; labels outside [0, V) (the ignore index -100 included) give 0 and no gradient.
    backend: 'auto' | 'fused' | 'chunked' | 'flash_attn' | 'torch' (default from config / RL_LOGP_BACKEND).
    temperature: a float > 0, or a tensor with one value per row; applied in fp32 inside.
    tp_group, vocab_start, vocab_size: vocab-parallel layout (see `rl_logp.vocab_parallel.resolve_shard`).
    inplace_backward: write dlogits into the logits' storage. Safe when nothing else reads these logits
        after this call's backward (no other op saved them); a later use raises autograd's in-place error.
    Differentiable with respect to `logits`.
    """
    cfg = resolve_config(
        config, backend=backend, chunk_bytes=chunk_bytes, fixed_point_bits=fixed_point_bits, strict=strict
    )
    inputs = prepare_inputs(logits, labels, temperature)
    x, y, temp = inputs.logits, inputs.labels, inputs.temperature
    name = resolve_backend(cfg.backend, x.device)
    if name == "torch":
        if tp_group is not None:
            shard = resolve_shard(tp_group, x.shape[0], x.shape[1], x.device, vocab_start, vocab_size)
            out = baselines.vocab_parallel_torch_logprobs(x, y, temp, tp_group, shard.start, shard.vocab_size)
        else:
            out = baselines.torch_logprobs(x, y, temp)
        return out.reshape(inputs.lead_shape)
    if name == "flash_attn":
        if tp_group is not None:
            raise ValueError("rl_logp: backend='flash_attn' has no vocab-parallel form; use 'fused' or 'chunked'")
        return baselines.flash_attn_logprobs(x, y, temp, inplace_backward).reshape(inputs.lead_shape)
    shard: VocabShard | None = None
    vocab = x.shape[1]
    if tp_group is not None:
        shard = resolve_shard(tp_group, x.shape[0], x.shape[1], x.device, vocab_start, vocab_size)
        vocab = shard.vocab_size
    elif vocab_start is not None or vocab_size is not None:
        raise ValueError("rl_logp: vocab_start/vocab_size describe a vocab split; pass tp_group with them")
    if vocab == 0:
        raise ValueError("rl_logp: logits have an empty vocabulary dimension (V == 0)")
    check_vocab_fits(vocab, cfg.fixed_point_bits)
    if x.shape[0] == 0:
        return torch.zeros(inputs.lead_shape, dtype=torch.float32, device=x.device) + logits.sum() * 0
    engine = make_engine(name, cfg)
    out = InvariantLogp.apply(x, y, temp, engine, cfg.fixed_point_bits, shard, inplace_backward)
    return out.reshape(inputs.lead_shape)


@torch.no_grad()
def logsumexp(
    logits: torch.Tensor,
    *,
    backend: str | None = None,
    temperature: float | torch.Tensor | None = None,
    config: LogpConfig | dict | None = None,
) -> torch.Tensor:
    """The contract's lse of each row of `logits / temperature` (fp32, shape `logits.shape[:-1]`).

    The same bits `logprobs` subtracts, for providers that need every column's logprob (vLLM's
    full-vocab logprobs, top-k): `logprob[j] = fp32(logits[j]) / T - lse`. Not differentiable.
    """
    cfg = resolve_config(config, backend=backend)
    labels = torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    inputs = prepare_inputs(logits, labels, temperature)
    name = resolve_backend(cfg.backend, inputs.logits.device)
    if name not in ("fused", "chunked"):
        raise ValueError(f"rl_logp: logsumexp needs an invariant backend (fused/chunked/auto), got {name!r}")
    check_vocab_fits(inputs.logits.shape[1], cfg.fixed_point_bits)
    if inputs.logits.shape[0] == 0:
        return torch.zeros(inputs.lead_shape, dtype=torch.float32, device=logits.device)
    engine = make_engine(name, cfg)
    row_max, fixed = engine.row_stats(inputs.logits, inputs.temperature, cfg.fixed_point_bits)
    return contract.finalize_lse(row_max, fixed, cfg.fixed_point_bits).reshape(inputs.lead_shape)


class InvariantEntropy(torch.autograd.Function):
    """H = -sum p log p per row from three order-free statistics (M, S, E); row-local backward."""

    @staticmethod
    def forward(ctx, x, temperature, engine, bits):
        row_max, fixed = engine.row_stats(x, temperature, bits)
        entropy_fixed = engine.entropy_sum(x, temperature, row_max, bits)
        lse = contract.finalize_lse(row_max, fixed, bits)
        entropy = contract.finalize_entropy(fixed, entropy_fixed, bits)
        ctx.save_for_backward(x, temperature, lse, entropy)
        ctx.engine = engine
        return entropy

    @staticmethod
    def backward(ctx, grad_out):
        x, temperature, lse, entropy = ctx.saved_tensors
        scale = grad_out.to(torch.float32)
        if temperature is not None:
            scale = scale / temperature
        masked = lse == contract.NEG_INF  # fully -inf rows: zero gradient (and no -inf - -inf)
        scale = torch.where(masked, torch.zeros_like(scale), -scale)
        lse = torch.where(masked, torch.zeros_like(lse), lse)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        ctx.engine.entropy_grad(x, temperature, lse, entropy, scale, out)
        return out, None, None, None


def entropy(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor | None = None,
    config: LogpConfig | dict | None = None,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """Entropy of `softmax(logits / temperature)` per row, fp32, differentiable, batch-invariant.

    Uses the `chunked` engine on every device (the fused kernel has no entropy pass yet).
    Fully -inf rows give 0.
    """
    cfg = resolve_config(config, chunk_bytes=chunk_bytes)
    labels = torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    inputs = prepare_inputs(logits, labels, temperature)
    if inputs.logits.shape[1] == 0:
        raise ValueError("rl_logp: logits have an empty vocabulary dimension (V == 0)")
    check_vocab_fits(inputs.logits.shape[1], cfg.fixed_point_bits)
    if inputs.logits.shape[0] == 0:
        return torch.zeros(inputs.lead_shape, dtype=torch.float32, device=logits.device) + logits.sum() * 0
    engine = ChunkedEngine(cfg.chunk_bytes)
    out = InvariantEntropy.apply(inputs.logits, inputs.temperature, engine, cfg.fixed_point_bits)
    return out.reshape(inputs.lead_shape)
