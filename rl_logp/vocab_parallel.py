"""Vocab-parallel (TP) layout: which slice of the vocabulary this rank holds, and the three collectives.

DESIGN.md point 6: all-reduce MAX of the row max, all-reduce SUM of the int64 fixed-point sums computed
with the global max, and SUM of the target logit from its owner (one value and zeros: exact). Before the
first of them, one small all-gather of (N, slice start, slice width) lets every rank check the layout and
raise the same error on all ranks instead of hanging in a mismatched collective.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


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


def _comm_device(group: dist.ProcessGroup, tensor_device: torch.device) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        if tensor_device.type != "cuda":
            raise ValueError("rl_logp: tp_group uses NCCL but the logits are on the CPU; use a gloo group")
        return tensor_device
    return torch.device("cpu")


def resolve_shard(
    group: dist.ProcessGroup,
    rows: int,
    width: int,
    device: torch.device,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
) -> VocabShard:
    """Agree on the layout with every rank of `group`; raise the same ValueError on all of them if off.

    Without `vocab_start`, rank r's slice starts after the slices of ranks 0..r-1 (Megatron's layout,
    equal or not). `vocab_size`, when given, must equal the sum of the slice widths.
    """
    comm = _comm_device(group, device)
    world = dist.get_world_size(group)
    start = -1 if vocab_start is None else int(vocab_start)
    total = -1 if vocab_size is None else int(vocab_size)
    meta = torch.tensor([rows, width, start, total], dtype=torch.int64, device=comm)
    gathered = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(gathered, meta, group=group)
    table = [tuple(int(v) for v in t.tolist()) for t in gathered]
    rank = dist.get_rank(group)
    problem = _layout_problem(table)
    if problem:
        lines = "; ".join(f"rank {r}: N={t[0]} width={t[1]} start={t[2]} vocab_size={t[3]}" for r, t in enumerate(table))
        raise ValueError(f"rl_logp: the TP ranks disagree on the vocab-parallel layout: {problem} [{lines}]")
    starts = _starts(table)
    return VocabShard(group=group, start=starts[rank], width=width, vocab_size=sum(t[1] for t in table), comm_device=comm)


def _starts(table: list[tuple[int, int, int, int]]) -> list[int]:
    if table[0][2] >= 0:
        return [t[2] for t in table]
    offsets, running = [], 0
    for t in table:
        offsets.append(running)
        running += t[1]
    return offsets


def _layout_problem(table: list[tuple[int, int, int, int]]) -> str:
    rows = {t[0] for t in table}
    if len(rows) > 1:
        return f"ranks hold different numbers of rows {sorted(rows)}; every rank must pass the same N rows"
    explicit = {t[2] >= 0 for t in table}
    if len(explicit) > 1:
        return "some ranks passed vocab_start and others did not; pass it on every rank or on none"
    totals = {t[3] for t in table}
    if len(totals) > 1:
        return f"ranks passed different vocab_size values {sorted(totals)}"
    widths_sum = sum(t[1] for t in table)
    total = totals.pop()
    if len(table) > 1 and total >= 0 and all(t[1] == total for t in table):
        return (
            "every rank holds the full vocabulary (width == vocab_size): this is not a vocab split; "
            "drop tp_group, or give each rank only its slice of the logits"
        )
    if total >= 0 and total != widths_sum:
        return f"the slice widths sum to {widths_sum} but vocab_size={total}"
    spans = sorted(zip(_starts(table), (t[1] for t in table), strict=False))
    expected = 0
    for start, width in spans:
        if start != expected:
            return f"the slices do not tile [0, {widths_sum}) contiguously (a slice starts at {start}, expected {expected})"
        expected = start + width
    return ""
