"""Vocab-parallel (TP) agreement: which slice of the vocabulary each rank holds, and that the ranks agree.

Before the first collective of a vocab-parallel call, one all-gather of a fixed-size int64 vector per rank
carries everything that must match: rows, slice bounds, the declared vocabulary size, fixed-point bits,
the engine, the logits' dtype, a checksum of the labels, the temperature (kind and a checksum of its
bits), whether this rank's own input validation failed, and that failure's message. Every rank checks the
same table and raises the same `ValueError` naming the argument, so a disagreement never gives a silent
result, a hang in a mismatched collective, or an abort. Every call runs exactly one such all-gather,
whatever happens, so the ranks' collectives stay in step.

Reading the table is a host sync. `tp_agreement="every_call"` (the default) reads it at every call.
`tp_agreement="first_call"` reads it once per process group and layout (rows, widths, bounds, bits,
engine, dtype, temperature kind and scalar value); on later calls with that layout the table is compared
on the device: no host sync (a TP step can be captured in a CUDA graph), and a disagreement (labels or
per-row temperatures that differ, a rank whose validation failed) turns that call's outputs into NaN
and raises `ValueError` at the next call that finds the flag copied back to the host (a CPU group
reads the table at once, as "every_call" does). What it gives up on a GPU: the error comes after that
call's collectives, and names no argument; a rank whose own validation fails still raises at once, and
its peers then wait in their next collective until its process ends.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist

from rl_logp.temperature import Temperature

FIELDS = ("rows", "width", "vocab_start", "vocab_size", "fixed_point_bits", "engine", "dtype", "temperature_kind",
          "temperature_scalar", "labels", "temperature", "validation_failed")
MESSAGE_WORDS = 48  # int64 words of the failure message (UTF-8, truncated to 384 bytes)
ENGINE_CODES = {"fused": 1, "chunked": 2, "torch": 3}
DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """This rank's contiguous slice [start, start + width) of a vocabulary of `vocab_size` columns.
    `disagreement` (a device bool, "first_call" mode after the first call): the outputs must be NaN."""

    group: dist.ProcessGroup
    start: int
    width: int
    vocab_size: int
    comm_device: torch.device
    disagreement: torch.Tensor | None = None

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

    def layout(self) -> tuple[int, ...]:
        """The fields a layout is cached by in "first_call" mode (the table's first ones), as host integers;
        the labels and per-row temperatures are compared per call."""
        temp = self.temperature
        kind = -1 if temp is None else (2 if temp.rows is not None else (0 if temp.is_one else 1))
        scalar_bits = 0
        if temp is not None and temp.rows is None:
            scalar_bits = int(torch.tensor(temp.scalar, dtype=torch.float32).view(torch.int32))
        return (self.rows, self.width, -1 if self.vocab_start is None else int(self.vocab_start),
                -1 if self.vocab_size is None else int(self.vocab_size), self.bits,
                ENGINE_CODES.get(self.engine, 0), DTYPE_CODES.get(self.dtype, 0), kind, scalar_bits)


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
    return (values.reshape(-1).to(torch.int64) * weights).sum().reshape(1)


def _message_words(message: str) -> list[int]:
    raw = message.encode()[: 8 * MESSAGE_WORDS].ljust(8 * MESSAGE_WORDS, b"\0")
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def _message(words: list[int]) -> str:
    return b"".join(w.to_bytes(8, "little", signed=True) for w in words).rstrip(b"\0").decode(errors="replace")


def _per_call(local: LocalLayout, device: torch.device, zeros: torch.Tensor) -> list[torch.Tensor]:
    """The labels and per-row temperature checksums, the failure flag and message, on `device`."""
    if local.error:
        return [torch.tensor([0, 0, 1, *_message_words(local.error)], dtype=torch.int64, device=device)]
    temp = local.temperature
    labels = zeros[:1] if local.labels is None else _checksum(local.labels).to(device)
    rows = zeros[:1] if temp is None or temp.rows is None else _checksum(temp.rows.view(torch.int32)).to(device)
    return [labels, rows, zeros[: 1 + MESSAGE_WORDS]]


def _gather(group: dist.ProcessGroup, meta: torch.Tensor) -> torch.Tensor:
    world = dist.get_world_size(group)
    gathered = meta.new_empty(world * meta.numel())
    dist.all_gather_into_tensor(gathered, meta, group=group)
    return gathered.view(world, meta.numel())


@dataclasses.dataclass
class _Agreed:
    """A layout agreed on the host in "first_call" mode, and its pending disagreement flag. It holds this
    rank's slice without its group (`start`, `width`, `vocab_size`, `comm_device`): the group is the key
    of `_agreed`, held weakly."""

    start: int
    width: int
    vocab_size: int
    comm_device: torch.device
    layout: torch.Tensor  # this rank's layout fields, on the collectives' device
    zeros: torch.Tensor
    flag: torch.Tensor  # device bool: some later call disagreed
    seen: torch.Tensor | None  # pinned host copy of `flag` (CUDA), with `event` marking when it is valid
    event: torch.cuda.Event | None

    def shard(self, group: dist.ProcessGroup, disagreement: torch.Tensor | None = None) -> VocabShard:
        return VocabShard(group=group, start=self.start, width=self.width, vocab_size=self.vocab_size,
                          comm_device=self.comm_device, disagreement=disagreement)


# The agreed layouts of each process group, the group held weakly: a group destroyed by its owner
# (`dist.destroy_process_group`) is not kept alive here, nor its threads until the interpreter's teardown.
_agreed: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, _Agreed]] = weakref.WeakKeyDictionary()


@torch.compiler.disable
def agree(group: dist.ProcessGroup, local: LocalLayout, mode: str = "every_call") -> VocabShard:
    """One all-gather of the ranks' tables; the same ValueError on every rank if anything disagrees (see
    the module docstring for `mode`)."""
    device = comm_device(group, local.device)
    layout = local.layout()
    agreed = _agreed.get(group, {}).get(layout) if mode == "first_call" else None
    if agreed is not None:
        return _agree_on_device(group, local, agreed)
    zeros = torch.zeros(1 + MESSAGE_WORDS, dtype=torch.int64, device=device)
    meta = torch.cat([torch.tensor(layout, dtype=torch.int64, device=device), *_per_call(local, device, zeros)])
    table = _table(_gather(group, meta).tolist())
    _raise_if_disagree(table)
    rank = dist.get_rank(group)
    shard = VocabShard(group=group, start=_starts(table)[rank], width=local.width,
                       vocab_size=sum(t["width"] for t in table), comm_device=device)
    if mode == "first_call":
        on_cuda = device.type == "cuda"
        _agreed.setdefault(group, {})[layout] = _Agreed(
            shard.start, shard.width, shard.vocab_size, device, meta[: len(layout)].clone(), zeros,
            torch.zeros((), dtype=torch.bool, device=device),
            torch.zeros((), dtype=torch.bool).pin_memory() if on_cuda else None, torch.cuda.Event() if on_cuda else None)
    return shard


def _agree_on_device(group: dist.ProcessGroup, local: LocalLayout, agreed: _Agreed) -> VocabShard:
    """The all-gather of an agreed layout, compared on the device (module docstring, "first_call"). While a
    CUDA graph is being captured the flag is only accumulated on the device (no event may be queried)."""
    capturing = agreed.event is not None and torch.cuda.is_current_stream_capturing()
    if agreed.event is not None and not capturing and agreed.event.query() and bool(agreed.seen):
        agreed.flag.zero_()
        agreed.seen.zero_()
        raise ValueError(
            "rl_logp: the TP ranks disagreed on an earlier vocab-parallel call (labels, per-row temperatures, "
            "or a rank's input validation failed) and its outputs were NaN; run with tp_agreement='every_call' "
            "(RL_LOGP_TP_AGREEMENT) to get the error naming the argument at the call itself"
        )
    meta = torch.cat([agreed.layout, *_per_call(local, agreed.layout.device, agreed.zeros)])
    gathered = _gather(group, meta)
    if agreed.event is None:  # a CPU group: reading the table costs no sync
        _raise_if_disagree(_table(gathered.tolist()))
        return agreed.shard(group)
    disagreement = (gathered != gathered[:1]).any()
    agreed.flag.logical_or_(disagreement)
    if not capturing:
        agreed.seen.copy_(agreed.flag, non_blocking=True)
        agreed.event.record()
    return agreed.shard(group, disagreement)


def _table(rows: list[list[int]]) -> list[dict]:
    table = []
    for row in rows:
        entry = dict(zip(FIELDS, row[: len(FIELDS)], strict=True))
        entry["message"] = _message(row[len(FIELDS) :])
        table.append(entry)
    return table


def _raise_if_disagree(table: list[dict]) -> None:
    failed = [r for r, t in enumerate(table) if t["validation_failed"]]
    if failed:
        detail = "; ".join(f"rank {r}: {table[r]['message']}" for r in failed)
        raise ValueError(f"rl_logp: input validation failed on TP rank(s) {failed} (raised on every rank): {detail}")
    problem = _layout_problem(table)
    if problem:
        raise ValueError(f"rl_logp: the TP ranks disagree: {problem} (raised on every rank of the TP group)")


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
        ("temperature_scalar", "the temperature values differ (fp32 bits); pass the same temperature"),
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
