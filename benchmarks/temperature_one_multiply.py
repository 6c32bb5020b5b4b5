"""Whether one fp32 multiply could replace the forward's exact temperature quotient: for each temperature T,
is there an fp32 c within `--radius` ulps of 1/T with fl(x c) == fl(x / T) (IEEE) for every significand x
of the logits' type (bf16: 128, fp16: 1024; the result depends on the significand alone away from
subnormals, as `kernels.fixed_point.row_divisor` argues)? Prints the share of temperatures where one exists
and writes the JSON (no GPU needed: numpy's fp32 arithmetic is IEEE).

    python benchmarks/temperature_one_multiply.py --out benchmarks/results/cpu_temperature_one_multiply.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def one_multiply(t: float, fraction_bits: int, radius: int) -> int | None:
    """The ulp offset from fl(1/T) of the nearest c that gives every quotient, or None."""
    t32 = np.float32(t)
    x = (1.0 + np.arange(1 << fraction_bits) / (1 << fraction_bits)).astype(np.float32)
    want = x / t32
    base = (np.float32(1) / t32).view(np.int32)
    for offset in sorted(range(-radius, radius + 1), key=abs):
        if np.array_equal(x * np.int32(base + offset).view(np.float32), want):
            return offset
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--radius", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/cpu_temperature_one_multiply.json")
    args = parser.parse_args()
    grid = [round(i / 100, 2) for i in range(5, 201)]
    uniform = np.random.default_rng(0).uniform(0.05, 2.0, 2000).astype(np.float32).tolist()
    rows = []
    for dtype, bits in (("bf16", 7), ("fp16", 10)):
        on_grid = [t for t in grid if one_multiply(t, bits, args.radius) is not None]
        drawn = sum(one_multiply(t, bits, args.radius) is not None for t in uniform)
        rows.append({"dtype": dtype, "grid_0.05_to_2.00": len(grid), "grid_with_one_multiply": len(on_grid),
                     "which": on_grid, "uniform_draws": len(uniform), "uniform_with_one_multiply": drawn,
                     "t_0.7": one_multiply(0.7, bits, args.radius) is not None})
        print(f"{dtype}: one multiply gives every quotient for {len(on_grid)}/{len(grid)} of T = 0.05..2.00 "
              f"({on_grid}), {drawn}/{len(uniform)} uniform draws in [0.05, 2]; T = 0.7: {rows[-1]['t_0.7']}")
    with open(args.out, "w") as f:
        json.dump({"radius_ulps": args.radius, "rows": rows}, f, indent=1)
    print(f"report written to {args.out}")


if __name__ == "__main__":
    main()
