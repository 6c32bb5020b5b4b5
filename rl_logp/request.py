"""`LogpRequest`: one validated call, the object that travels from the public API to the engines.

It holds the logits as a 2-D block [N, V] (V this rank's slice with a `shard`), the labels as int64 [N]
global column ids (or None), one `Temperature`, what to compute (`entropy`, `normalizer`: M, L and lse
for a backward or `log_normalizer`), the engine and its settings, and the in-place-backward flag. The
ops (`rl_logp.ops`) flatten it to their schema and back; nothing else takes it apart. Requests are built
once per call and never changed (plain slotted dataclasses: a frozen one costs a microsecond per call).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rl_logp.config import LogpConfig
from rl_logp.shard_layout import VocabShard
from rl_logp.temperature import Temperature
from rl_logp.validation import check_labels, check_logits, check_temperature


@dataclasses.dataclass(slots=True)
class LogpRequest:
    logits: torch.Tensor  # [N, V_local] bf16/fp16/fp32, last dimension contiguous
    labels: torch.Tensor | None  # [N] (or [N, K]: K per row) int64 global column ids; None: no logp
    temperature: Temperature
    entropy: bool
    normalizer: bool  # M, L and lse wanted (a backward, logsumexp, log_normalizer)
    engine: str  # "fused" | "chunked", or a baseline ("torch" | "flash_attn")
    bits: int
    chunk_bytes: int
    lead_shape: torch.Size  # the logits' shape without the vocabulary dimension (outputs take it)
    inplace_backward: bool = False
    shard: VocabShard | None = None
    full: bool = False  # every column's logprob [N, V] wanted (a rollout's full-vocabulary logprobs)

    @property
    def rows(self) -> int:
        return self.logits.shape[0]

    @property
    def vocab_offset(self) -> int:
        """The global id of this block's first column."""
        return 0 if self.shard is None else self.shard.start

    @property
    def vocab_total(self) -> int:
        """Columns of the whole vocabulary (over every rank)."""
        return self.logits.shape[1] if self.shard is None else self.shard.vocab_size


@dataclasses.dataclass(slots=True)
class Inputs:
    """Validated public arguments in the engines' shapes, before an engine is chosen."""

    logits: torch.Tensor
    labels: torch.Tensor | None
    temperature: Temperature
    lead_shape: torch.Size

    def request(self, cfg: LogpConfig, engine: str, *, entropy: bool, normalizer: bool,
                inplace_backward: bool = False, shard: VocabShard | None = None, full: bool = False) -> LogpRequest:
        return LogpRequest(self.logits, self.labels, self.temperature, entropy, normalizer, engine,
                           cfg.fixed_point_bits, cfg.chunk_bytes, self.lead_shape, inplace_backward, shard, full)


def prepare_inputs(logits: object, labels: object | None, temperature: float | torch.Tensor | None, *,
                   columns: bool = False) -> Inputs:
    """Validate and flatten without copying, unless the logits are fp64 (scored as fp32(x), the contract
    being defined on fp32 z; the gradient flows back in fp64) or their last dimension is strided. With
    `columns`, the labels hold K ids per row (the logits' row shape + [K]) and become [N, K]. Nothing
    here reads a tensor's values, so nothing here syncs with a GPU."""
    x = check_logits(logits)
    y = None if labels is None else check_labels(labels, x, columns=columns)
    lead_shape = x.shape[:-1]
    vocab = x.shape[-1]
    n = math.prod(lead_shape)
    x2 = x if x.dim() == 2 else x.reshape(n, vocab)
    if x2.dtype == torch.float64:
        x2 = x2.to(torch.float32)
    if vocab > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    if y is not None:
        if columns:
            if y.dim() != 2:
                y = y.reshape(n, y.shape[-1])
        elif y.dim() != 1:
            y = y.reshape(n)
        if y.dtype != torch.int64:
            y = y.to(torch.int64)
        if not y.is_contiguous():  # a strided column (vLLM's ids[:, 0]): the kernels read labels densely
            y = y.contiguous()
    return Inputs(x2, y, check_temperature(temperature, x, n), lead_shape)
