"""The public functions: `logprobs`, `entropy`, `logprobs_and_entropy`, `logsumexp`, `log_normalizer`, and
the rollout's scores of several columns, `column_logprobs` / `full_logprobs`.

Each turns its arguments into one `LogpRequest` (`_request`: the config, the validated inputs, the
backend, and with a `tp_group` the agreed vocabulary shard) and scores it: through the ops
(`rl_logp.ops.row_stats`) for the invariant engines, or a non-invariant baseline (`rl_logp.baselines`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from rl_logp import baselines, ops, rollout_calls
from rl_logp.config import LogpConfig, resolve_config
from rl_logp.engines import INVARIANT_ENGINES, RowStats, make_engine, resolve_backend
from rl_logp.request import LogpRequest, prepare_inputs
from rl_logp.shard_layout import LocalLayout, agree
from rl_logp.validation import check_vocab_fits


@dataclasses.dataclass(slots=True)
class Options:
    """The keyword arguments every public function shares (see `logprobs`)."""

    backend: str | None = None
    tp_group: dist.ProcessGroup | None = None
    vocab_start: int | None = None
    vocab_size: int | None = None
    config: LogpConfig | dict | None = None
    chunk_bytes: int | None = None
    fixed_point_bits: int | None = None
    strict: bool | None = None


def _given_config(config: object, *options: object) -> LogpConfig | None:
    """`config` itself where it is a `LogpConfig` that none of `options` (a call's other config options)
    overrides: what `resolve_config` returns for it, without the call (a rollout's every step). Else None."""
    return config if type(config) is LogpConfig and options.count(None) == len(options) else None


def _config(opts: Options) -> LogpConfig:
    given = _given_config(opts.config, opts.backend, opts.chunk_bytes, opts.fixed_point_bits, opts.strict)
    if given is not None:
        return given
    return resolve_config(opts.config, backend=opts.backend, chunk_bytes=opts.chunk_bytes,
                          fixed_point_bits=opts.fixed_point_bits, strict=opts.strict)


def _request(logits, labels, temperature, opts: Options, *, entropy: bool, normalizer: bool,
             inplace_backward: bool, columns: bool = False, full: bool = False) -> LogpRequest:
    if opts.tp_group is not None:
        return _vocab_parallel_request(logits, labels, temperature, opts, entropy=entropy, normalizer=normalizer,
                                       inplace_backward=inplace_backward)
    if opts.vocab_start is not None or opts.vocab_size is not None:
        raise ValueError("rl_logp: vocab_start/vocab_size describe a vocab split; pass tp_group with them")
    cfg = _config(opts)
    inputs = prepare_inputs(logits, labels, temperature, columns=columns)
    engine = resolve_backend(cfg.backend, inputs.logits.device)
    check_vocab_fits(inputs.logits.shape[1], cfg.fixed_point_bits)
    return inputs.request(cfg, engine, entropy=entropy, normalizer=normalizer,
                          inplace_backward=_inplace_allowed(logits, inplace_backward), full=full)


def _vocab_parallel_request(logits, labels, temperature, opts: Options, *, entropy: bool, normalizer: bool,
                            inplace_backward: bool) -> LogpRequest:
    """The request of this rank's shard, after every rank agreed on the layout (`rl_logp.shard_layout`):
    a failure of any rank's set-up reaches the agreement, so every rank raises instead of a peer waiting."""
    group = opts.tp_group
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"rl_logp: tp_group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    local = LocalLayout(vocab_start=opts.vocab_start, vocab_size=opts.vocab_size)
    mode = "every_call"
    try:
        cfg = _config(opts)
        mode = cfg.tp_agreement
        inputs = prepare_inputs(logits, labels, temperature)
        x = inputs.logits
        local.device = x.device
        engine = resolve_backend(cfg.backend, x.device)
        _check_vocab_parallel(engine, entropy, x)
        local.rows, local.width, local.bits, local.engine = x.shape[0], x.shape[1], cfg.fixed_point_bits, engine
        local.dtype, local.labels, local.temperature = x.dtype, inputs.labels, inputs.temperature
    except Exception as err:
        if isinstance(logits, torch.Tensor):
            local.device = logits.device
        local.error = str(err) if isinstance(err, (TypeError, ValueError)) else f"{type(err).__name__}: {err}"
    shard = agree(group, local, mode)
    check_vocab_fits(shard.vocab_size, cfg.fixed_point_bits)
    return inputs.request(cfg, engine, entropy=entropy, normalizer=normalizer,
                          inplace_backward=_inplace_allowed(logits, inplace_backward), shard=shard)


def _check_vocab_parallel(engine: str, entropy: bool, x: torch.Tensor) -> None:
    if engine == "flash_attn":
        raise ValueError("rl_logp: backend='flash_attn' has no vocab-parallel form; use 'fused' or 'chunked'")
    if engine == "torch" and torch.is_grad_enabled() and x.requires_grad:
        raise ValueError(
            "rl_logp: backend='torch' with tp_group is a forward-only diagnostic (Megatron-style float "
            "sums); use backend='fused' or 'chunked' for gradients, or call it under torch.no_grad()"
        )
    if engine == "torch" and entropy:
        raise ValueError("rl_logp: backend='torch' has no vocab-parallel entropy; use 'fused' or 'chunked'")


def _inplace_allowed(logits: torch.Tensor, inplace_backward: bool) -> bool:
    """inplace_backward is honoured unless the logits' storage belongs to a leaf (the leaf itself, or a
    view of one: the gradient would overwrite the user's tensor and alias `.grad`) or under torch.compile
    (functionalisation would copy the buffer back anyway); both fall back to a new gradient buffer."""
    if not inplace_backward or torch.compiler.is_compiling():
        return False
    base = logits._base if logits._base is not None else logits
    return not (logits.is_leaf or base.is_leaf)


def _score(logits, labels, temperature, opts: Options, *, entropy: bool, normalizer: bool = False,
           inplace_backward: bool = False) -> tuple[RowStats, torch.Size]:
    """The request's statistics (each [N]) and the logits' row shape."""
    req = _request(logits, labels, temperature, opts, entropy=entropy, normalizer=normalizer,
                   inplace_backward=inplace_backward)
    return _request_stats(req, logits), req.lead_shape


def _request_stats(req: LogpRequest, logits: torch.Tensor) -> RowStats:
    """A request's statistics: a baseline's, or the ops' (NaN where the TP ranks disagreed on this call)."""
    if req.engine not in INVARIANT_ENGINES:
        if req.shard is not None:
            return RowStats(logp=baselines.vocab_parallel_torch_logprobs(req))
        return baselines.row_stats(req)
    if req.rows == 0:
        return _empty(req, logits)
    stats = ops.row_stats(req)
    disagreement = None if req.shard is None else req.shard.disagreement
    if disagreement is not None:
        stats = RowStats(**{f.name: _poisoned(getattr(stats, f.name), disagreement) for f in dataclasses.fields(stats)})
    return stats


def _shaped(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """t in the caller's shape (a reshape costs microseconds even when the shape is already right)."""
    return t if t.shape == shape else t.reshape(shape)


def _poisoned(t: torch.Tensor | None, disagreement: torch.Tensor) -> torch.Tensor | None:
    """NaN everywhere when the TP ranks disagreed on this call (found on the device, see shard_layout)."""
    return None if t is None else torch.where(disagreement, float("nan"), t)


def _empty(req: LogpRequest, logits: torch.Tensor) -> RowStats:
    """An empty batch's statistics, still connected to the autograd graph of the logits."""
    zero = (logits.sum() * 0).to(torch.float32)
    empty = lambda: torch.zeros(0, dtype=torch.float32, device=req.logits.device) + zero  # noqa: E731
    return RowStats(row_max=empty(), log_sum=empty(), lse=empty(), logp=empty(), entropy=empty())


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
        buffer) when that storage belongs to a leaf tensor (the leaf or a view of it) and under
        torch.compile; a later use of overwritten logits raises autograd's in-place error.
    Differentiable with respect to `logits`.
    """
    opts = Options(backend, tp_group, vocab_start, vocab_size, config, chunk_bytes, fixed_point_bits, strict)
    if _plannable(logits, opts):
        return _shaped(_eager_output("logp", logits, labels, temperature, opts), logits.shape[:-1])
    stats, shape = _score(logits, labels, temperature, opts, entropy=False, inplace_backward=inplace_backward)
    return _shaped(stats.logp, shape)


def entropy(
    logits: torch.Tensor,
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
    """Entropy of `softmax(logits / temperature)` per row, fp32, differentiable, batch-, chunk- and
    TP-invariant (H = log S' - E'/S' from two int64 fixed-point sums). Fully -inf rows give 0; rows holding
    NaN or +inf give NaN. Arguments as in `logprobs` (`inplace_backward` included)."""
    opts = Options(backend, tp_group, vocab_start, vocab_size, config, chunk_bytes, fixed_point_bits, strict)
    stats, shape = _score(logits, None, temperature, opts, entropy=True, inplace_backward=inplace_backward)
    return _shaped(stats.entropy, shape)


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
    opts = Options(backend, tp_group, vocab_start, vocab_size, config, chunk_bytes, fixed_point_bits, strict)
    stats, shape = _score(logits, labels, temperature, opts, entropy=True, inplace_backward=inplace_backward)
    return _shaped(stats.logp, shape), _shaped(stats.entropy, shape)


def _normalizer(logits, temperature, opts: Options) -> tuple[RowStats, torch.Size]:
    with torch.no_grad():
        stats, shape = _score(logits, None, temperature, opts, entropy=False, normalizer=True)
    if stats.lse is None:
        raise ValueError(
            f"rl_logp: this function needs an invariant backend (fused/chunked/auto), got {_config(opts).backend!r}"
        )
    return stats, shape


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
    stats, shape = _normalizer(logits, temperature, Options(backend, config=config, chunk_bytes=chunk_bytes,
                                                            fixed_point_bits=fixed_point_bits))
    return _shaped(stats.lse, shape)


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
    stats, shape = _normalizer(logits, temperature, Options(backend, config=config, chunk_bytes=chunk_bytes,
                                                            fixed_point_bits=fixed_point_bits))
    return _shaped(stats.row_max, shape), _shaped(stats.log_sum, shape)


def _plannable(logits: object, opts: Options) -> bool:
    """An eager single-device call with nothing to differentiate: one output, whose signature may have a
    plan (`rl_logp.rollout_calls`)."""
    return (type(logits) is torch.Tensor and opts.tp_group is None and opts.vocab_start is None
            and opts.vocab_size is None and not torch.compiler.is_compiling()
            and not (logits.requires_grad and torch.is_grad_enabled()))


def _plan_output(kind: str, logits, labels, temperature, cfg: LogpConfig) -> tuple[tuple | None, torch.Tensor | None]:
    """(the signature of a `_plannable` call with the resolved `cfg`, the output of its plan): (None, None)
    for a tensor temperature or a call with no signature (`rollout_calls.signature`), (key, None) where the
    signature has no plan or its launch declined."""
    if temperature is not None and type(temperature) is not float:
        return None, None
    key = rollout_calls.signature((kind, id(cfg), temperature), logits, labels)
    if key is None:
        return None, None
    return key, rollout_calls.run(key, (logits,) if labels is None else (logits, labels))


def _eager_output(kind: str, logits, labels, temperature, opts: Options) -> torch.Tensor:
    """The one output of a `_plannable` call: the logp of the labels ("logp"), of K columns per row
    ("columns") or of every column ("full"). A signature (the kind, the config object, a float temperature,
    the logits and labels) seen before runs its plan (the output allocated and one launch on the fused path,
    `rl_logp.rollout_calls`); otherwise the request is built and scored, and the signature kept where the
    engine ran on the caller's own tensors (no reshape, cast or copy of them) and can repeat the call."""
    cfg = _config(opts)
    key, out = _plan_output(kind, logits, labels, temperature, cfg)
    if out is not None:
        return out
    req = _request(logits, labels, temperature, opts, entropy=False, normalizer=False, inplace_backward=False,
                   columns=kind == "columns", full=kind == "full")
    engine = make_engine(req.engine, req.chunk_bytes) if req.engine in INVARIANT_ENGINES else None
    if kind == "logp":
        out = _request_stats(req, logits).logp
    elif engine is None:
        raise ValueError(f"rl_logp: this function needs an invariant backend (fused/chunked/auto), got {req.engine!r}")
    else:
        stats = engine.row_stats(req)
        out = stats.full if kind == "full" else stats.logp
    if (key is not None and engine is not None and req.rows and req.logits is logits
            and req.labels is labels):  # the engine ran on the caller's own tensors: repeatable as it ran
        rollout_calls.remember(key, cfg, engine.bind_scores(req, out), out)
    return out


def _planned(kind: str, logits, columns, temperature, config, backend, chunk_bytes, fixed_point_bits) -> torch.Tensor | None:
    """A rollout's repeated call (`full_logprobs` with `kind` "full", `column_logprobs` with "columns") run
    straight from its plan, before any `Options` is built: where `config` is a `LogpConfig` that none of the
    call's other config options overrides, as the rollout adapters call, and the signature
    `_eager_output` keeps for it has a plan (`_plan_output`). None otherwise, and the call takes
    `_rollout_scores`. Neither output is differentiable, so a call on logits that require grad runs the same
    plan as `_rollout_scores` runs it under no_grad."""
    cfg = _given_config(config, backend, chunk_bytes, fixed_point_bits)
    if cfg is None or torch.compiler.is_compiling():
        return None
    return _plan_output(kind, logits, columns, temperature, cfg)[1]


def _rollout_scores(logits, columns, temperature, opts: Options, *, full: bool) -> torch.Tensor:
    """The logprobs of `columns` (or with `full` of every column): one forward of an invariant engine straight
    from the engine (no op, no autograd), what a rollout engine asks at every decode step (`_eager_output`).
    Captured in a CUDA graph, a few rows take the split plan's two or three launches (see
    `rl_logp.kernels.launch`). Under torch.compile it runs eagerly (a graph break); eager calls skip the
    compiler's wrapper, which costs microseconds per call."""
    if torch.compiler.is_compiling():
        return _eager_rollout_scores(logits, columns, temperature, opts, full=full)
    if isinstance(logits, torch.Tensor) and logits.requires_grad and torch.is_grad_enabled():
        with torch.no_grad():
            return _rollout_scores(logits, columns, temperature, opts, full=full)
    return _eager_output("full" if full else "columns", logits, columns, temperature, opts)


_eager_rollout_scores = torch.compiler.disable(_rollout_scores)


def column_logprobs(
    logits: torch.Tensor,
    columns: torch.Tensor,
    *,
    backend: str | None = None,
    temperature: float | torch.Tensor | None = None,
    config: LogpConfig | dict | None = None,
    chunk_bytes: int | None = None,
    fixed_point_bits: int | None = None,
) -> torch.Tensor:
    """Logprobs of K columns of each row, fp32 of `columns`' shape (the logits' row shape + [K], int64 or
    int32 ids): entry k of a row is what `logprobs(logits, ids)` gives for id `columns[..., k]`, bit for
    bit (0 for an id outside [0, V) or a row of -inf). A rollout's sampled token and top-n logprobs: one
    kernel launch on the fused path (eager). Not differentiable; runs eagerly under torch.compile."""
    out = _planned("columns", logits, columns, temperature, config, backend, chunk_bytes, fixed_point_bits)
    if out is not None:
        return out
    opts = Options(backend, config=config, chunk_bytes=chunk_bytes, fixed_point_bits=fixed_point_bits)
    return _shaped(_rollout_scores(logits, columns, temperature, opts, full=False), columns.shape)


def full_logprobs(
    logits: torch.Tensor,
    *,
    backend: str | None = None,
    temperature: float | torch.Tensor | None = None,
    config: LogpConfig | dict | None = None,
    chunk_bytes: int | None = None,
    fixed_point_bits: int | None = None,
) -> torch.Tensor:
    """Every column's logprob, `(z - M) - L` (z = fp32(logits) / T, (M, L) = `log_normalizer`), fp32 of the
    logits' shape: column j of a row holds the bits `logprobs` gives for label j wherever the row has a
    finite max (a row of -inf gives NaN, as log_softmax does). A rollout's full-vocabulary logprobs: one
    kernel launch on the fused path (eager; max pass, sums pass, write pass). Not differentiable; runs eagerly
    under torch.compile."""
    out = _planned("full", logits, None, temperature, config, backend, chunk_bytes, fixed_point_bits)
    if out is not None:
        return out
    opts = Options(backend, config=config, chunk_bytes=chunk_bytes, fixed_point_bits=fixed_point_bits)
    return _shaped(_rollout_scores(logits, None, temperature, opts, full=True), logits.shape)
