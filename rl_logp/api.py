"""The public functions: `logprobs`, `entropy`, `logprobs_and_entropy`, `logsumexp`, `log_normalizer`.

Each validates its inputs (`rl_logp.validation`), resolves the backend (`rl_logp.backends`) and calls
the `rl_logp::*` ops (`rl_logp.ops`), or the vocab-parallel provider with a `tp_group`
(`rl_logp.vocab_parallel`), or a non-invariant baseline (`rl_logp.baselines`). On the eager path with
nothing to differentiate, the ops' bodies are called directly: the dispatcher would only add latency to
the rollout-size calls vLLM makes at every decode step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl_logp import baselines, ops
from rl_logp.backends import INVARIANT_ENGINES, resolve_backend
from rl_logp.config import LogpConfig, resolve_config
from rl_logp.shard_layout import LocalLayout, agree
from rl_logp.validation import PreparedInputs, check_vocab_fits, prepare_inputs
from rl_logp.vocab_parallel import vocab_parallel_stats


def _in_graph(x: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or (torch.is_grad_enabled() and x.requires_grad)


def _inplace_allowed(logits: torch.Tensor, inplace_backward: bool) -> bool:
    """inplace_backward is honoured unless the logits are a leaf (their storage is the user's tensor:
    the gradient would overwrite it and alias `.grad`) or under torch.compile (functionalisation would
    copy the buffer back anyway); both fall back to a new gradient buffer."""
    return bool(inplace_backward) and not logits.is_leaf and not torch.compiler.is_compiling()


def _empty_result(inputs: PreparedInputs, logits: torch.Tensor) -> torch.Tensor:
    keep_graph = (logits.sum() * 0).to(torch.float32)  # an empty batch still connects to the graph
    return torch.zeros(inputs.lead_shape, dtype=torch.float32, device=logits.device) + keep_graph


def _row_stats(inputs: PreparedInputs, cfg: LogpConfig, engine: str, entropy: bool, inplace: bool):
    x, temp = inputs.logits, inputs.temperature
    args = (x, inputs.labels, temp.rows, temp.scalar, cfg.fixed_point_bits, engine, cfg.chunk_bytes, entropy)
    if _in_graph(x):
        return torch.ops.rl_logp.row_stats(*args, inplace)
    return ops.row_stats_impl(*args)


def _prepare(logits, labels, temperature, config, backend, chunk_bytes, fixed_point_bits, strict=None):
    """(config, validated inputs, resolved backend name): the set-up every public function shares."""
    cfg = resolve_config(config, backend=backend, chunk_bytes=chunk_bytes, fixed_point_bits=fixed_point_bits,
                         strict=strict)
    inputs = prepare_inputs(logits, labels, temperature)
    return cfg, inputs, resolve_backend(cfg.backend, inputs.logits.device)


def _score(logits, labels, *, entropy: bool, want_logp: bool, backend, temperature, tp_group, vocab_start,
           vocab_size, inplace_backward, config, chunk_bytes, fixed_point_bits, strict):
    """(logp or None, entropy or None), each of the logits' row shape."""
    if tp_group is not None:
        return _score_vocab_parallel(logits, labels if want_logp else None, entropy, backend, temperature,
                                     tp_group, vocab_start, vocab_size, inplace_backward, config, chunk_bytes,
                                     fixed_point_bits, strict)
    if vocab_start is not None or vocab_size is not None:
        raise ValueError("rl_logp: vocab_start/vocab_size describe a vocab split; pass tp_group with them")
    cfg, inputs, name = _prepare(logits, labels if want_logp else None, temperature, config, backend, chunk_bytes,
                                 fixed_point_bits, strict)
    check_vocab_fits(inputs.logits.shape[1], cfg.fixed_point_bits)
    if name not in INVARIANT_ENGINES:
        return baselines.score(name, inputs, entropy=entropy, want_logp=want_logp, inplace_backward=inplace_backward)
    if inputs.logits.shape[0] == 0:
        empty = _empty_result(inputs, logits)
        return (empty if want_logp else None), (empty.clone() if entropy else None)
    logp, ent, _, _, _ = _row_stats(inputs, cfg, name, entropy, _inplace_allowed(logits, inplace_backward))
    shape = inputs.lead_shape
    return (logp.reshape(shape) if want_logp else None), (ent.reshape(shape) if entropy else None)


