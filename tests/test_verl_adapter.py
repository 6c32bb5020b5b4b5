"""The verl adapter's patching against the real verl 0.9.1: what it replaces (verl's bindings, live and new
engines, Megatron's vocab-parallel functions), what it leaves alone (a user's references), exact undo, and
the inputs verl accepts (fp64 logits, [1, N] labels)."""

import gc
import importlib
import os
import subprocess
import sys
import types

import pytest
import torch
import verl  # noqa: F401  (plain import: a broken verl install fails here instead of skipping)
import verl.utils.torch_functional as tf
import verl.workers.engine.fsdp.transformer_impl as fsdp_engine
from helpers import bits, mismatches
from verl.workers.engine.base import BaseEngine, EngineRegistry

import rl_logp
from rl_logp.integrations import verl as adapter
from rl_logp.integrations.verl_step import StrictModeError

# verl modules that import logprobs_from_logits by name (verl.trainer.ppo.prefix_grouper_utils does too, but
# needs the `prefix_grouper` package, which verl does not install).
BINDING_MODULES = ["verl.workers.engine.fsdp.transformer_impl", "verl.workers.rollout.naive.naive_rollout"]
TOUCHED = ["logprobs_from_logits", "entropy_from_logits", "entropy_from_logits_with_chunking",
           "calculate_sum_pi_squared_from_logits", "_scale_logits_by_temperature", "calculate_debug_metrics"]


@pytest.fixture
def patched():
    cfg = adapter.apply(backend="chunked")
    yield cfg
    adapter.revert()


def _verl_bindings() -> dict:
    """Every (module, name) -> object in verl's modules and the classes/attributes the adapter wraps."""
    found = {}
    for name, module in list(sys.modules.items()):
        if name == "verl" or name.startswith("verl."):
            for attr in TOUCHED:
                if attr in vars(module):
                    found[(name, attr)] = vars(module)[attr]
    found["prepare_model_outputs"] = fsdp_engine.FSDPEngineWithLMHead.__dict__["prepare_model_outputs"]
    found["EngineRegistry.new"] = EngineRegistry.__dict__["new"]
    return found


def _engine_like(compiled: bool = True):
    """An FSDP engine as verl 0.9.1's `FSDPEngine.__init__` leaves its entropy function (line 183):
    `torch.compile(verl_F.entropy_from_logits, dynamic=True)`, bound on the instance."""
    engine = object.__new__(fsdp_engine.FSDPEngineWithLMHead)
    entropy = tf.entropy_from_logits
    engine.compute_entropy_from_logits = torch.compile(entropy, dynamic=True) if compiled else entropy
    engine.model_config = types.SimpleNamespace(use_fused_kernels=False)
    return engine


def test_apply_patches_torch_functional_and_every_verl_binding(patched):
    modules = [tf]
    for name in BINDING_MODULES:
        modules.append(importlib.import_module(name))
    x = torch.randn(3, 5, 257, dtype=torch.bfloat16)
    y = torch.randint(0, 257, (3, 5))
    y[0, 0] = -100
    ref_x = x.clone().requires_grad_(True)
    ref = rl_logp.logprobs(ref_x, y, backend="chunked")
    ref.sum().backward()
    for module in modules:
        fn = module.logprobs_from_logits
        leaf = x.clone().requires_grad_(True)
        out = fn(leaf * 1.0, y)
        out.sum().backward()
        assert out.dtype == torch.float32 and out.shape == y.shape
        assert mismatches(out, ref) == 0, module.__name__
        assert mismatches(leaf.grad, ref_x.grad) == 0, module.__name__
    assert len(adapter.report().patched) >= 7


def test_a_users_own_reference_keeps_the_original(patched):
    """Only verl's (and Megatron's) modules are rebound: a user's `saved = vf.logprobs_from_logits`, taken
    before apply, and a user module's `from verl... import` stay verl's own."""
    adapter.revert()
    user = types.ModuleType("a_users_training_script")
    user.saved = tf.logprobs_from_logits
    user.entropy = tf.entropy_from_logits
    sys.modules[user.__name__] = user
    main_saved = vars(sys.modules["__main__"]).get("logprobs_from_logits")
    try:
        adapter.apply(backend="chunked")
        assert tf.logprobs_from_logits.__module__ == "rl_logp.integrations.verl_functions"
        assert fsdp_engine.logprobs_from_logits is tf.logprobs_from_logits
        assert user.saved.__module__ == "verl.utils.torch_functional"
        assert user.entropy.__module__ == "verl.utils.torch_functional"
        assert vars(sys.modules["__main__"]).get("logprobs_from_logits") is main_saved
    finally:
        del sys.modules[user.__name__]


