"""benchmarks/bench_verl_step.py's Megatron engine step keeps working: `--smoke --suites megatron` on the CPU
(megatron-core 0.18.0, a gloo world of one) gives every cell of the FSDP table, unpatched and patched, and
each patched row is near verl's own outputs (verl rounds in bf16; a wrong temperature is nats off)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_verl_step_megatron_smoke(tmp_path):
    out = tmp_path / "megatron_step.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_verl_step.py"), "--smoke", "--suites",
                          "megatron", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = json.loads(out.read_text())["results"]
    assert all(r["suite"] == "megatron step" for r in rows) and not [r for r in rows if "error" in r or "note" in r]
    assert sorted((r["temperature"], r["entropy"], r["mode"]) for r in rows) == sorted(
        (t, e, m) for t in (1.0, 0.7) for e in (False, True) for m in ("unpatched", "patched")
    )
    for r in rows:
        assert r["fwd_bwd_ms"] > 0
        if r["mode"] == "patched":
            keys = {"logp_max_abs_diff", "grad_max_abs_diff"} | ({"entropy_max_abs_diff"} if r["entropy"] else set())
            assert keys <= set(r) and all(r[k] < 0.1 for k in keys), r
            assert r["logp_max_abs_diff"] > 0, r  # the rows really differ: stock Megatron's bits are not rl-logp's
    assert "megatron step" in run.stdout