def _score_vocab_parallel(logits, labels, entropy, backend, temperature, tp_group, vocab_start, vocab_size,
                          inplace_backward, config, chunk_bytes, fixed_point_bits, strict):
    if not isinstance(tp_group, dist.ProcessGroup):
        raise TypeError(f"rl_logp: tp_group must be a torch.distributed.ProcessGroup, got {type(tp_group).__name__}")
    local = LocalLayout(vocab_start=vocab_start, vocab_size=vocab_size)
    try:
        cfg, inputs, name = _prepare(logits, labels, temperature, config, backend, chunk_bytes, fixed_point_bits,
                                     strict)
        x = inputs.logits
        local.device = x.device
        if name == "flash_attn":
            raise ValueError("rl_logp: backend='flash_attn' has no vocab-parallel form; use 'fused' or 'chunked'")
        if name == "torch" and torch.is_grad_enabled() and x.requires_grad:
            raise ValueError(
                "rl_logp: backend='torch' with tp_group is a forward-only diagnostic (Megatron-style float "
                "sums); use backend='fused' or 'chunked' for gradients, or call it under torch.no_grad()"
            )
        if name == "torch" and entropy:
            raise ValueError("rl_logp: backend='torch' has no vocab-parallel entropy; use 'fused' or 'chunked'")
        local.rows, local.width, local.bits, local.engine = x.shape[0], x.shape[1], cfg.fixed_point_bits, name
        local.dtype, local.labels, local.temperature = x.dtype, inputs.labels, inputs.temperature
    except Exception as err:  # any local failure must reach the all-gather: a peer never waits on a dead rank
        if isinstance(logits, torch.Tensor):
            local.device = logits.device
        local.error = str(err) if isinstance(err, (TypeError, ValueError)) else f"{type(err).__name__}: {err}"
    shard = agree(tp_group, local)
    check_vocab_fits(shard.vocab_size, cfg.fixed_point_bits)
    if name == "torch":
        return baselines.vocab_parallel_torch_logprobs(inputs, tp_group, shard.start, shard.vocab_size), None
    if x.shape[0] == 0:
        empty = _empty_result(inputs, logits)
        return (empty if labels is not None else None), (empty.clone() if entropy else None)
    temp = inputs.temperature
    logp, ent, _ = vocab_parallel_stats(x, inputs.labels, temp.rows, temp.scalar, cfg.fixed_point_bits, name,
                                        cfg.chunk_bytes, shard, entropy, _inplace_allowed(logits, inplace_backward))
    shape = inputs.lead_shape
    return (logp.reshape(shape) if labels is not None else None), (ent.reshape(shape) if entropy else None)


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
    """Log-probability of `labels` under `softmax(logits / temperature)`, fp32, shape `logits.shape[:-1]`.

    logits: [..., V] bf16/fp16/fp32 (fp64 is scored as fp32(x)); with `tp_group`: this rank's contiguous
        slice of the vocabulary.
    labels: int64/int32 of the logits' row shape (size-1 dimensions aside); labels outside [0, V) (the
        ignore index -100 included) give 0 and no gradient.
    backend: 'auto' | 'fused' | 'chunked' | 'flash_attn' | 'torch' (default from config / RL_LOGP_BACKEND).
    temperature: a float > 0, or a tensor with one value per row; applied inside as fp32(x) / T. A row of
        a tensor temperature that is not finite and > 0 is scored as NaN (no host sync to check it).
    tp_group, vocab_start, vocab_size: vocab-parallel layout (see `rl_logp.shard_layout`).
    inplace_backward: write dlogits into the logits' storage (no logits-sized buffer). Ignored (a new
        buffer) for leaf logits and under torch.compile; a later use of overwritten logits raises
        autograd's in-place error.
    Differentiable with respect to `logits`.
    """
    logp, _ = _score(logits, labels, entropy=False, want_logp=True, backend=backend, temperature=temperature,
                     tp_group=tp_group, vocab_start=vocab_start, vocab_size=vocab_size,
                     inplace_backward=inplace_backward, config=config, chunk_bytes=chunk_bytes,
                     fixed_point_bits=fixed_point_bits, strict=strict)
    return logp


