"""verl 0.9.1's real training step on the CPU, with rl-logp on the way a recipe turns it on.

`tests/verl_step/worker_step.py` builds `ActorRolloutRefWorker`s (actor and ref, FSDP2 on gloo, world size
1, a random Qwen2 with V = 151936 created here) and drives them with `RayPPOTrainer`'s own
`_compute_old_log_prob`, `_compute_ref_log_prob` and `_update_actor`, at T = 0.7 and 1.0, remove-padding
on and off. Two processes run it side by side: one with `RL_LOGP_BACKEND=auto` and `RL_LOGP_STRICT=1` (the
`verl.plugins` entry point and the config's `external_lib=rl_logp.integrations.verl_hook`, as
`configs/rl_logp_grpo.yaml` sets them), one without (stock verl, the negative control). The CPU shims it needs are listed in that script's
docstring and in docs/verl.md; none touches how a logit is scored.

Checked against rl-logp computed here on the logits the script captured from each `lm_head`:
- on: old log-probs, entropies and ref log-probs are rl-logp's bits (0 differing tokens); the update ran
  (one training forward per micro-batch) with importance ratio exactly 1 (ppo_kl 0); the rollout side
  (vLLM's sampler code on the same logits, patched) and the trainer agree: `calculate_debug_metrics`
  reports `rl_logp/rollout_train_mismatch_tokens` 0 and `.../max_abs_diff` 0.0.
- off: stock verl differs from rl-logp on the old log-probs, entropies and ref log-probs, and stock vLLM's
  rollout logp differs from stock verl's old log-probs (the metric's count is not 0).

Then, in the same two processes, `use_fused_kernels=True` (verl's torch backend, `FusedLinearForPPO`,
which rl-logp replaces with `rl_logp.linear_logprobs`) at T = 0.7 and 1.0, remove-padding on and off, on a
second random Qwen2 with tied embeddings (verl 0.9.1's FSDP2 fused path fails with an untied `lm_head`;
see the script's docstring): the trainer's three steps, no rollout side. No logits exist there, so the
script captures what the fused head received (the final norm's output and `lm_head.weight`), and the
results are checked against `rl_logp.linear_logprobs(hidden, weight, tokens, temperature=T,
entropy=True)` on those:
- on: old log-probs, entropies and ref log-probs are its bits (0 differing tokens); `lm_head` was never
  called; the update ran (one fused forward per micro-batch) with ppo_kl 0.
- off: stock verl's fused head differs from it on all three, while staying close (rtol = atol = 1e-2:
  the captured inputs are what that head scored).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import verl  # noqa: F401  (plain import: a broken verl install fails this test instead of skipping it)
from helpers import bits, mismatches

import rl_logp
from rl_logp.integrations.verl_metrics import MAX_ABS_DIFF_KEY, MISMATCH_KEY, rollout_train_agreement

SCRIPT = Path(__file__).parent / "verl_step" / "worker_step.py"
VOCAB = 151936
CASES = [(rmpad, t) for rmpad in (True, False) for t in (0.7, 1.0)]
FUSED_KEYS = (("old_log_probs", "old", 0), ("entropys", "old", 1), ("ref_log_prob", "ref", 0))


def _load_script():
    spec = importlib.util.spec_from_file_location("verl_worker_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("verl_step")
    model, tied = root / "model", root / "tied"
    script = _load_script()
    script.make_model(str(model), VOCAB)
    script.make_model(str(tied), VOCAB, tie_word_embeddings=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("RL_LOGP_")}
    envs = {"on": {**base, "RL_LOGP_BACKEND": "auto", "RL_LOGP_STRICT": "1", "MASTER_PORT": "29541"},
            "off": {**base, "MASTER_PORT": "29542"}}
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(SCRIPT), "--model", str(model), "--vocab", str(VOCAB), "--out", str(root / name),
             "--fused-model", str(tied)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for name, env in envs.items()
    }
    logs = {name: proc.communicate(timeout=600)[0] for name, proc in procs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name} run failed:\n{logs[name][-6000:]}"
    out = {name: torch.load(root / name, weights_only=False) for name in procs}
    out["logs"] = logs
    return out


def _count(case: dict, key: str, logits_key: str, temperature: float, what: str) -> tuple[int, int]:
    """(differing tokens, tokens) between the trainer's `key` and rl-logp on the captured logits."""
    batch = case["batch"]
    differ = total = 0
    for i, x in enumerate(case[logits_key]):
        length = x.shape[0]
        tokens = batch["responses"][i, :length]
        if what == "entropy":
            want = rl_logp.entropy(x, temperature=temperature)
        else:
            want = rl_logp.logprobs(x, tokens, temperature=temperature)
        differ += mismatches(batch[key][i, :length].float(), want)
        total += length
    return differ, total


