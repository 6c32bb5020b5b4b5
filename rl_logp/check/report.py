"""Comparison rows, the printed table, the verdict and the JSON report of `rl_logp.check`."""

from __future__ import annotations

import dataclasses
import json
import traceback

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
    error: str = ""
    """The traceback of a provider that raised (a failure when the provider is invariant)."""

    @classmethod
    def skipped(cls, case: str, provider: str, why: str) -> Comparison:
        return cls(case, provider, 0, 0, 0.0, False, note=f"not run: {why}")

    @classmethod
    def raised(cls, case: str, provider: str, invariant: bool, error: BaseException) -> Comparison:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return cls(case, provider, 0, 0, 0.0, invariant, note=f"raised {type(error).__name__}: {error}", error=text)

    @property
    def failed(self) -> bool:
        return self.invariant and (self.differing > 0 or bool(self.error))


def compare(case: str, provider: str, out: torch.Tensor, reference: torch.Tensor, invariant: bool) -> Comparison:
    a = out.float().contiguous().view(torch.int32)
    b = reference.float().contiguous().view(torch.int32)
    diff = (out.double() - reference.double()).abs()
    return Comparison(
        case, provider, int(out.numel()), int((a != b).sum()), float(diff.max()) if diff.numel() else 0.0, invariant
    )


def render(results: list[Comparison], header: list[str], error: str = "") -> str:
    """The table, each failure with its traceback or its count of differing rows, and the verdict."""
    lines = [*header, ""]
    lines.append(f"{'case':28s} {'provider':34s} {'rows':>6s} {'differ':>7s} {'max |diff|':>11s}  kind")
    for r in results:
        kind = "invariant" if r.invariant else "diagnostic"
        flag = "  FAIL" if r.failed else ""
        if r.note:
            lines.append(f"{r.case:28s} {r.provider:34s} {'':>6s} {'':>7s} {'':>11s}  {r.note[:70]}{flag}")
            continue
        lines.append(f"{r.case:28s} {r.provider:34s} {r.rows:6d} {r.differing:7d} {r.max_abs_diff:11.3e}  {kind}{flag}")
    failures = [r for r in results if r.failed]
    pairs = sum(1 for r in results if r.invariant and (not r.note or r.error))
    if error:
        lines.append(f"\nThe run raised before it finished:\n{error.rstrip()}")
    if failures:
        lines.append("\nFAILURES")
        for r in failures:
            what = r.error.rstrip() if r.error else f"{r.differing} of {r.rows} rows differ (max |diff| {r.max_abs_diff:.3e})"
            lines.append(f"--- {r.case} / {r.provider}:\n{what}")
        lines.append(f"\nVERDICT: FAIL - {len(failures)} of {pairs} invariant comparisons differ or raised")
    elif error:
        lines.append("\nVERDICT: FAIL - the run raised (above)")
    else:
        lines.append(f"\nVERDICT: PASS - all {pairs} invariant comparisons are bit-identical")
    return "\n".join(lines)


def write_json(path: str, results: list[Comparison], meta: dict, error: str = "") -> None:
    """The report: `passed` is false when an invariant comparison failed or the run itself raised (`error`)."""
    with open(path, "w") as f:
        json.dump({**meta, "passed": not error and not any(r.failed for r in results), "error": error,
                   "comparisons": [dataclasses.asdict(r) for r in results]}, f, indent=1)
