"""Compile the fused kernels for sm_90 without a GPU; report registers, spills and SASS per logit.

Triton's wheel carries ptxas and nvdisasm, so this runs on any x86-64 machine: it is how launch
parameters and kernel changes are weighed before spending device time. Each kernel is specialised the
way a launch specialises it (`kernels.launch`'s argument builders, Triton's own binder, the default
`LaunchConfig` unless flags say otherwise), for a [rows, V] call as `rl_logp.logprobs` makes it with its
normaliser (M, L, lse, logp; with entropy also H).

For the forward it prints, per variant, registers and spill bytes per thread, the programs one SM can
hold, and the SASS instructions per logit of its hot loops: the max scan, the sums, and the sums of a
row that divides by `div_rn` (a separate loop). A loop is the code between a predicated backward branch
and its target; its count is the shortest path through it from the target to that branch (the common
case: a skipped slow-path call counts nothing), divided by the logits one thread loads on that path.
`--show` adds the opcode mix of each loop's path; `--maxnreg`, `--chunk`, `--lane`, `--warps` try launch
variants. With `--backward`, the backward kernel (one tile per program) gets the whole kernel's static count
per logit, its lean path's (the shortest path from its first instruction through the full tile's store to
an EXIT, over the logits it loads) and its general path's (the sub-tile loop, as a hot loop). With
`--cluster`, the cluster forward (`kernels/cluster_row_stats.cu`, compiled by NVRTC, which needs no GPU
either) gets registers, spills and the SASS per logit of each loop over its shared-memory slice. With `--kept-set`, the
rollout's kept-set launches (both plans, top-k / top-p / both, with and without a write and a draw; fp32
[rows, V]) get registers and spills, and each hot loop (one pass over a row or range) its SASS
instructions per element; with `--sampled-rank`, so does vLLM V1's gather kernel (`kernels.sampled_rank`).

    python benchmarks/kernel_resources.py [--dtype bf16] [--vocab 151936] [--show] [--backward] [--kept-set]
                                          [--cluster] [--sampled-rank]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from rl_logp.kernels import fixed_point, grad, kept_set, launch, row_stats, sampled_rank

TARGET = GPUTarget("cuda", 90, 32)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LOAD_BYTES = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}


def compile_launch(fn, args: tuple, options: dict):
    """The kernel `fn[grid](*args, **options)` would compile on an sm_90 GPU (same specialisation)."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, parsed = binder(*args, **options)
    parsed, signature, constexprs, attrs = fn._pack_args(backend, options, bound, specialization, parsed)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=parsed.__dict__)


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


