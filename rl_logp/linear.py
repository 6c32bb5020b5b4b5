"""`linear_logits` and `linear_logprobs`: the logits `hidden @ weight.T` from a batch-invariant matmul, and
their log-probabilities (and entropy) without a logits-sized buffer.

`linear_logits` is the matmul of `rl_logp.linear_matmul` (each logit a fixed-order fp32 reduction over the
hidden dimension, rounded once to hidden's dtype): its bits do not depend on the number of rows, their
order, or where the vocabulary is cut. `linear_logprobs` gives exactly
`rl_logp.logprobs(linear_logits(hidden, weight), labels)` (and `rl_logp.entropy` of the same logits), and
the same gradients with respect to hidden and weight, bit for bit, while holding at most `chunk_bytes` of
logits at a time:
- forward, per block of rows (a multiple of `ALIGN`, from `chunk_bytes`): the block's logits, then the
  request path of `rl_logp.logprobs` on them (`rl_logp.api`: the ops, the engines, the vocab-parallel
  provider with a `tp_group`); only hidden, weight, labels, the temperature and three fp32 values per row
  (M, L, entropy) are kept for the backward;
- backward, per block of vocabulary columns (a multiple of `ALIGN`): the block's logits for every row
  again, the engine's row-local gradient written over them (the bits the unfused backward writes), then
  `grad_W[block] = dlogits.T @ hidden` and `grad_h += dlogits @ weight[block]` into one fp32 [N, H]
  accumulator (cut at multiples of the kernel's reduction step: the bits of one product over all V).

The backward walks the vocabulary rather than the rows so that its fp32 accumulator is [N, H], not
[V, H] (2.5 GB at V = 151936, H = 4096): the head's peak memory stays at the gradients themselves plus
one block of logits.

Vocab-parallel: `weight` holds this rank's rows of the vocabulary; logp and entropy are every rank's same
bits (the TP=1 bits), `grad_W` is this rank's rows of the TP=1 gradient, and `grad_h` is this rank's partial
sum over its vocabulary rows: the caller's column-parallel wrapper all-reduces it, as Megatron's lm_head does.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from rl_logp import api
from rl_logp.config import LogpConfig
from rl_logp.engines import INVARIANT_ENGINES, RowStats, make_engine, resolve_backend
from rl_logp.linear_matmul import ALIGN, matmul, uses_triton
from rl_logp.request import LogpRequest
from rl_logp.shard_layout import VocabShard
from rl_logp.temperature import Temperature
from rl_logp.validation import check_labels, check_temperature

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_linear(hidden: object, weight: object) -> None:
    for name, value in (("hidden", hidden), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"rl_logp: {name} must be a torch.Tensor, got {type(value).__name__}")
    if hidden.dtype not in FLOAT_DTYPES:
        raise TypeError(f"rl_logp: hidden has dtype {hidden.dtype}; bf16, fp16 or fp32 are supported")
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"rl_logp: weight has dtype {weight.dtype} but hidden {hidden.dtype}; cast one to the other "
            "(e.g. weight.to(hidden.dtype))"
        )
    if weight.device != hidden.device:
        raise ValueError(f"rl_logp: weight is on {weight.device} but hidden on {hidden.device}; move it there")
    if hidden.dim() < 1 or weight.dim() != 2:
        raise ValueError(
            f"rl_logp: hidden must be [..., H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"rl_logp: weight is [V, H] = {tuple(weight.shape)} but hidden's last dimension is {hidden.shape[-1]}; "
            "pass the lm_head's weight as stored by nn.Linear ([vocab, hidden]), not its transpose"
        )
    if weight.shape[0] == 0:
        raise ValueError("rl_logp: weight has no vocabulary rows (V == 0)")


def _rows2d(hidden: torch.Tensor) -> torch.Tensor:
    h = hidden.reshape(-1, hidden.shape[-1])
    return h if h.shape[1] <= 1 or h.stride(1) == 1 else h.contiguous()


def _span(other: int, element_size: int, budget: int) -> int:
    """How many rows (or columns) of an [*, other] block fit in `budget` bytes: a multiple of ALIGN, >= ALIGN."""
    return max(ALIGN, budget // max(1, other * element_size) // ALIGN * ALIGN)


def _engine(cfg: LogpConfig, device: torch.device) -> str:
    engine = resolve_backend(cfg.backend, device)
    if engine not in INVARIANT_ENGINES:
        raise ValueError(
            f"rl_logp: linear_logprobs/linear_logits need an invariant backend (auto, fused or chunked), "
            f"got backend={cfg.backend!r}"
        )
    return engine


def _logits(hidden: torch.Tensor, weight: torch.Tensor, triton: bool) -> torch.Tensor:
    out = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    matmul(hidden, weight.t(), out, triton=triton)
    return out


def _accumulate_grads(dlogits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, cols: slice,
                      grad_h_acc: torch.Tensor | None, grad_w: torch.Tensor | None, triton: bool) -> None:
    """For dlogits of the vocabulary rows `cols`: grad_h_acc += dlogits @ weight[cols] (fp32) and
    grad_w[cols] = dlogits.T @ hidden."""
    if grad_h_acc is not None:
        matmul(dlogits, weight[cols], grad_h_acc, triton=triton, accumulate=True)
    if grad_w is not None:
        matmul(dlogits.t(), hidden, grad_w[cols], triton=triton)


class _LinearLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, triton):
        ctx.save_for_backward(hidden, weight)
        ctx.triton = triton
        return _logits(hidden, weight, triton)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h_acc = hidden.new_zeros(hidden.shape, dtype=torch.float32) if need_h else None
        grad_w = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_w else None
        _accumulate_grads(grad, hidden, weight, slice(0, weight.shape[0]), grad_h_acc, grad_w, ctx.triton)
        return None if grad_h_acc is None else grad_h_acc.to(hidden.dtype), grad_w, None


def linear_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    backend: str | None = None,
    config: LogpConfig | dict | None = None,
) -> torch.Tensor:
    """`hidden @ weight.T` ([..., V], hidden's dtype, fp32 accumulation), batch- and vocab-split-invariant:
    each logit is a fixed-order reduction of its own row and column. The logits `linear_logprobs` scores.
    hidden: [..., H] bf16/fp16/fp32; weight: [V, H] (nn.Linear's layout), hidden's dtype and device.
    backend: as in `rl_logp.logprobs` (the Triton kernel on CUDA; on the CPU `fused` runs it under
    TRITON_INTERPRET=1, `chunked`/`auto` a fixed-order torch loop). Differentiable in hidden and weight."""
    _check_linear(hidden, weight)
    cfg = api._config(api.Options(backend=backend, config=config))
    triton = uses_triton(_engine(cfg, hidden.device), hidden.device)
    out = _LinearLogits.apply(_rows2d(hidden), weight, triton)
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


@dataclasses.dataclass(frozen=True)
class _Call:
    """The non-tensor settings of one linear_logprobs call."""

    opts: api.Options
    cfg: LogpConfig
    engine: str
    triton: bool
    t_scalar: float
    entropy: bool


def _stats(x: torch.Tensor, labels: torch.Tensor, temperature, call: _Call) -> tuple[RowStats, LogpRequest]:
    """M, L, logp (and entropy) of one block of logits rows through `rl_logp.logprobs`'s request path."""
    req = api._request(x, labels, temperature, call.opts, entropy=call.entropy, normalizer=True,
                       inplace_backward=False)
    return api._request_stats(req, x), req


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temp_rows, call: _Call):
        n, vocab = hidden.shape[0], weight.shape[0]
        new = lambda: torch.empty(n, dtype=torch.float32, device=hidden.device)  # noqa: E731
        logp, row_max, log_sum = new(), new(), new()
        ent = new() if call.entropy else hidden.new_empty(0, dtype=torch.float32)
        step = _span(vocab, hidden.element_size(), call.cfg.chunk_bytes)
        shard = None
        for start in range(0, max(n, 1), step):  # one block even for no rows: TP peers agree on it
            rows = slice(start, min(n, start + step))
            x = _logits(hidden[rows], weight, call.triton)
            temperature = call.t_scalar if temp_rows is None else temp_rows[rows]
            stats, req = _stats(x, labels[rows], temperature, call)
            shard = req.shard
            if req.rows:
                for out, value in ((logp, stats.logp), (row_max, stats.row_max), (log_sum, stats.log_sum)):
                    out[rows] = value
                if call.entropy:
                    ent[rows] = stats.entropy
        ctx.save_for_backward(hidden, weight, labels, temp_rows, row_max, log_sum, ent if call.entropy else None)
        ctx.call = call
        ctx.columns = (0, vocab) if shard is None else (shard.start, shard.vocab_size)
        if not call.entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        if torch.is_grad_enabled():
            raise RuntimeError("rl_logp: double backward through linear_logprobs is not supported")
        hidden, weight, labels, temp_rows, row_max, log_sum, ent = ctx.saved_tensors
        call = ctx.call
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h_acc = hidden.new_zeros(hidden.shape, dtype=torch.float32) if need_h else None
        grad_w = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_w else None
        n, vocab = hidden.shape[0], weight.shape[0]
        if n and (need_h or need_w):
            engine = make_engine(call.engine, call.cfg.chunk_bytes)
            stats = RowStats(row_max=row_max, log_sum=log_sum, entropy=ent)
            temperature = Temperature(rows=temp_rows, scalar=call.t_scalar)
            offset, total = ctx.columns
            step = _span(n, hidden.element_size(), call.cfg.chunk_bytes)
            for start in range(0, vocab, step):
                cols = slice(start, min(vocab, start + step))
                x = _logits(hidden, weight[cols], call.triton)
                shard = VocabShard(group=None, start=offset + start, width=x.shape[1], vocab_size=total,
                                   comm_device=x.device)
                req = LogpRequest(x, labels, temperature, call.entropy, True, call.engine, call.cfg.fixed_point_bits,
                                  call.cfg.chunk_bytes, torch.Size([n]), False, shard)
                engine.grad(req, stats, g_logp, g_entropy if call.entropy else None, x)
                _accumulate_grads(x, hidden, weight, cols, grad_h_acc, grad_w, call.triton)
        elif grad_w is not None:
            grad_w.zero_()
        grad_h = None if grad_h_acc is None else grad_h_acc.to(hidden.dtype)
        return grad_h, grad_w, None, None, None


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor | None = None,
    entropy: bool = False,
    backend: str | None = None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    config: LogpConfig | dict | None = None,
    chunk_bytes: int | None = None,
    fixed_point_bits: int | None = None,
    strict: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of `labels` under `softmax(hidden @ weight.T / temperature)` (fp32, hidden's row
    shape), and with `entropy=True` the pair (logp, entropy), without materialising the logits: the bits of
    `rl_logp.logprobs(rl_logp.linear_logits(hidden, weight), labels, ...)` and of `rl_logp.entropy` on the
    same logits, with the same gradients for hidden and weight.

    hidden: [..., H] bf16/fp16/fp32; weight: [V, H] in hidden's dtype (with `tp_group`: this rank's
    contiguous rows of the vocabulary; the returned grad of hidden is this rank's partial, see the module
    docstring); labels: int64/int32 of hidden's row shape, global column ids, outside [0, V) scored 0.
    temperature, backend, tp_group, vocab_start, vocab_size, config, fixed_point_bits, strict: as in
    `rl_logp.logprobs` (invariant backends only). chunk_bytes: also bounds the logits held at a time (a block
    of rows in the forward, of vocabulary columns in the backward; default 256 MiB).
    """
    _check_linear(hidden, weight)
    opts = api.Options(backend, tp_group, vocab_start, vocab_size, config, chunk_bytes, fixed_point_bits, strict)
    cfg = api._config(opts)
    engine = _engine(cfg, hidden.device)
    h = _rows2d(hidden)
    y = check_labels(labels, hidden, against="hidden").reshape(-1).to(torch.int64).contiguous()
    temp = check_temperature(temperature, hidden, h.shape[0])
    call = _Call(opts, cfg, engine, uses_triton(engine, hidden.device), float(temp.scalar), entropy)
    logp, ent = _LinearLogprobs.apply(h, weight, y, temp.rows, call)
    lead = hidden.shape[:-1]
    return (logp.reshape(lead), ent.reshape(lead)) if entropy else logp.reshape(lead)
