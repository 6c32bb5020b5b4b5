"""Config parsing, input validation, edge inputs, the bounded chunked workspace, and the check CLI."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import logp_and_grad, mismatches, model_like_logits, random_labels

from rl_logp import LogpConfig, logprobs, resolve_config
from rl_logp.chunked import WORKSPACE_BYTES_PER_ELEMENT, ChunkPlan


def test_config_precedence_env_dict_kwargs():
    env = {"RL_LOGP_BACKEND": "torch", "RL_LOGP_CHUNK_BYTES": "1_048_576", "RL_LOGP_STRICT": "0"}
    assert resolve_config(environ=env) == LogpConfig(backend="torch", chunk_bytes=1 << 20)
    assert resolve_config({"backend": "chunked"}, environ=env).backend == "chunked"
    assert resolve_config({"backend": "chunked"}, environ=env, backend="fused").backend == "fused"
    assert LogpConfig.from_env(env).chunk_bytes == 1 << 20


@pytest.mark.parametrize("bad,match", [
    ({"backend": "cuda"}, "backend='cuda' is unknown"),
    ({"chunk_bytes": 10}, "below the minimum"),
    ({"fixed_point_bits": 63}, "fixed_point_bits=63"),
    ({"strict": True, "backend": "torch"}, "not batch/TP-invariant"),
    ({"colour": 1}, "unknown config key 'colour'"),
])
def test_config_rejects_bad_values(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        resolve_config(bad, environ={})


def test_bad_env_value_names_the_variable():
    with pytest.raises(ValueError, match="strict='maybe'"):
        resolve_config(environ={"RL_LOGP_STRICT": "maybe"})


@pytest.mark.parametrize("logits,labels,match", [
    (torch.randn(2, 5, dtype=torch.float64), torch.zeros(2, dtype=torch.long), "dtype torch.float64"),
    (torch.randn(2, 5), torch.zeros(2), "labels have dtype torch.float32"),
    (torch.randn(2, 5), torch.zeros(3, dtype=torch.long), "labels have shape"),
    (torch.randn(2, 0), torch.zeros(2, dtype=torch.long), "empty vocabulary"),
])
def test_bad_inputs_get_clear_errors(logits, labels, match):
    with pytest.raises((TypeError, ValueError), match=match):
        logprobs(logits, labels, backend="chunked")


def test_bad_temperature_and_fused_on_cpu_without_interpreter():
    x, y = torch.randn(2, 5), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"temperature=0\.0 must be finite and > 0"):
        logprobs(x, y, temperature=0.0)
    with pytest.raises(ValueError, match="vocab_start/vocab_size describe a vocab split"):
        logprobs(x, y, vocab_size=5)


def test_empty_batch_and_3d_and_noncontiguous_inputs():
    empty = logprobs(torch.randn(0, 7, requires_grad=True), torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0,) and empty.dtype == torch.float32
    x = model_like_logits(12, 301, torch.bfloat16, "cpu")
    y = random_labels(12, 301, "cpu")
    flat = logp_and_grad(x, y, backend="chunked")
    shaped = logp_and_grad(x.view(3, 4, 301), y.view(3, 4), backend="chunked")
    assert mismatches(shaped[0].reshape(-1), flat[0]) == 0
    strided = torch.zeros(301, 12, dtype=torch.bfloat16)
    strided.copy_(x.t())
    t = logp_and_grad(strided.t(), y.int(), backend="chunked")  # last dim not contiguous: copied
    assert mismatches(t[0], flat[0]) == 0 and mismatches(t[1], flat[1]) == 0


def test_chunk_plan_depends_on_the_budget_and_vocab_only():
    for budget in [4096, 1 << 20, 1 << 28]:
        plan = ChunkPlan.for_budget(151936, budget)
        assert plan.workspace_bytes <= max(budget, WORKSPACE_BYTES_PER_ELEMENT)
        assert next(iter(plan.row_blocks(10**6))) == slice(0, plan.rows)


_RSS_PROBE = """
import resource, sys, torch
import rl_logp
n, vocab, backend = int(sys.argv[1]), 4096, sys.argv[2]
x = torch.randn(n, vocab); y = torch.randint(0, vocab, (n,))
rl_logp.logprobs(x[:2], y[:2], backend=backend, chunk_bytes=1 << 22)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rl_logp.logprobs(x, y, backend=backend, chunk_bytes=1 << 22)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


def _peak_growth(n, backend):
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(n), backend], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_chunked_forward_workspace_does_not_grow_with_n():
    # Peak RSS growth of one forward over 4096 and 16384 rows of 4096 fp32 logits (64 MB / 256 MB):
    # the chunked path stays within its 4 MiB budget plus allocator slack at both N; the torch baseline
    # (a full log_softmax copy of 256 MB) breaks the same bound, which shows the probe can see workspace.
    bound = 48 << 20
    small, large = _peak_growth(4096, "chunked"), _peak_growth(16384, "chunked")
    assert small < bound and large < bound, (small, large)
    assert _peak_growth(16384, "torch") > bound


@pytest.mark.parametrize("world", [2, 4])
def test_check_cli_passes_on_gloo_worlds(tmp_path, world):
    report = tmp_path / "check.json"
    out = subprocess.run(
        [sys.executable, "-m", "rl_logp.check", "--rows", "48", "--vocab", "3001", "--world", str(world),
         "--json", str(report)], capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["passed"] and data["world"] == world
    invariant = [c for c in data["comparisons"] if c["invariant"] and not c["note"]]
    assert invariant and all(c["differing"] == 0 for c in invariant)
    assert any(c["provider"] == f"train TP={world} [chunked]" for c in invariant)
    assert "VERDICT: PASS" in out.stdout


def test_tp_ranks_that_disagree_on_n_fail_on_every_rank(tmp_path):
    code = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import rl_logp
def rank(r, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=2)
    x = torch.randn(4 + r, 10); y = torch.zeros(4 + r, dtype=torch.long)
    try:
        rl_logp.logprobs(x, y, backend="chunked", tp_group=dist.group.WORLD)
    except ValueError as e:
        # one write per rank (atomic on a pipe), so the two ranks' lines cannot interleave
        sys.stdout.write(f"rank {r} ValueError {'different numbers of rows' in str(e)}\\n")
        sys.stdout.flush()
if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(rank, args=(port,), nprocs=2)
"""
    script = tmp_path / "disagree.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.stdout.count("ValueError True") == 2, out.stdout + out.stderr