def test_revert_apply_revert_restores_exactly_the_originals():
    adapter.revert()
    before = _verl_bindings()
    assert before[(tf.__name__, "logprobs_from_logits")].__module__ == "verl.utils.torch_functional"
    engine = _engine_like()
    captured = engine.compute_entropy_from_logits
    for backend in ("chunked", "torch"):  # a second apply re-points (idempotent), then revert
        adapter.apply(backend=backend)
        assert engine.compute_entropy_from_logits is not captured
        assert _verl_bindings() != before
    adapter.revert()
    assert _verl_bindings() == before
    assert engine.compute_entropy_from_logits is captured
    adapter.apply(backend="chunked")
    sys.modules.pop("verl.workers.rollout.naive.naive_rollout", None)
    late = importlib.import_module("verl.workers.rollout.naive.naive_rollout")  # imported while patched
    assert late.logprobs_from_logits is tf.logprobs_from_logits
    adapter.revert()
    assert late.logprobs_from_logits is before[(tf.__name__, "logprobs_from_logits")]
    assert {k: v for k, v in _verl_bindings().items() if k in before} == before
    assert engine.compute_entropy_from_logits is captured


def test_apply_reaches_engines_built_before_it_and_through_the_registry_after_it():
    adapter.revert()
    early = _engine_like()
    compiled = early.compute_entropy_from_logits
    x = torch.randn(9, 301)
    try:
        adapter.apply(backend="chunked")
        assert early.compute_entropy_from_logits is not compiled
        assert mismatches(early.compute_entropy_from_logits(x), rl_logp.entropy(x)) == 0
        assert adapter.report().engines >= 1

        @EngineRegistry.register(model_type="rl_logp_test_engine", backend="rl_logp_test", device=["cpu", "cuda"])
        class LateEngine(BaseEngine):
            def __init__(self):
                super().__init__()
                self.compute_entropy_from_logits = torch.compile(tf.entropy_from_logits, dynamic=True)

        late = EngineRegistry.new("rl_logp_test_engine", "rl_logp_test")
        assert late.compute_entropy_from_logits is early.compute_entropy_from_logits
    finally:
        adapter.revert()
    assert early.compute_entropy_from_logits is compiled
    # built while patched, it had captured rl-logp's function: revert gives it verl's, compiled as verl does
    restored = vars(late)["compute_entropy_from_logits"]
    assert getattr(restored, "_torchdynamo_orig_callable", None) is tf.entropy_from_logits


def test_an_engine_that_refuses_the_patch_is_reported_and_fails_strict_mode():
    class Frozen(BaseEngine):
        def __init__(self):
            super().__init__()
            object.__setattr__(self, "compute_entropy_from_logits", tf.entropy_from_logits)

        def __setattr__(self, name, value):
            raise AttributeError(f"{type(self).__name__} is frozen")

    adapter.revert()
    frozen = Frozen()
    try:
        adapter.apply(backend="chunked")
        assert any("Frozen.compute_entropy_from_logits" in k for k in adapter.report().not_patched)
        with pytest.raises(StrictModeError, match=r"Frozen\.compute_entropy_from_logits"):
            adapter.apply(backend="chunked", strict=True)
    finally:
        adapter.revert()
    assert frozen.compute_entropy_from_logits is tf.entropy_from_logits


def test_strict_mode_adopts_a_live_fused_kernel_engine_whose_head_is_rl_logp_s():
    """use_fused_kernels=True is routed (verl's fused heads become rl_logp.linear_logprobs), not refused."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO
    from verl.utils.kernel import linear_cross_entropy as lce

    gc.collect()
    fused = _engine_like(compiled=False)
    fused.model_config.use_fused_kernels = True
    adapter.revert()
    verl_forward, verl_lce = FusedLinearForPPO.forward, lce.linear_cross_entropy
    adapter.apply(backend="chunked", strict=True)
    try:
        assert fused.compute_entropy_from_logits.__module__ == "rl_logp.integrations.verl_functions"
        for patched in (FusedLinearForPPO.forward, lce.linear_cross_entropy):
            assert patched.__module__ == "rl_logp.integrations.verl_functions"
    finally:
        adapter.revert()
    assert FusedLinearForPPO.forward is verl_forward and lce.linear_cross_entropy is verl_lce


def test_strict_mode_refuses_engines_that_divide_by_the_temperature_themselves():
    class TorchTitanEngineWithLMHead(BaseEngine):  # the name verl 0.9.1 gives its torchtitan engine
        pass

    gc.collect()
    titan = TorchTitanEngineWithLMHead()
    adapter.revert()
    with pytest.raises(StrictModeError, match=r"TorchTitanEngineWithLMHead.prepare_model_outputs temperature"):
        adapter.apply(backend="chunked", strict=True)
    assert titan is not None


def test_entropy_functions_are_patched_too(patched):
    x = torch.randn(6, 301)
    assert mismatches(tf.entropy_from_logits(x), rl_logp.entropy(x)) == 0
    assert mismatches(tf.entropy_from_logits_with_chunking(x, chunk_size=2), rl_logp.entropy(x)) == 0


def test_fp64_logits_and_labels_of_shape_1_by_n_as_verl_accepts_them(patched):
    """verl's flash-attn path flattens labels [1, N] against logits [N, V]; fp64 logits pass through its
    torch path. Patched, both give the contract on fp32(x) and an fp64 gradient."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(17, 523, generator=gen, dtype=torch.float64) * 4
    y = torch.randint(0, 523, (1, 17), generator=gen)
    leaf = x.clone().requires_grad_(True)
    out = tf.logprobs_from_logits(leaf, y)
    out.sum().backward()
    want_x = x.float().requires_grad_(True)
    want = rl_logp.logprobs(want_x, y.view(17), backend="chunked")
    want.sum().backward()
    assert out.shape == (17,) and mismatches(out, want) == 0
    assert leaf.grad.dtype == torch.float64
    assert mismatches(leaf.grad.float(), want_x.grad) == 0