def programs_per_sm(regs: int, warps: int) -> int:
    regs_per_warp = ((max(regs, 1) * 32 + 255) // 256) * 256
    return min(65536 // (regs_per_warp * warps), 64 // warps, 32)


@dataclasses.dataclass
class Instr:
    address: int
    opcode: str
    guarded: bool  # predicated: a branch may fall through
    target: str | None  # a branch's label


INSTR = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")
LABEL = re.compile(r"^(\.L_x_\d+):")


def sass(kernel) -> tuple[list[Instr], dict[str, int]]:
    """The kernel's instructions (index order) and the instruction index of each label."""
    instrs, labels = [], {}
    for line in _run_on_cubin(kernel, _tool("nvdisasm"), "-c").splitlines():
        label = LABEL.match(line)
        if label:
            labels[label.group(1)] = len(instrs)
            continue
        m = INSTR.match(line)
        if m:
            target = re.search(r"`\((\.L_x_\d+)\)", m.group(4)) if m.group(3).startswith("BRA") else None
            instrs.append(Instr(int(m.group(1), 16), m.group(3), m.group(2) is not None,
                                target.group(1) if target else None))
    return instrs, labels


def hot_loops(instrs: list[Instr], labels: dict[str, int], load: str = "LDG") -> list[tuple[int, int]]:
    """(first, last) instruction indices of each innermost loop that loads from global memory (`load`
    "LDS": from shared memory)."""
    # A back edge is any branch to an earlier label: predicated (a loop tested at its foot) or not (tested at
    # its head, as the backward's sub-tile loop is). A jump back from out-of-line code would count as well;
    # none does in these kernels (the forward's and kept set's counts are the same as with predicated ones).
    loops = [(labels[ins.target], i) for i, ins in enumerate(instrs)
             if ins.target and labels[ins.target] <= i]
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return [(a, b) for a, b in inner if any(ins.opcode.startswith(load) for ins in instrs[a:b + 1])]


def shortest_path(instrs: list[Instr], labels: dict[str, int], first: int, last: int,
                  bounded: bool = True) -> list[Instr]:
    """The fewest instructions from `first` to `last` (a loop's back-edge branch): within the loop, or
    anywhere in the kernel (`bounded` False); [] where `last` cannot be reached."""
    best, queue, came = {first: 1}, [(1, first)], {}
    while queue:
        cost, i = heapq.heappop(queue)
        if i == last:
            break
        if cost > best[i]:
            continue
        ins = instrs[i]
        nexts = []
        if ins.target is not None:
            nexts.append(labels[ins.target])
        # Only an unpredicated plain BRA or EXIT never falls through (BRA.DIV branches on divergence).
        if ins.guarded or ins.opcode not in ("BRA", "EXIT"):
            nexts.append(i + 1)
        for j in nexts:
            if (not bounded or first <= j <= last) and cost + 1 < best.get(j, 1 << 30):
                best[j], came[j] = cost + 1, i
                heapq.heappush(queue, (cost + 1, j))
    if last not in best:
        return []
    path, i = [], last
    while True:
        path.append(instrs[i])
        if i == first:
            return path[::-1]
        i = came[i]


def tile_path(instrs: list[Instr], labels: dict[str, int]) -> list[Instr]:
    """The shortest path from a kernel's first instruction through its first global store outside every hot
    loop to an EXIT: a kernel's straight-line tile (the backward's lean path)."""
    in_loops = {i for first, last in hot_loops(instrs, labels) for i in range(first, last + 1)}
    store = next(i for i, ins in enumerate(instrs) if ins.opcode.startswith("STG") and i not in in_loops)
    exits = [i for i, ins in enumerate(instrs) if ins.opcode == "EXIT"]
    tail = min(filter(None, (shortest_path(instrs, labels, store, e, bounded=False) for e in exits)), key=len)
    return shortest_path(instrs, labels, 0, store, bounded=False) + tail[1:]


def loaded_bytes(path: list[Instr], load: str = "LDG") -> int:
    total = 0
    for ins in path:
        if ins.opcode.startswith(load):
            width = [LOAD_BYTES[p] for p in ins.opcode.split(".")[1:] if p in LOAD_BYTES]
            total += width[0] if width else 4
    return total


def loop_paths(kernel, element_bytes: int, load: str = "LDG") -> list[tuple[int, list[Instr], float]]:
    """(address, common path, SASS instructions per element of `element_bytes`) of each hot loop of a
    kernel (loops loading with `load`), in code order: the loop's shortest path from its first instruction
    to its back edge, over the elements one thread loads on that path."""
    instrs, labels = sass(kernel)
    paths = []
    for first, last in hot_loops(instrs, labels, load):
        path = shortest_path(instrs, labels, first, last)
        if loaded_bytes(path, load):  # a loop whose common path loads nothing is not a pass over the data
            paths.append((instrs[first].address, path, len(path) * element_bytes / loaded_bytes(path, load)))
    return paths


def loop_costs(kernel, element_bytes: int) -> dict[str, tuple[float, collections.Counter]]:
    """{'max': ..., 'sums': ..., 'sums div_rn': ...}: SASS instructions per logit of each kind of hot loop
    (the cheapest loop of a kind: an unrolled loop's remainder loop is a second one) and its opcode mix."""
    out = {}
    for address, path, cost in loop_paths(kernel, element_bytes):
        ops = collections.Counter(ins.opcode.split(".")[0] for ins in path)
        mufu = {ins.opcode.split(".")[1] for ins in path if ins.opcode.startswith("MUFU.")}
        if "EX2" in mufu:
            name = "sums div_rn" if "RCP" in mufu else "sums"
        else:
            name = "max" if any("MNMX" in op for op in ops) else f"loop@{address:x}"
        if name not in out or cost < out[name][0]:  # an unrolled loop beside its remainder: the main one
            out[name] = (cost, ops)
    return out


LOOP_FEATURES = (("max", "FMNMX"), ("histogram", "POPC"), ("exp", "MUFU.EX2"), ("log", "MUFU.LG2"), ("scan", "SHFL"),
                 ("store", "STG"))


def element_loops(kernel) -> list[tuple[str, float]]:
    """(what, SASS instructions per fp32 element of its common path) of each hot loop of a kernel, in code
    order; what: the features its path holds (max, histogram, exp, log, scan, store; "load" for none)."""
    return [("+".join(name for name, op in LOOP_FEATURES if any(ins.opcode.startswith(op) for ins in path)) or "load",
             cost) for _, path, cost in loop_paths(kernel, 4)]

@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    temp_mode: int
    entropy: bool


VARIANTS = [
    Variant("T=1", fixed_point.TEMP_NONE.value, False),
    Variant("T=0.7", fixed_point.TEMP_SCALAR.value, False),
    Variant("T rows", fixed_point.TEMP_ROWS.value, False),
    Variant("T=1 +entropy", fixed_point.TEMP_NONE.value, True),
    Variant("T=0.7 +entropy", fixed_point.TEMP_SCALAR.value, True),
    Variant("T rows +entropy", fixed_point.TEMP_ROWS.value, True),
]


def forward(variant: Variant, cfg: launch.LaunchConfig, vocab: int, dtype: torch.dtype, maxnreg: int | None = None):
    """The row_stats_kernel of one `rl_logp.logprobs` call (normaliser kept, one label per row)."""
    n = 2
    x = torch.empty(n, vocab, dtype=dtype)
    out = lambda: torch.empty(n)  # noqa: E731
    rows = torch.ones(n) if variant.temp_mode == fixed_point.TEMP_ROWS.value else None
    outs = (out(), out(), out(), out(), out() if variant.entropy else None)
    _, args, options = launch.forward_launch(
        x, torch.zeros(n, dtype=torch.int64), variant.temp_mode, rows, 0.7, None, outs, (None, None), 40,
        variant.entropy, row_stats.MAX_SCAN.value, row_stats.RESULT_ROW.value, cfg)
    if maxnreg is not None:
        options = {**options, "maxnreg": maxnreg}
    return compile_launch(row_stats.row_stats_kernel, args, options)


def backward(variant: Variant, cfg: launch.LaunchConfig, vocab: int, dtype: torch.dtype):
    n = 2
    x = torch.empty(n, vocab, dtype=dtype)
    row = lambda: torch.empty(n)  # noqa: E731
    rows = torch.ones(n) if variant.temp_mode == fixed_point.TEMP_ROWS.value else None
    args = (x, x.stride(0), x, x.stride(0), torch.zeros(n, dtype=torch.int64), 0, vocab, rows, 0.7, row(), row(),
            row() if variant.entropy else None, row(), 1, row() if variant.entropy else None, 1, vocab)
    options = {"TEMP_MODE": variant.temp_mode, "DIV": cfg.div, "LOGP": True, "ENTROPY": variant.entropy,
               "BLOCK": cfg.grad_block, "SUB": launch.grad_sub(cfg), "num_warps": cfg.grad_warps, "enable_fp_fusion": False,
               "enable_reflect_ftz": cfg.ftz}
    return compile_launch(grad.grad_kernel, args, options)


def kept_set_calls(vocab: int, which: tuple[str, ...] = ("k", "p", "kp", "-")):
    """(name, kernel, arguments, options) of each launch `kept_set` makes, per plan (one row: the split
    plan; 512 rows: the fused one), parameters (`which`: k, p, both; "-" neither, with a draw only) and mode
    (write, threshold, draw)."""
    cfg = kept_set.KeptSetLaunch()
    options = launch.launch_options(cfg.warps, False, cfg.max_registers)
    for n in (1, 512):
        z = torch.empty(n, vocab)
        split = kept_set.split_count(z, dataclasses.replace(cfg, split=32) if n == 1 else cfg)
        workspace = torch.empty(kept_set._workspace_shape(z, split, cfg), dtype=torch.int32)
        for given in which:
            k = torch.empty(n, dtype=torch.int32) if "k" in given else None
            p = torch.empty(n) if "p" in given else None
            for mode in ("write", "threshold", "draw"):
                if given == "-" and mode != "draw":
                    continue
                draw = (torch.empty(n, vocab), torch.empty(n, dtype=torch.int64)) if mode == "draw" else None
                threshold = None if mode == "draw" else torch.empty(n)
                launches = kept_set._launches(z, k, p, 40, threshold, workspace, mode == "write", draw, split, cfg)
                for phase, (launcher, _, args) in enumerate(launches):
                    name = f"{'split' if split > 1 else 'fused'} {given} {mode}" + (f" #{phase + 1}" if split > 1 else "")
                    yield name, launcher.kernel, args, options


def compiled(calls):
    """(name, compiled kernel) of each (name, kernel, arguments, options) of `calls`."""
    for name, kernel, args, options in calls:
        yield name, compile_launch(kernel, args, options)


def kept_set_launches(vocab: int, which: tuple[str, ...] = ("k", "p", "kp", "-")):
    """(name, compiled kernel) of each of `kept_set_calls`."""
    return compiled(kept_set_calls(vocab, which))


def sampled_rank_calls(vocab: int):
    """(name, kernel, arguments, options) of `kernels.sampled_rank`'s launch (vLLM V1's patched
    `gather_logprobs`) for 8 rows of fp32 logprobs, with no top-n and with 20."""
    n = 8
    logprobs, tokens, rank = torch.empty(n, vocab), torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    for top in (0, 20):
        given = (torch.empty(n, top), torch.empty(n, top, dtype=torch.int64)) if top else (None, None)
        outs = (torch.empty(n, top + 1, dtype=torch.int32), torch.empty(n, top + 1), rank)
        _, args, options = sampled_rank._launch(logprobs, tokens, *given, *outs)
        yield f"sampled rank n={top}", sampled_rank.sampled_rank_kernel, args, options


def print_element_loops(launches) -> None:
    """A line per (name, compiled kernel): registers and spill bytes per thread, then each hot loop's
    features and SASS instructions per fp32 element (`element_loops`)."""
    for name, kernel in launches:
        regs, local = registers(kernel)
        loops = "  ".join(f"{what} {cost:.1f}" for what, cost in element_loops(kernel))
        print(f"{name:24s} {regs:4d} {local:5d}  {loops}")


def cluster_report(vocab: int, dtype: torch.dtype, cfg: launch.LaunchConfig, show: bool) -> None:
    """Registers, spills and SASS per logit of each smem loop (max scan; sums: one loop per division) of the
    cluster forward's variants, compiled by NVRTC for sm_90."""
    import types

    from rl_logp.kernels import cluster_launch, cuda_source

    cluster, width = cluster_launch.cluster_width(vocab, dtype.itemsize, cfg.cluster_slice_bytes)
    print(f"\ncluster forward, {cluster} blocks of {width} columns, {cfg.cluster_threads} threads: registers, spill "
          "bytes, SASS per logit of each loop over the slice, in code order: max (the max scan), sums (an exp on its "
          "path), write (a store: every column's logprob); an unrolled loop's remainder and each division's loop "
          "(pair, reciprocal, div_rn) apart")
    for variant in VARIANTS:
        if variant.temp_mode == fixed_point.TEMP_ROWS.value:
            continue
        options = cluster_launch.variant_options(cluster_launch.ELEMENT_CODES[dtype], cluster, variant.entropy,
                                                 variant.temp_mode != fixed_point.TEMP_NONE.value, cfg.cluster_threads,
                                                 width * dtype.itemsize, cfg.cluster_wait_ns)
        kernel = types.SimpleNamespace(asm={"cubin": cuda_source.compile_cubin(
            cluster_launch.SOURCE.read_text(), cluster_launch.KERNEL, "sm_90", options)})
        regs, local = registers(kernel)
        paths = loop_paths(kernel, dtype.itemsize, "LDS")
        kinds = [("sums" if any(i.opcode.startswith("MUFU.EX2") for i in path) else
                  "write" if any(i.opcode.startswith("ST") for i in path) else "max") for _, path, _ in paths]
        print(f"{variant.name:16s} {regs:4d} {local:5d}  " + "  ".join(
            f"{kind} {cost:.2f}" for kind, (_, _, cost) in zip(kinds, paths, strict=True)))
        if show:
            for _, path, _ in paths:
                print(f"    {dict(collections.Counter(ins.opcode.split('.')[0] for ins in path).most_common())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--show", action="store_true", help="print the opcode mix of each hot loop's path")
    parser.add_argument("--backward", action="store_true", help="also the backward kernel")
    parser.add_argument("--cluster", action="store_true", help="also the cluster forward (CUDA C++, NVRTC)")
    parser.add_argument("--kept-set", action="store_true", help="also the kept-set kernels (registers, spills, SASS per element)")
    parser.add_argument("--sampled-rank", action="store_true",
                        help="also vLLM V1's gather kernel (registers, spills, SASS per element)")
    parser.add_argument("--maxnreg", type=int, help="cap the forward's registers per thread (ptxas .maxnreg)")
    fields = ("chunk", "lane", "warps", "cluster_threads")
    for field in fields:
        parser.add_argument(f"--{field.replace('_', '-')}", type=int,
                            help=f"LaunchConfig.{field} (default: LaunchConfig's)")
    args = parser.parse_args()
    cfg = launch.LaunchConfig()
    cfg = dataclasses.replace(cfg, **{f: getattr(args, f) for f in fields if getattr(args, f)})
    dtype = DTYPES[args.dtype]
    quant = launch._quant(args.vocab, 40, cfg.chunk, cfg.lane, cfg.quant)
    print(f"forward, {args.dtype} x {args.vocab}: chunk {cfg.chunk}, lane {cfg.lane}, warps {cfg.warps}, "
          f"quant {'split' if quant == fixed_point.QUANT_SPLIT.value else 'cast'}, "
          f"div {'reciprocal' if cfg.div == fixed_point.DIV_RECIPROCAL.value else 'ieee'}"
          + (f", maxnreg {args.maxnreg}" if args.maxnreg else ""))
    print("SASS instructions per logit of each hot loop's common path; 'div_rn rows': the sums loop of rows that"
          "\ndivide per element (a row whose T or max is out of the reciprocal's range, or whose T fails the pair"
          " check)")
    print(f"{'variant':16s} {'regs':>4s} {'spill':>5s} {'prog/SM':>7s} {'max scan':>8s} {'sums':>6s} {'total':>6s} "
          f"{'div_rn rows':>11s}")
    for variant in VARIANTS:
        kernel = forward(variant, cfg, args.vocab, dtype, args.maxnreg)
        regs, local = registers(kernel)
        loops = loop_costs(kernel, dtype.itemsize)
        scan = loops["max"][0]
        sums = loops["sums"][0] if "sums" in loops else loops["sums div_rn"][0]
        divided = f"{loops['sums div_rn'][0]:11.2f}" if "sums div_rn" in loops and "sums" in loops else f"{'':11s}"
        print(f"{variant.name:16s} {regs:4d} {local:5d} {programs_per_sm(regs, cfg.warps):7d} {scan:8.2f} {sums:6.2f} "
              f"{scan + sums:6.2f} {divided}")
        if args.show:
            for name, (_, ops) in loops.items():
                print(f"    {name}: {dict(ops.most_common())}")
    if args.backward:
        print(f"\nbackward, block {cfg.grad_block}, warps {cfg.grad_warps}: registers, spill bytes, and SASS per logit:"
              f" the whole kernel (static), its lean path (a full tile, {cfg.grad_block // (32 * cfg.grad_warps)} "
              f"logits per thread), its general path (the sub-tile loop, {launch.grad_sub(cfg) // (32 * cfg.grad_warps)}"
              " per thread; div_rn rows also take it)")
        print(f"{'variant':16s} {'regs':>4s} {'spill':>5s} {'static':>7s} {'lean':>6s} {'general':>7s}")
        for variant in VARIANTS:
            kernel = backward(variant, cfg, args.vocab, dtype)
            regs, local = registers(kernel)
            instrs, labels = sass(kernel)
            lean = tile_path(instrs, labels)
            general = min(cost for _, _, cost in loop_paths(kernel, dtype.itemsize))
            print(f"{variant.name:16s} {regs:4d} {local:5d} {len(instrs) * 32 * cfg.grad_warps / cfg.grad_block:7.2f} "
                  f"{len(lean) * dtype.itemsize / loaded_bytes(lean):6.2f} {general:7.2f}")
            if args.show:
                print(f"    lean: {dict(collections.Counter(ins.opcode.split('.')[0] for ins in lean).most_common())}")
    if args.cluster:
        cluster_report(args.vocab, dtype, cfg, args.show)
    if args.kept_set:
        print(f"\nkept set, fp32 x {args.vocab}: registers and spill bytes per thread of each launch, and the SASS"
              " instructions per element of each hot loop's common path (its features), in code order")
        print_element_loops(kept_set_launches(args.vocab))
    if args.sampled_rank:
        print(f"\nsampled rank, fp32 x {args.vocab}: registers and spill bytes per thread, SASS per element of its loop")
        print_element_loops(compiled(sampled_rank_calls(args.vocab)))


if __name__ == "__main__":
    main()
