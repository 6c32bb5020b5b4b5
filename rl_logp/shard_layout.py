"""Vocab-parallel (TP) agreement: which slice of the vocabulary each rank holds, and that the ranks agree.

Before the first collective of a vocab-parallel call, one small all-gather of an int64 vector per rank
carries everything that must match: rows, slice bounds, the declared vocabulary size, fixed-point bits,
the engine, the logits' dtype, a checksum of the labels, the temperature (kind and a checksum of its
bits) and whether this rank's own input validation failed. Every rank then checks the same table and
raises the same `ValueError` naming the argument, so a disagreement never gives a silent result, a hang
in a mismatched collective, or an abort; a rank whose validation failed still takes part in the
all-gather, and its message is shared with every rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from rl_logp.temperature import Temperature

FIELDS = ("rows", "width", "vocab_start", "vocab_size", "fixed_point_bits", "engine", "dtype", "labels",
          "temperature_kind", "temperature", "validation_failed")
ENGINE_CODES = {"fused": 1, "chunked": 2, "torch": 3}
DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """This rank's contiguous slice [start, start + width) of a vocabulary of `vocab_size` columns."""

    group: dist.ProcessGroup
    start: int
    width: int
    vocab_size: int
    comm_device: torch.device

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        if tensor.device == self.comm_device:
            dist.all_reduce(tensor, op=op, group=self.group)
            return
        staged = tensor.to(self.comm_device)
        dist.all_reduce(staged, op=op, group=self.group)
        tensor.copy_(staged)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        self._all_reduce(tensor, dist.ReduceOp.MAX)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._all_reduce(tensor, dist.ReduceOp.SUM)


@dataclasses.dataclass
class LocalLayout:
    """What one rank brings to the agreement (device tensors are reduced to checksums)."""

    rows: int = -1
    width: int = -1
    vocab_start: int | None = None
    vocab_size: int | None = None
    bits: int = -1
    engine: str = ""
    dtype: torch.dtype | None = None
    labels: torch.Tensor | None = None
    temperature: Temperature | None = None
    device: torch.device | None = None
    error: str = ""


def comm_device(group: dist.ProcessGroup, tensor_device: torch.device | None) -> torch.device:
    """Where the group's collectives run: the CUDA device for NCCL, the CPU for gloo."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        if tensor_device is not None and tensor_device.type == "cuda":
            return tensor_device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _checksum(values: torch.Tensor) -> torch.Tensor:
    weights = torch.arange(1, values.numel() + 1, dtype=torch.int64, device=values.device)
    return (values.reshape(-1).to(torch.int64) * weights).sum()


def _meta(local: LocalLayout, device: torch.device) -> torch.Tensor:
    temp = local.temperature
    kind = -1 if temp is None else (2 if temp.rows is not None else (0 if temp.is_one else 1))
    scalar_bits = 0
    if temp is not None and temp.rows is None:
        scalar_bits = int(torch.tensor(temp.scalar, dtype=torch.float32).view(torch.int32))
    host = [
        local.rows, local.width, -1 if local.vocab_start is None else int(local.vocab_start),
        -1 if local.vocab_size is None else int(local.vocab_size), local.bits,
        ENGINE_CODES.get(local.engine, 0), DTYPE_CODES.get(local.dtype, 0), 0, kind, scalar_bits,
        int(bool(local.error)),
    ]
    meta = torch.tensor(host, dtype=torch.int64, device=device)
    if not local.error:
        if local.labels is not None:
            meta[7] = _checksum(local.labels).to(device)
        if temp is not None and temp.rows is not None:
            meta[9] = _checksum(temp.rows.view(torch.int32)).to(device)
    return meta


def agree(group: dist.ProcessGroup, local: LocalLayout) -> VocabShard:
    """All-gather the layouts; raise the same ValueError on every rank if anything disagrees."""
    device = comm_device(group, local.device)
    world = dist.get_world_size(group)
    meta = _meta(local, device)
    gathered = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(gathered, meta, group=group)
    table = [dict(zip(FIELDS, (int(v) for v in t.tolist()), strict=True)) for t in gathered]
    failed = [r for r, t in enumerate(table) if t["validation_failed"]]
    if failed:
        messages: list[str] = [""] * world
        dist.all_gather_object(messages, local.error, group=group)
        detail = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
        raise ValueError(f"rl_logp: input validation failed on TP rank(s) {failed} (raised on every rank): {detail}")
    problem = _layout_problem(table)
    if problem:
        raise ValueError(f"rl_logp: the TP ranks disagree: {problem} (raised on every rank of the TP group)")
    rank = dist.get_rank(group)
    return VocabShard(group=group, start=_starts(table)[rank], width=local.width,
                      vocab_size=sum(t["width"] for t in table), comm_device=device)


def _starts(table: list[dict]) -> list[int]:
    if table[0]["vocab_start"] >= 0:
        return [t["vocab_start"] for t in table]
    offsets, running = [], 0
    for t in table:
        offsets.append(running)
        running += t["width"]
    return offsets


def _differ(table: list[dict], field: str) -> bool:
    return len({t[field] for t in table}) > 1


def _values(table: list[dict], field: str) -> str:
    return ", ".join(f"rank {r}: {t[field]}" for r, t in enumerate(table))


def _layout_problem(table: list[dict]) -> str:
    checks = [
        ("rows", "ranks hold different numbers of rows; every rank must pass the same N rows"),
        ("fixed_point_bits", "fixed_point_bits differs; set the same value (or RL_LOGP_FIXED_POINT_BITS) on every rank"),
        ("engine", "the backend differs (codes " + str(ENGINE_CODES) + "); configure the same backend on every rank"),
        ("dtype", "the logits' dtype differs (codes " + str({str(k): v for k, v in DTYPE_CODES.items()}) + ")"),
        ("labels", "the labels differ (checksums); every rank must pass the same labels"),
        ("temperature_kind", "the temperature differs in kind (0 none, 1 float, 2 per-row tensor)"),
        ("temperature", "the temperature values differ (fp32 bit checksums); pass the same temperature"),
    ]
    for field, why in checks:
        if _differ(table, field):
            return f"{why} [{_values(table, field)}]"
    if len({t["vocab_start"] >= 0 for t in table}) > 1:
        return "some ranks passed vocab_start and others did not; pass it on every rank or on none"
    if _differ(table, "vocab_size"):
        return f"ranks passed different vocab_size values [{_values(table, 'vocab_size')}]"
    widths_sum = sum(t["width"] for t in table)
    total = table[0]["vocab_size"]
    if len(table) > 1 and total >= 0 and all(t["width"] == total for t in table):
        return (
            "every rank holds the full vocabulary (width == vocab_size): this is not a vocab split; "
            "drop tp_group, or give each rank only its slice of the logits"
        )
    if total >= 0 and total != widths_sum:
        return f"the slice widths sum to {widths_sum} but vocab_size={total}"
    spans = sorted(zip(_starts(table), (t["width"] for t in table), strict=True))
    expected = 0
    for start, width in spans:
        if start != expected:
            return f"the slices do not tile [0, {widths_sum}) contiguously (a slice starts at {start}, expected {expected})"
        expected = start + width
    return ""
