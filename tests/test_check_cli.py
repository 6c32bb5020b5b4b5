"""The provider-agreement check (`python -m rl_logp.check`): it passes on gloo worlds and on every dtype it
accepts, leaves vLLM unpatched, keeps its JSON and the tracebacks when something fails, and takes or refuses
every `--backends` list with a clear message. Small batches: the cost is mostly process start-up."""

import json
import os
import subprocess
import sys

import pytest

# vLLM is imported here, at collection, not first inside a capsys test (main() below imports it): on
# import it configures logging (vllm/logger.py, dictConfig), which closes every handler in the process;
# absl's handler (made when megatron.core, e.g. tests/test_verl_megatron.py, imports absl.logging)
# closes its stream, pytest's capture of sys.stderr, unless that is sys.stderr then, and under capsys
# it is not: pytest then ends on 'lost sys.stderr'.
import vllm  # noqa: F401

from rl_logp.check import runner
from rl_logp.check.__main__ import build_parser, main
from rl_logp.integrations import vllm as adapter

SMALL = ["--rows", "16", "--vocab", "100"]


def run_cli(args: list[str], cwd, script: str | None = None, env: dict | None = None):
    """`python -m rl_logp.check ARGS` (or a driver script that patches the check first) in a subprocess."""
    command = [sys.executable, str(script)] if script else [sys.executable, "-m", "rl_logp.check"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env=env or dict(os.environ))


def invariant_rows(report: dict) -> list[dict]:
    return [c for c in report["comparisons"] if c["invariant"] and not c["note"]]


@pytest.mark.parametrize("world,dtype,shape", [(2, "float32", SMALL), (4, "bfloat16", ["--rows", "48", "--vocab", "3001"])],
                         ids=["tp2-fp32-16x100", "tp4-bf16-48x3001"])
