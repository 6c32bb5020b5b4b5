"""Turning rl-logp on in verl: the environment is validated (fail-closed, even through verl's plugin loader,
which swallows exceptions), strict mode comes from the environment, and the recipe overlay composes with
the installed verl and puts the worker hook and the variables where verl reads them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import verl  # noqa: F401  (plain import: a broken verl install fails here instead of skipping)
from omegaconf import OmegaConf, open_dict

import rl_logp
from rl_logp.integrations.verl_hook import ConfigurationError, config_from_environment

ROOT = Path(__file__).resolve().parents[1]
HOOK = "rl_logp.integrations.verl_hook"

# In a fresh process: `import verl` (the entry point runs the hook), then the external_lib route (what
# HFModelConfig does in every worker), then a logp call through verl; prints what each did.
PROBE = """
import json, torch, verl
from verl.utils.import_utils import import_external_libs
import verl.utils.torch_functional as tf
seen = {}
try:
    import_external_libs("rl_logp.integrations.verl_hook")
    seen["external_lib"] = "ok"
except Exception as err:
    seen["external_lib"] = type(err).__name__ + ": " + str(err)
try:
    tf.logprobs_from_logits(torch.randn(3, 11), torch.randint(0, 11, (3,)))
    seen["logp"] = "ok:" + tf.logprobs_from_logits.__module__
except Exception as err:
    seen["logp"] = type(err).__name__ + ": " + str(err)
print(json.dumps(seen))
"""


def _probe_all(cases: dict[str, dict[str, str]]) -> dict[str, tuple[dict, str]]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RL_LOGP_")}
    procs = {name: subprocess.Popen([sys.executable, "-c", PROBE], env={**base, **env}, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name, env in cases.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-4000:]
        out[name] = (json.loads(stdout.strip().splitlines()[-1]), stderr)
    return out


def test_invalid_environment_fails_closed_through_verl_s_plugin_loader():
    results = _probe_all({
        "backend": {"RL_LOGP_BACKEND": "foo"},
        "chunk": {"RL_LOGP_BACKEND": "auto", "RL_LOGP_CHUNK_BYTES": "lots"},
        "strict_alone": {"RL_LOGP_STRICT": "1"},
        "valid": {"RL_LOGP_BACKEND": "chunked", "RL_LOGP_STRICT": "1"},
    })
    expected = {
        "backend": ("RL_LOGP_BACKEND='foo'", "choose one of auto, fused, chunked, flash_attn, torch"),
        "chunk": ("RL_LOGP_CHUNK_BYTES='lots'", "is not an integer"),
        "strict_alone": ("RL_LOGP_STRICT='1'", "set RL_LOGP_BACKEND=auto"),
    }
    for name, (variable, fix) in expected.items():
        seen, stderr = results[name]
        error_lines = [line for line in stderr.splitlines() if "ERROR" in line and variable in line]
        assert error_lines and fix in error_lines[0], stderr[-3000:]  # logged at ERROR despite verl's DEBUG
        assert seen["external_lib"].startswith("ConfigurationError") and variable in seen["external_lib"]
        assert seen["logp"].startswith("RuntimeError") and variable in seen["logp"] and fix in seen["logp"]
    seen, _ = results["valid"]
    assert seen == {"external_lib": "ok", "logp": "ok:rl_logp.integrations.verl_functions"}


def test_config_from_environment_names_each_bad_variable():
    assert config_from_environment({}) is None
    assert config_from_environment({"RL_LOGP_STRICT": "0"}) is None
    cfg = config_from_environment({"RL_LOGP_BACKEND": "auto", "RL_LOGP_STRICT": "1", "RL_LOGP_CHUNK_BYTES": "1048576"})
    assert cfg == rl_logp.LogpConfig(backend="auto", strict=True, chunk_bytes=1 << 20)
    with pytest.raises(ConfigurationError) as info:
        config_from_environment({"RL_LOGP_BACKEND": "fast", "RL_LOGP_FIXED_POINT_BITS": "70"})
    assert "RL_LOGP_BACKEND='fast'" in str(info.value) and "RL_LOGP_FIXED_POINT_BITS='70'" in str(info.value)
    with pytest.raises(ConfigurationError, match=r"RL_LOGP_BACKEND='torch', RL_LOGP_STRICT='1': .*not batch/TP"):
        config_from_environment({"RL_LOGP_BACKEND": "torch", "RL_LOGP_STRICT": "1"})


def _overlay():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return compose(config_name="rl_logp_grpo")


def test_recipe_overlay_composes_with_the_installed_verl_from_the_command_line():
    """The documented command, with hydra's `--cfg job` (print the composed config, run nothing)."""
    out = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={ROOT / 'configs'}",
         "--config-name=rl_logp_grpo", "--cfg", "job"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    composed = OmegaConf.create(out.stdout)
    assert composed.actor_rollout_ref.model.external_lib == HOOK
    assert composed.ray_kwargs.ray_init.runtime_env.env_vars.RL_LOGP_BACKEND == "auto"
    assert composed.actor_rollout_ref.actor.strategy == "fsdp"  # verl's own ppo_trainer underneath
    assert composed == _overlay()


def test_recipe_overlay_lands_where_verl_reads_it(tmp_path, monkeypatch):
    """`run_ppo` passes the env vars to `ray.init` (so Ray gives them to the TaskRunner and every worker),
    and each worker's `HFModelConfig` imports the hook named by `external_lib`."""
    import ray
    from verl.trainer import main_ppo
    from verl.utils.config import omega_conf_to_dataclass

    cfg = _overlay()
    seen = {}

    class Stop(Exception):
        pass

    def fake_init(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    with pytest.raises(Stop):
        main_ppo.run_ppo(cfg, task_runner_class=None)
    env_vars = seen["runtime_env"]["env_vars"]
    assert env_vars["RL_LOGP_BACKEND"] == "auto" and env_vars["RL_LOGP_STRICT"] == "1"

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "verl_step"))
    from worker_step import make_model

    make_model(str(tmp_path / "model"), 503)
    model = cfg.actor_rollout_ref.model
    with open_dict(model):
        model.path = str(tmp_path / "model")
        model.load_tokenizer = False
    monkeypatch.delitem(sys.modules, HOOK)
    config = omega_conf_to_dataclass(model)
    assert config.external_lib == HOOK
    assert HOOK in sys.modules  # verl imported it while building the model config
