"""What torch's custom-op wrappers cost rl-logp's ops per call on the host, before and after b0d1732.

torch's autograd wrapper of a custom op with `setup_context` (rl_logp::row_stats' forward) and the
ADInplaceOrView wrapper of a mutable one (rl_logp::grad_, the in-place backward) call
`torch._library.utils.fill_defaults(schema, args, kwargs)` at every call; it reads `schema.arguments`
(a new list of every argument) once per argument, so its time grows with the square of the argument
count. This times it (best of 5 runs of 2000 calls) for the ops' schemas as registered and for their
schemas before b0d1732 (12 and 17 arguments, rebuilt here from their text), and writes the table as JSON.

    python docs/experiments/op_defaults_cost.py --out benchmarks/results/cpu_op_fill_defaults.json
"""

import argparse
import json
import platform
import time

import torch
from torch._library.utils import fill_defaults

import rl_logp  # noqa: F401  (registers the ops)

BEFORE_REQUEST = ("Tensor? labels, Tensor? temp_rows, float t_scalar, bool entropy, str engine, int bits, "
                  "int chunk_bytes, bool inplace_backward, str group_name, int vocab_start, int vocab_size")
BEFORE_STATS = "Tensor row_max, Tensor log_sum, Tensor? entropy_out, Tensor? g_logp, Tensor? g_entropy"
BEFORE = {
    "row_stats": f"rl_logp::row_stats(Tensor x, {BEFORE_REQUEST}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "grad_": f"rl_logp::grad_(Tensor(a!) x, {BEFORE_REQUEST}, {BEFORE_STATS}) -> ()",
}


def fill_defaults_us(schema) -> float:
    args = tuple(range(len(schema.arguments)))
    for _ in range(100):
        fill_defaults(schema, args, {})
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(2000):
            fill_defaults(schema, args, {})
        runs.append((time.perf_counter() - start) / 2000 * 1e6)
    return min(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="cpu_op_fill_defaults.json")
    args = parser.parse_args()
    rows = []
    for op, before in BEFORE.items():
        for side, schema in (("before b0d1732", torch._C.parse_schema(before)),
                             ("registered", getattr(torch.ops.rl_logp, op).default._schema)):
            row = {"op": op, "schema": side, "arguments": len(schema.arguments), "fill_defaults_us": fill_defaults_us(schema)}
            rows.append(row)
            print(f"{op:10s} {side:15s} {row['arguments']:3d} arguments {row['fill_defaults_us']:7.1f} us")
    with open(args.out, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                   "python": platform.python_version(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