def test_check_cli_passes_on_gloo_worlds(tmp_path, world, dtype, shape):
    """The first case is issue 15's report: fp32 logits in a spawned TP=2 world exited 1 (the rollout
    divided the shared batch in place)."""
    report = tmp_path / "check.json"
    out = run_cli([*shape, "--dtype", dtype, "--world", str(world), "--json", str(report)], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["passed"] and data["world"] == world and data["error"] == ""
    invariant = invariant_rows(data)
    assert invariant and all(c["differing"] == 0 for c in invariant)
    assert any(c["provider"] == f"train TP={world} [chunked]" for c in invariant)
    assert "VERDICT: PASS" in out.stdout


def test_every_dtype_the_cli_accepts_passes_and_leaves_vllm_unpatched(tmp_path, capsys):
    dtypes = next(a.choices for a in build_parser()._actions if a.dest == "dtype")
    assert set(dtypes) == {"bfloat16", "float16", "float32"}
    for dtype in dtypes:
        report = tmp_path / f"{dtype}.json"
        assert main([*SMALL, "--dtype", dtype, "--world", "1", "--json", str(report)]) == 0, capsys.readouterr().out
        data = json.loads(report.read_text())
        rollout = [c for c in invariant_rows(data) if c["provider"] == "rollout"]
        assert data["passed"] and "vLLM" in data["rollout"] and len(rollout) >= 12
        assert {"temperature 0.7", "top-k + top-p, T 0.7", "fp32 logits"} <= {c["case"] for c in rollout}
        assert all(c["differing"] == 0 for c in rollout)
        assert adapter.active_config() is None and adapter.active_patches() == []


DRIVER = '''
import os, sys, torch
from rl_logp.check import rollout, runner
from rl_logp.check.__main__ import main

MODE = {mode!r}
score = rollout.VllmRollout.__call__
build_cases = runner.build_cases

def flaky(self, logits, labels, sampling):
    out = score(self, logits, labels, sampling)
    if logits.shape[0] == 3:
        raise RuntimeError("injected rollout failure")
    if logits.shape[0] == 1:
        out = out.clone()
        out[0] = torch.nextafter(out[0], torch.tensor(0.0))  # one ulp off
    return out

def dying(*args, **kwargs):
    if os.environ.get("RANK") == "1":
        os._exit(3)
    return build_cases(*args, **kwargs)

if MODE == "rollout":
    rollout.VllmRollout.__call__ = flaky
else:
    runner.build_cases = dying

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''


def test_failing_cases_keep_the_json_and_print_their_tracebacks(tmp_path):
    """In a spawned TP=2 world (where a failure used to end as SystemExit with no report): one case's
    rollout raises, another's is one ulp off; the check runs every case, prints both failures (the
    traceback of the first) and writes the JSON."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(mode="rollout"))
    report = tmp_path / "check.json"
    out = run_cli([*SMALL, "--world", "2", "--json", str(report)], tmp_path, script)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads(report.read_text())
    assert not data["passed"] and data["error"] == ""
    failed = {(c["case"], c["provider"]): c for c in data["comparisons"] if c["invariant"] and (c["differing"] or c["error"])}
    assert set(failed) == {("batch of 3", "rollout"), ("batch of 1", "rollout")}
    assert "RuntimeError: injected rollout failure" in failed["batch of 3", "rollout"]["error"]
    assert "Traceback" in failed["batch of 3", "rollout"]["error"] and failed["batch of 1", "rollout"]["differing"] == 1
    assert len({c["case"] for c in data["comparisons"]}) >= 12  # the cases after the failures ran too
    text = out.stdout
    assert "FAILURES" in text and "Traceback" in text and "injected rollout failure" in text
    assert "1 of 1 rows differ" in text and "VERDICT: FAIL - 2 of" in text


def test_a_rank_that_dies_still_leaves_a_report(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(mode="die"))
    report = tmp_path / "check.json"
    out = run_cli([*SMALL, "--world", "2", "--timeout", "60", "--json", str(report)], tmp_path, script)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads(report.read_text())
    assert not data["passed"] and "a spawned rank died" in data["error"]
    assert "a spawned rank died" in out.stderr and "report written to" in out.stdout


def test_a_run_that_raises_writes_its_traceback(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise ValueError("injected: cannot build the cases")

    monkeypatch.setattr(runner, "build_cases", broken)
    report = tmp_path / "check.json"
    assert main([*SMALL, "--world", "1", "--json", str(report)]) == 1
    data = json.loads(report.read_text())
    assert not data["passed"] and "ValueError: injected: cannot build the cases" in data["error"]
    text = capsys.readouterr().out
    assert "Traceback" in text and "injected: cannot build the cases" in text and "VERDICT: FAIL" in text


@pytest.mark.parametrize("backends,reference", [
    (["torch"], "auto"),
    (["flash_attn"], "auto"),
    (["flash_attn", "torch"], "auto"),
    (["torch", "chunked"], "chunked"),
    (["chunked", "chunked", "auto"], "chunked"),
    (["auto"], "auto"),
    (["fused", "chunked"], "fused"),
])
def test_every_backends_list_runs_against_one_reference(tmp_path, capsys, backends, reference):
    """The reference is resolved once (the first invariant backend, else auto), named in the header and
    the JSON; a backend that cannot run here (flash_attn on the CPU) is reported as not run."""
    report = tmp_path / "check.json"
    status = main([*SMALL, "--world", "1", "--backends", *backends, "--json", str(report)])
    text = capsys.readouterr().out
    assert status == 0, text[-3000:]
    data = json.loads(report.read_text())
    assert data["passed"] and data["reference"] == reference
    assert f"reference: train TP=1 [{reference}]" in text
    providers = {c["provider"] for c in data["comparisons"]}
    assert providers >= {f"train TP=1 [{b}]" for b in backends} | {"rollout"}


def test_a_reference_that_cannot_run_is_refused(tmp_path):
    """`fused` needs CUDA (or Triton's interpreter, which the test session turns on): without either the
    check refuses with exit status 2 and says why, before starting any rank."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = run_cli([*SMALL, "--backends", "fused", "--json", str(tmp_path / "c.json")], tmp_path, env=env)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "refused: the reference backend 'fused' cannot run on cpu" in out.stderr
    assert not (tmp_path / "c.json").exists()