def entropy(
    logits: torch.Tensor,
    *,
    backend: str | None = None,
    temperature: float | torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    config: LogpConfig | dict | None = None,
    chunk_bytes: int | None = None,
    fixed_point_bits: int | None = None,
    strict: bool | None = None,
) -> torch.Tensor:
    """Entropy of `softmax(logits / temperature)` per row, fp32, differentiable, batch-, chunk- and
    TP-invariant (H = log S' - E'/S' from two int64 fixed-point sums). Fully -inf rows give 0; rows holding
    NaN or +inf give NaN. Arguments as in `logprobs`."""
    _, ent = _score(logits, None, entropy=True, want_logp=False, backend=backend, temperature=temperature,
                    tp_group=tp_group, vocab_start=vocab_start, vocab_size=vocab_size, inplace_backward=False,
                    config=config, chunk_bytes=chunk_bytes, fixed_point_bits=fixed_point_bits, strict=strict)
    return ent


def logprobs_and_entropy(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) of the same logits from one read, with one combined backward (one read and one
    write of the logits for both gradients). The same bits as the two separate calls."""
    return _score(logits, labels, entropy=True, want_logp=True, backend=backend, temperature=temperature,
                  tp_group=tp_group, vocab_start=vocab_start, vocab_size=vocab_size,
                  inplace_backward=inplace_backward, config=config, chunk_bytes=chunk_bytes,
                  fixed_point_bits=fixed_point_bits, strict=strict)


def _normalizer(logits, backend, temperature, config, chunk_bytes, fixed_point_bits):
    cfg, inputs, name = _prepare(logits, None, temperature, config, backend, chunk_bytes, fixed_point_bits)
    if name not in INVARIANT_ENGINES:
        raise ValueError(f"rl_logp: this function needs an invariant backend (fused/chunked/auto), got {name!r}")
    check_vocab_fits(inputs.logits.shape[1], cfg.fixed_point_bits)
    if inputs.logits.shape[0] == 0:
        empty = torch.zeros(inputs.lead_shape, dtype=torch.float32, device=inputs.logits.device)
        return empty, empty, empty.clone()
    with torch.no_grad():
        _, _, lse, row_max, log_sum = _row_stats(inputs, cfg, name, False, False)
    shape = inputs.lead_shape
    return lse.reshape(shape), row_max.reshape(shape), log_sum.reshape(shape)


def logsumexp(
    logits: torch.Tensor,
    *,
    backend: str | None = None,
    temperature: float | torch.Tensor | None = None,
    config: LogpConfig | dict | None = None,
    chunk_bytes: int | None = None,
    fixed_point_bits: int | None = None,
) -> torch.Tensor:
    """The contract's lse = fp32(M + log(S 2^-F)) of each row of `logits / temperature` (fp32, the logits'
    row shape). Not differentiable. For logprobs of other columns use `log_normalizer`."""
    return _normalizer(logits, backend, temperature, config, chunk_bytes, fixed_point_bits)[0]


def log_normalizer(
    logits: torch.Tensor,
    *,
    backend: str | None = None,
    temperature: float | torch.Tensor | None = None,
    config: LogpConfig | dict | None = None,
    chunk_bytes: int | None = None,
    fixed_point_bits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, L) per row: the logprob of any column j is `(fp32(logits[..., j]) / T - M) - L`, the bits
    `logprobs` gives for label j. What a provider that scores several columns (vLLM's top-k and full-vocab
    logprobs) subtracts. Not differentiable."""
    _, row_max, log_sum = _normalizer(logits, backend, temperature, config, chunk_bytes, fixed_point_bits)
    return row_max, log_sum
