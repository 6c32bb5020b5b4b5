"""Plot forward+backward time over the HBM floor per provider and N from a bench_logp.py JSON.

    python benchmarks/plot_bench.py benchmarks/results/h200_bench.json docs/h200_fwd_bwd.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(src: str, dst: str) -> None:
    report = json.load(open(src))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=False)
    for ax, key, title in zip(axes, ["forward_ms", "backward_ms", "fwd_bwd_ms"],
                              ["forward", "backward", "forward + backward"], strict=True):
        by_provider: dict[str, list[tuple[int, float]]] = {}
        for r in report["results"]:
            if "error" not in r and r["provider"] != "chunked":
                by_provider.setdefault(r["provider"], []).append((r["rows"], r[key] / r["floor"][key]))
        for name, points in sorted(by_provider.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.1, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows N (V=151936, bf16)")
        ax.set_title(f"{title}: time / HBM floor")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{report['device']}, copy {report['copy_bandwidth_Bps'] / 1e12:.2f} TB/s (dashed: 1.10x target)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
