"""Comparison rows, the printed table, the verdict and the JSON report of `rl_logp.check`."""

from __future__ import annotations

import dataclasses
import json

import torch


@dataclasses.dataclass
class Comparison:
    case: str
    provider: str
    rows: int
    differing: int
    max_abs_diff: float
    invariant: bool
    note: str = ""

    @classmethod
    def skipped(cls, case: str, provider: str, why: str) -> Comparison:
        return cls(case, provider, 0, 0, 0.0, False, note=f"not run: {why}")

    @property
    def failed(self) -> bool:
        return self.invariant and self.differing > 0


def compare(case: str, provider: str, out: torch.Tensor, reference: torch.Tensor, invariant: bool) -> Comparison:
    a = out.float().contiguous().view(torch.int32)
    b = reference.float().contiguous().view(torch.int32)
    diff = (out.double() - reference.double()).abs()
    return Comparison(
        case, provider, int(out.numel()), int((a != b).sum()), float(diff.max()) if diff.numel() else 0.0, invariant
    )


def render(results: list[Comparison], header: list[str]) -> str:
    lines = [*header, ""]
    lines.append(f"{'case':28s} {'provider':34s} {'rows':>6s} {'differ':>7s} {'max |diff|':>11s}  kind")
    for r in results:
        kind = "invariant" if r.invariant else "diagnostic"
        if r.note:
            lines.append(f"{r.case:28s} {r.provider:34s} {'':>6s} {'':>7s} {'':>11s}  {r.note[:70]}")
            continue
        flag = "  FAIL" if r.failed else ""
        lines.append(f"{r.case:28s} {r.provider:34s} {r.rows:6d} {r.differing:7d} {r.max_abs_diff:11.3e}  {kind}{flag}")
    failures = [r for r in results if r.failed]
    pairs = sum(1 for r in results if r.invariant and not r.note)
    if failures:
        lines.append(f"\nVERDICT: FAIL - {len(failures)} of {pairs} invariant comparisons have differing rows")
    else:
        lines.append(f"\nVERDICT: PASS - all {pairs} invariant comparisons are bit-identical")
    return "\n".join(lines)


def write_json(path: str, results: list[Comparison], meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({**meta, "passed": not any(r.failed for r in results),
                   "comparisons": [dataclasses.asdict(r) for r in results]}, f, indent=1)
