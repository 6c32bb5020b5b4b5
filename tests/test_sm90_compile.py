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
    assert {"forward T=1", "forward T=0.7 +entropy", "backward T=0.7"} <= names
    for plan in ("fused", "split"):  # the kept set with a write, and with the draw, in both plans
        assert any(n.startswith(f"{plan} kp write") for n in names) and any(n.startswith(f"{plan} - draw") for n in names)
    assert {name: spill for name, (_, spill) in rows.items() if spill} == {}
    assert all(regs <= 255 for regs, _ in rows.values())
