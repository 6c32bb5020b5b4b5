"""Compile the fused kernels for sm_90 without a GPU and report registers, spills and the SASS mix.

Triton's wheel carries ptxas and nvdisasm, so this runs on any x86-64 machine: it is how the launch
parameters were chosen before spending device time. For each configuration it prints registers per
thread, spill bytes, the programs one SM can hold (by registers and warps), and the SASS instructions
per logit (the static instructions of the kernel, times the threads, over the logits of one tile: the
loop bodies run once per tile, so this counts the per-row code, which runs once per row, as if it ran
per tile: an upper bound that orders the variants).

    python benchmarks/kernel_resources.py
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rl_logp.kernels import fixed_point, grad, row_stats
from rl_logp.kernels.fixed_point import split_constants

TARGET = GPUTarget("cuda", 90, 32)
DIV16 = [["tt.divisibility", 16]]


def compile_kernel(fn, signature: dict, constexprs: dict, warps: int, divisible: list[str]):
    names = fn.arg_names
    attrs = {(names.index(a),): DIV16 for a in divisible}
    sig = dict(signature)
    for k in constexprs:
        sig[k] = "constexpr"
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps, "enable_fp_fusion": False})


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _run_on_cubin(kernel, *command: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([*command, f.name], capture_output=True, text=True, check=True).stdout


def registers(kernel) -> tuple[int, int]:
    """(registers per thread, local-memory bytes per thread) from cuobjdump's resource report."""
    text = _run_on_cubin(kernel, _tool("cuobjdump"), "-res-usage")
    return int(re.search(r"REG:(\d+)", text).group(1)), int(re.search(r"LOCAL:(\d+)", text).group(1))


def sass_mix(kernel) -> collections.Counter:
    text = _run_on_cubin(kernel, _tool("nvdisasm"), "-c")
    ops = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(2)] += 1
    return ops


def programs_per_sm(regs: int, warps: int) -> int:
    regs_per_warp = ((max(regs, 1) * 32 + 255) // 256) * 256
    return min(65536 // (regs_per_warp * warps), 64 // warps, 32)


def forward(chunk: int, lane: int, warps: int, quant: int, entropy: bool, temp_mode: int, div: int = 0,
            dtype: str = "bf16"):
    """The whole-row forward kernel, finishing rows (logp, lse, M, L and, with `entropy`, the entropy)."""
    sig = {
        "X": f"*{dtype}", "stride_x": "i32", "LABELS": "*i64", "t_scalar": "fp32", "OUT_MAX": "*fp32",
        "OUT_LOGSUM": "*fp32", "OUT_LSE": "*fp32", "OUT_LOGP": "*fp32", "OUT_ENT": "*fp32", "n_rows": "i32",
        "n_cols": "i32", "q_scale": "fp32", "log_scale": "fp32",
    }
    const = {
        "TEMP": None, "MAX_IN": None, "OUT_S": None, "OUT_E": None, "MAX_FROM": row_stats.MAX_SCAN.value,
        "RESULT": row_stats.RESULT_ROW.value, "TEMP_MODE": temp_mode, "DIV": div, "ENTROPY": entropy,
        "CHUNK": chunk, "LANE": lane, "QUANT": quant,
        **dict(zip(("HI_BIAS", "LO_BIAS", "LO_BITS", "HI_PATTERN", "LO_PATTERN"), split_constants(40), strict=True)),
    }
    if temp_mode == fixed_point.TEMP_ROWS.value:
        del const["TEMP"]
        sig["TEMP"] = "*fp32"
    if not entropy:
        const["OUT_ENT"] = None
        del sig["OUT_ENT"]
    return compile_kernel(row_stats.row_stats_kernel, sig, const, warps, ["X", "stride_x", "n_cols"])


def backward(block: int, warps: int, entropy: bool, temp_mode: int, div: int = 0):
    sig = {
        "X": "*bf16", "stride_x": "i32", "DX": "*bf16", "stride_dx": "i32", "LABELS": "*i64",
        "label_offset": "i32", "vocab_total": "i32", "t_scalar": "fp32", "ROW_MAX": "*fp32",
        "LOG_SUM": "*fp32", "ENT": "*fp32", "G_LP": "*fp32", "stride_g_lp": "i32", "G_H": "*fp32",
        "stride_g_h": "i32", "n_cols": "i32",
    }
    const = {"TEMP": None, "TEMP_MODE": temp_mode, "DIV": div, "LOGP": True, "ENTROPY": entropy, "BLOCK": block}
    return compile_kernel(grad.grad_kernel, sig, const, warps, ["X", "DX", "stride_x", "stride_dx", "n_cols"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--show", action="store_true", help="print the full SASS mix of each kernel")
    parser.add_argument("--quick", action="store_true", help="only the first configuration of each kernel")
    args = parser.parse_args()
    print(f"{'kernel':58s} {'regs':>4s} {'spill':>5s} {'prog/SM':>7s} {'SASS/logit':>10s} {'MUFU':>5s} {'F2I':>4s}")
    rows = []
    fp = fixed_point
    modes = ((fp.TEMP_NONE.value, 0), (fp.TEMP_SCALAR.value, fp.DIV_IEEE.value),
             (fp.TEMP_SCALAR.value, fp.DIV_RECIPROCAL.value))
    configs = [(4096, 1, 8), (4096, 8, 8), (8192, 8, 8), (2048, 8, 4)]
    for chunk, lane, warps in configs[: 1 if args.quick else None]:
        for quant in (fp.QUANT_SPLIT.value, fp.QUANT_CAST.value):
            for entropy in (False, True):
                for temp, div in modes:
                    name = f"fwd chunk={chunk} lane={lane} w={warps} q={quant} ent={int(entropy)} T={temp} div={div}"
                    rows.append((name, forward(chunk, lane, warps, quant, entropy, temp, div), chunk, warps))
    for block, warps in [(4096, 8), (8192, 16), (2048, 4)][: 1 if args.quick else None]:
        for entropy in (False, True):
            for temp, div in modes:
                rows.append((f"bwd block={block} w={warps} ent={int(entropy)} T={temp} div={div}",
                             backward(block, warps, entropy, temp, div), block, warps))
    for name, k, elems, warps in rows:
        mix = sass_mix(k)
        regs, local = registers(k)
        per_logit = 32 * warps / elems  # each thread runs a loop body once per tile of `elems` logits
        print(f"{name:58s} {regs:4d} {local:5d} {programs_per_sm(regs, warps):7d} "
              f"{sum(mix.values()) * per_logit:10.2f} {mix['MUFU'] * per_logit:5.2f} {mix['F2I'] * per_logit:4.2f}")
        if args.show:
            print("   ", dict(mix.most_common(25)))


if __name__ == "__main__":
    main()
