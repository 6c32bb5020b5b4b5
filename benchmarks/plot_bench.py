"""Plot time over the HBM floor per suite and provider from a bench_logp.py JSON (largest N).

    python benchmarks/plot_bench.py benchmarks/results/h200_bench.json docs/h200_fwd_bwd.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SUITES = ["logp", "logp T=0.7", "entropy", "entropy T=0.7", "logp+entropy", "logp+entropy T=0.7"]


def main(src: str, dst: str) -> None:
    with open(src) as f:
        report = json.load(f)
    rows = [r for r in report["results"] if r.get("suite") in SUITES and "error" not in r]
    n = max(r["rows"] for r in rows)
    rows = [r for r in rows if r["rows"] == n and r["provider"] != "chunked"]
    providers = sorted({r["provider"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), sharey=True)
    width = 0.8 / len(providers)
    targets = {"forward_ms": 2.0, "fwd_bwd_ms": 1.4}  # the kernel issue's targets over the floor
    for ax, key, title in zip(axes, ["forward_ms", "fwd_bwd_ms"], ["forward", "forward + backward"], strict=True):
        for i, provider in enumerate(providers):
            xs, ys = [], []
            for j, suite in enumerate(SUITES):
                for r in rows:
                    if r["suite"] == suite and r["provider"] == provider:
                        xs.append(j + i * width)
                        ys.append(r[key] / r["floor"][key])
            ax.bar(xs, ys, width=width, label=provider)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(targets[key], color="grey", linestyle="--", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(SUITES))], SUITES, rotation=20, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"{title}: time / HBM floor, N={n} x V={rows[0]['vocab']} bf16")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{report['device']}, copy {report['copy_bandwidth_Bps'] / 1e12:.2f} TB/s (dashed: target, 2.0x forward, 1.4x both)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