def test_fsdp_engine_temperature_step_then_logprobs_give_the_contract_bits():
    """verl 0.9.1's FSDP engine: `_scale_logits_by_temperature` then `logprobs_from_logits`, as its forward
    calls them (fp32 per-token temperature, bf16 logits), outside a step plan. Unpatched it divides by
    bf16(T); patched it scores the contract's fp32(x) / T."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(96, 1031, generator=gen) * 3).to(torch.bfloat16)
    y = torch.randint(0, 1031, (96,), generator=gen)
    t = torch.full((96, 1), 0.7)
    want = rl_logp.logprobs(x, y, backend="chunked", temperature=0.7)

    def verl_forward() -> torch.Tensor:
        z = fsdp_engine._scale_logits_by_temperature(x, t, is_unit_temperature=False)
        return fsdp_engine.logprobs_from_logits(logits=z, labels=y, inplace_backward=True)

    stock = verl_forward()
    assert mismatches(stock.float(), want) > 48  # bf16(0.7) = 0.69921875: most rows move
    adapter.apply(backend="chunked")
    try:
        got = verl_forward()
        unit = fsdp_engine._scale_logits_by_temperature(x, t, is_unit_temperature=True)
    finally:
        adapter.revert()
    assert mismatches(got, want) == 0
    assert unit is x


def test_entry_point_is_registered_and_loads_from_import_verl_alone():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert names.get("rl_logp") == "rl_logp.integrations.verl_hook:load"
    code = (
        "import torch, verl, verl.utils.torch_functional as tf, rl_logp;"
        "x = torch.randn(4, 33); y = torch.randint(0, 33, (4,));"
        "print(tf.logprobs_from_logits.__module__, torch.equal(tf.logprobs_from_logits(x, y),"
        " rl_logp.logprobs(x, y, backend='chunked')))"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("RL_LOGP_")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, "RL_LOGP_BACKEND": "chunked"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["rl_logp.integrations.verl_functions", "True"]
    assert "rl_logp: verl -> rl_logp backend=chunked" in out.stderr
    plain = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, timeout=300)
    assert plain.stdout.split()[-2] == "verl.utils.torch_functional"


def test_ray_worker_gets_the_patch_from_runtime_env_alone():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"RL_LOGP_BACKEND": "chunked"}})
    try:
        @ray.remote
        def score():
            import torch as t
            import verl.utils.torch_functional as remote_tf

            g = t.Generator().manual_seed(3)
            x = t.randn(5, 77, generator=g)
            y = t.randint(0, 77, (5,), generator=g)
            return remote_tf.logprobs_from_logits.__module__, remote_tf.logprobs_from_logits(x, y)

        module, out = ray.get(score.remote(), timeout=240)
    finally:
        ray.shutdown()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 77, generator=g)
    y = torch.randint(0, 77, (5,), generator=g)
    assert module == "rl_logp.integrations.verl_functions"
    assert torch.equal(bits(out), bits(rl_logp.logprobs(x, y, backend="chunked")))


def _site_binding(site) -> object:
    owner = importlib.import_module(site.owner.rsplit(".", 1)[0] if site.kind == adapter.METHOD else site.owner)
    if site.kind == adapter.METHOD:
        owner = getattr(owner, site.owner.rsplit(".", 1)[1])
    return vars(owner)[site.attr]


def test_one_site_table_drives_apply_and_refuse():
    """Every row of `SITES` is replaced by `apply` and restored by `revert`; `refuse` puts a raising
    stand-in at exactly the rows that score logits."""
    adapter.revert()
    rows = [site for site in adapter.SITES if site.kind != adapter.ENGINE]
    stock = {site.name: _site_binding(site) for site in rows}
    engine = _engine_like(compiled=False)
    adapter.apply(backend="chunked")
    try:
        for site in rows:
            assert _site_binding(site) is not stock[site.name], site.name
        assert engine.compute_entropy_from_logits is not tf.entropy_from_logits
        assert len(adapter.report().patched) == len(rows)
        adapter.refuse("rl_logp: the test's refusal")
        for site in rows:
            if site.scores:
                with pytest.raises(RuntimeError, match=rf"the test's refusal .*verl's {site.name}\)"):
                    _site_binding(site)(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
            else:
                assert _site_binding(site) is stock[site.name], site.name
        with pytest.raises(RuntimeError, match="the test's refusal"):
            engine.compute_entropy_from_logits(torch.zeros(2, 3))
    finally:
        adapter.revert()
    assert {site.name: _site_binding(site) for site in rows} == stock
    assert engine.compute_entropy_from_logits is tf.entropy_from_logits
