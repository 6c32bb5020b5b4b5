"""The GPU kernels compile for an H200 (sm_90) on this CPU-only machine, specialised as their launches
specialise them, without register spills. The other CPU tests run the kernels under Triton's interpreter,
which never compiles them: a kernel the GPU backend rejects (or one that spills) would otherwise surface
only on the device. Compiled in a subprocess without TRITON_INTERPRET (the kernels' GPU definitions),
with `benchmarks/kernel_resources.py`'s compiler (Triton's own, with the ptxas its wheel carries)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPILE = """
import sys
sys.path.insert(0, "benchmarks")
import torch
import kernel_resources as kr
from rl_logp.kernels import launch

cfg = launch.LaunchConfig()
kernels = [(f"forward {v.name}", kr.forward(v, cfg, 151936, torch.bfloat16)) for v in kr.VARIANTS[:2] + kr.VARIANTS[3:5]]
kernels += [(f"backward {v.name}", kr.backward(v, cfg, 151936, torch.bfloat16)) for v in kr.VARIANTS[:2]]
kernels += [(name, k) for name, k in kr.kept_set_launches(151936, which=("kp", "-"))]
kernels += list(kr.compiled(kr.sampled_rank_calls(151936)))
for name, kernel in kernels:
    regs, spill = kr.registers(kernel)
    print(f"{name}|{regs}|{spill}")
"""


def test_kernels_compile_for_sm90_without_spills():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = {name: (int(regs), int(spill)) for name, regs, spill in (line.split("|") for line in run.stdout.splitlines())}
    names = set(rows)
    assert {"forward T=1", "forward T=0.7 +entropy", "backward T=0.7", "sampled rank n=0", "sampled rank n=20"} <= names
    for plan in ("fused", "split"):  # the kept set with a write, and with the draw, in both plans
        assert any(n.startswith(f"{plan} kp write") for n in names) and any(n.startswith(f"{plan} - draw") for n in names)
    assert {name: spill for name, (_, spill) in rows.items() if spill} == {}
    assert all(regs <= 255 for regs, _ in rows.values())


DRIVER = """
import sys
sys.path[:0] = ["benchmarks", "tests"]
import torch
import kernel_resources as kr
from helpers import triton_launcher_bytes, value_bytes
from rl_logp.kernels import fixed_point, launch, row_stats
from rl_logp.kernels.launcher import driver_values

cfg, n, vocab = launch.LaunchConfig(), 8, 151936
cases = []
for dtype, t in ((torch.bfloat16, None), (torch.bfloat16, 0.7), (torch.float32, 0.7)):
    x = torch.empty(n, vocab, dtype=dtype)
    mode = fixed_point.TEMP_NONE.value if t is None else fixed_point.TEMP_SCALAR.value
    for name, labels, out_logp, out_full in (
            ("logprobs", torch.zeros(n, dtype=torch.int64), torch.empty(n), None),
            ("column_logprobs", torch.zeros(n, 21, dtype=torch.int64), torch.empty(n, 21), None),
            ("full_logprobs", None, None, torch.empty(n, vocab))):
        _, args, options = launch.forward_launch(
            x, labels, mode, None, 1.0 if t is None else t, None, (None, None, None, out_logp, None), (None, None), 40,
            False, row_stats.MAX_SCAN.value, row_stats.RESULT_ROW.value, cfg, out_full)
        cases.append((f"{name} {dtype} T={t}", row_stats.row_stats_kernel, args, options))
cases += list(kr.kept_set_calls(vocab, which=("kp", "-")))
cases += list(kr.sampled_rank_calls(vocab))
for name, fn, args, options in cases:
    compiled = kr.compile_launch(fn, args, options)
    values = driver_values(compiled, args)
    same = values is not None and value_bytes(values) == triton_launcher_bytes(compiled, args)
    print(f"{name}|{int(values is not None)}|{int(same)}")
"""


def test_rollout_launches_pack_for_the_driver_as_tritons_launcher():
    """Every launch a rollout plan binds (the forward of `logprobs`, `column_logprobs`, `full_logprobs`
    at T = 1 and 0.7; the kept set's fused and split launches, masking, thresholds and drawing; vLLM V1's gather), compiled
    for sm_90: `driver_values` packs it (the driver launch would engage, not decline) with the bytes
    Triton's own generated launcher passes."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", DRIVER], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [line.split("|") for line in run.stdout.splitlines()]
    assert len(rows) == 9 + 14 + 4 + 2  # 9 forwards; the kept set (`kept_set_calls`): split 4 launches x 3 + 2, fused 4;
    # vLLM V1's gather (`sampled_rank_calls`), n = 0 and 20
    assert [name for name, packed, same in rows if packed != "1" or same != "1"] == []