@pytest.mark.parametrize("rmpad,temperature", CASES)
def test_rl_logp_on_trainer_log_probs_and_entropies_are_rl_logp_bits(runs, rmpad, temperature):
    on = runs["on"]
    assert on["patched_module"] == "rl_logp.integrations.verl_functions"
    assert "rl_logp: verl -> rl_logp backend=auto (chunked on cpu), strict" in runs["logs"]["on"]
    case = on[(rmpad, temperature)]
    for key, logits_key, what in (("old_log_probs", "old_logits", "logp"), ("entropys", "old_logits", "entropy"),
                                  ("ref_log_prob", "ref_logits", "logp")):
        differ, total = _count(case, key, logits_key, temperature, what)
        assert total == 24
        assert differ == 0, f"{key}: {differ}/{total} tokens differ from rl-logp"
    assert case["update_logits"] == 2  # _update_actor ran one training forward per micro-batch
    assert case["update_metrics"]["actor/ppo_kl"] == [0.0]  # importance ratio exactly 1
    assert case["debug_metrics"][MISMATCH_KEY] == 0
    assert case["debug_metrics"][MAX_ABS_DIFF_KEY] == 0.0


@pytest.mark.parametrize("rmpad,temperature", CASES)
def test_stock_verl_differs_negative_control(runs, rmpad, temperature):
    off = runs["off"]
    assert off["patched_module"] == "verl.utils.torch_functional"
    case = off[(rmpad, temperature)]
    for key, logits_key, what in (("old_log_probs", "old_logits", "logp"), ("entropys", "old_logits", "entropy"),
                                  ("ref_log_prob", "ref_logits", "logp")):
        differ, total = _count(case, key, logits_key, temperature, what)
        print(f"stock verl rmpad={rmpad} T={temperature} {key}: {differ}/{total} tokens differ from rl-logp")
        assert differ > 0
    assert MISMATCH_KEY not in case["debug_metrics"]
    batch = case["batch"]
    agreement = rollout_train_agreement(batch["rollout_log_probs"], batch["old_log_probs"], batch["response_mask"])
    print(f"stock verl vs stock vLLM rmpad={rmpad} T={temperature}: {agreement}")
    assert agreement[MISMATCH_KEY] > 0
    assert agreement[MAX_ABS_DIFF_KEY] > 0.0
    assert not torch.equal(bits(batch["rollout_log_probs"]), bits(batch["old_log_probs"].float()))


def _fused_pairs(case: dict, key: str, inputs: str, which: int, temperature: float):
    """(the trainer's `key`, rl_logp.linear_logprobs on the captured `inputs`) for each sequence's response;
    `which`: 0 log-probs, 1 entropies."""
    batch = case["batch"]
    for i, hidden in enumerate(case[f"{inputs}_hidden"]):
        length = hidden.shape[0]
        tokens = batch["responses"][i, :length]
        want = rl_logp.linear_logprobs(hidden, case[f"{inputs}_weight"], tokens, temperature=temperature,
                                       entropy=True)[which]
        yield batch[key][i, :length].float(), want


@pytest.mark.parametrize("rmpad,temperature", CASES)
def test_fused_rl_logp_on_trainer_log_probs_and_entropies_are_linear_logprobs_bits(runs, rmpad, temperature):
    case = runs["on"][("fused", rmpad, temperature)]
    for key, inputs, which in FUSED_KEYS:
        pairs = list(_fused_pairs(case, key, inputs, which, temperature))
        total = sum(got.numel() for got, _ in pairs)
        differ = sum(mismatches(got, want) for got, want in pairs)
        assert total == 24
        assert differ == 0, f"fused {key}: {differ}/{total} tokens differ from rl_logp.linear_logprobs"
    assert case["lm_head_calls"] == 0  # no logits: the fused forward never calls lm_head
    assert case["update_forwards"] == 2  # _update_actor ran one fused forward per micro-batch
    assert case["update_metrics"]["actor/ppo_kl"] == [0.0]  # importance ratio exactly 1


@pytest.mark.parametrize("rmpad,temperature", CASES)
def test_fused_stock_verl_differs_negative_control(runs, rmpad, temperature):
    case = runs["off"][("fused", rmpad, temperature)]
    assert case["lm_head_calls"] == 0
    for key, inputs, which in FUSED_KEYS:
        pairs = list(_fused_pairs(case, key, inputs, which, temperature))
        differ = sum(mismatches(got, want) for got, want in pairs)
        print(f"stock verl fused rmpad={rmpad} T={temperature} {key}: {differ}/24 tokens differ from rl-logp")
        assert differ > 0
        for got, want in pairs:  # the captured inputs are what stock verl's head scored
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
