"""Where a kernel's instructions and warp stalls go, from Nsight Compute's SASS page as CSV
(`ncu --import R.ncu-rep --page source --print-source sass --csv`, which `device_run.sh`'s ncu stage writes
as `ncu_<case>_sass.csv`; the report must hold the SourceCounters section).

For the first kernel whose name contains --kernel it prints: the warp instructions executed and the stall
samples; each stall reason's share of the samples; the instructions grouped by how often each ran (a loop's
body shares one count, so each group is a loop or a once-per-row stretch) with their share of the executed
instructions and of the samples; and the --top instructions by samples with their main stall reasons.

    python benchmarks/ncu_sass_summary.py ncu_t1_entropy_sass.csv --kernel cluster_row_stats --top 25
"""

from __future__ import annotations

import argparse
import collections
import csv
import pathlib


def kernel_rows(path: pathlib.Path, name: str) -> tuple[list[str], list[list[str]]]:
    """The header and the instruction rows of the first kernel whose name contains `name`."""
    header: list[str] = []
    rows: list[list[str]] = []
    current = None
    with path.open(newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                if rows:
                    break
                current = name in row[1]
            elif row[0] == "Address":
                header = row
            elif current and len(row) == len(header):
                rows.append(row)
    if not rows:
        raise SystemExit(f"{path}: no kernel named like {name!r} with SASS rows (was SourceCounters collected?)")
    return header, rows


def number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=pathlib.Path)
    parser.add_argument("--kernel", default="cluster_row_stats")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    header, rows = kernel_rows(args.csv, args.kernel)
    col = {name: i for i, name in enumerate(header)}
    executed, samples = col["Instructions Executed"], col["Warp Stall Sampling (All Samples)"]
    reasons = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    total_executed = sum(number(r[executed]) for r in rows)
    total_samples = sum(number(r[samples]) for r in rows) or 1.0
    print(f"{args.kernel}: {len(rows)} SASS instructions, {total_executed:.0f} warp instructions executed, "
          f"{total_samples:.0f} stall samples")
    by_reason = collections.Counter({n[len("stall_"):]: sum(number(r[col[n]]) for r in rows) for n in reasons})
    print("stall samples by reason: " + ", ".join(f"{n} {v / total_samples:.1%}" for n, v in by_reason.most_common(8)))
    groups: dict[float, list[list[str]]] = collections.defaultdict(list)
    for r in rows:
        groups[number(r[executed])].append(r)
    print(f"\n{'runs each':>12s} {'instructions':>12s} {'executed':>9s} {'samples':>8s}")
    for count, group in sorted(groups.items(), key=lambda kv: -kv[0] * len(kv[1]))[:10]:
        share = sum(number(r[samples]) for r in group) / total_samples
        print(f"{count:12.0f} {len(group):12d} {count * len(group) / total_executed:9.1%} {share:8.1%}")
    print(f"\n{'address':>8s} {'instruction':60s} {'runs':>10s} {'samples':>8s}  main stalls")
    for r in sorted(rows, key=lambda r: -number(r[samples]))[:args.top]:
        main_stalls = sorted(((number(r[col[n]]), n[len("stall_"):]) for n in reasons), reverse=True)[:2]
        print(f"{int(r[0], 16) & 0xffff:8x} {r[1][:60]:60s} {number(r[executed]):10.0f} {number(r[samples]):8.0f}  "
              + ", ".join(f"{n} {v:.0f}" for v, n in main_stalls if v))


if __name__ == "__main__":
    main()
