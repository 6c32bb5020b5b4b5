"""The verl adapter against the real verl package (pinned in pyproject's `verl` extra)."""

import importlib
import os
import subprocess
import sys

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")

from rl_logp.integrations import verl as adapter  # noqa: E402

import rl_logp  # noqa: E402

BINDING_MODULES = [
    "verl.workers.engine.fsdp.transformer_impl",
    "verl.workers.rollout.naive.naive_rollout",
    "verl.trainer.ppo.prefix_grouper_utils",
]


def _importable(names):
    found = []
    for name in names:
        try:
            found.append(importlib.import_module(name))
        except Exception:  # a module that needs a GPU-only dependency is left out
            continue
    return found


@pytest.fixture
def patched():
    cfg = adapter.apply(backend="chunked")
    yield cfg
    adapter.revert()


def test_apply_patches_torch_functional_and_every_binding(patched):
    import verl.utils.torch_functional as tf

    modules = [tf, *_importable(BINDING_MODULES)]
    x = torch.randn(3, 5, 257, dtype=torch.bfloat16)
    y = torch.randint(0, 257, (3, 5))
    y[0, 0] = -100
    ref_x = x.clone().requires_grad_(True)
    ref = rl_logp.logprobs(ref_x, y, backend="chunked")
    ref.sum().backward()
    checked = 0
    for module in modules:
        fn = getattr(module, "logprobs_from_logits", None)
        if fn is None:
            continue
        leaf = x.clone().requires_grad_(True)
        out = fn(leaf * 1.0, y)
        out.sum().backward()
        assert out.dtype == torch.float32 and out.shape == y.shape
        assert torch.equal(out.view(torch.int32), ref.detach().view(torch.int32)), module.__name__
        assert torch.equal(leaf.grad.view(torch.int16), ref_x.grad.view(torch.int16)), module.__name__
        checked += 1
    assert checked >= 2


def test_revert_restores_the_originals():
    import verl.utils.torch_functional as tf

    modules = _importable(BINDING_MODULES)
    before = {m.__name__: m.logprobs_from_logits for m in [tf, *modules] if hasattr(m, "logprobs_from_logits")}
    adapter.apply(backend="chunked")
    assert tf.logprobs_from_logits is not before[tf.__name__]
    adapter.apply(backend="torch")  # idempotent re-apply
    adapter.revert()
    for m in [tf, *modules]:
        if m.__name__ in before:
            assert m.logprobs_from_logits is before[m.__name__]


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
    env = {**os.environ, "RL_LOGP_BACKEND": "chunked"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["rl_logp.integrations.verl", "True"]
    assert "rl_logp: verl logprobs_from_logits -> rl_logp backend=chunked" in out.stderr
    plain = subprocess.run([sys.executable, "-c", code], env={k: v for k, v in env.items() if k != "RL_LOGP_BACKEND"},
                           capture_output=True, text=True, timeout=300)
    assert plain.stdout.split()[-2] == "verl.utils.torch_functional"


def _megatron_style_rank(rank, world, port, path):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = rl_logp.resolve_config(backend="chunked")
    fn = adapter.make_vocab_parallel_log_probs_from_logits(cfg, group_getter=lambda: dist.group.WORLD)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, 1000, generator=gen).to(torch.bfloat16)
    y = torch.randint(0, 1000, (6, 4), generator=gen)
    cut = 437
    part = x[..., :cut] if rank == 0 else x[..., cut:]
    leaf = part.clone().requires_grad_(True)
    out = fn(leaf, y)
    out.sum().backward()
    torch.save({"out": out.detach(), "grad": leaf.grad}, f"{path}.{rank}")
    dist.destroy_process_group()


def test_megatron_style_vocab_parallel_call_on_two_gloo_ranks_gives_tp1_bits(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = str(tmp_path / "r")
    torch.multiprocessing.spawn(_megatron_style_rank, args=(2, port, path), nprocs=2, join=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, 1000, generator=gen).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, 1000, (6, 4), generator=gen)
    ref = rl_logp.logprobs(x, y, backend="chunked")
    ref.sum().backward()
    r0, r1 = torch.load(f"{path}.0"), torch.load(f"{path}.1")
    for r in (r0, r1):
        assert torch.equal(r["out"].view(torch.int32), ref.detach().view(torch.int32))
    grad = torch.cat([r0["grad"], r1["grad"]], dim=-1)
    assert torch.equal(grad.view(torch.int16), x.grad.view(torch.int16))


def test_ray_worker_gets_the_patch_from_runtime_env_alone():
    ray = pytest.importorskip("ray", reason="ray is not installed")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"RL_LOGP_BACKEND": "chunked"}})
    try:
        @ray.remote
        def score():
            import torch as t
            import verl.utils.torch_functional as tf

            g = t.Generator().manual_seed(3)
            x = t.randn(5, 77, generator=g)
            y = t.randint(0, 77, (5,), generator=g)
            return tf.logprobs_from_logits.__module__, tf.logprobs_from_logits(x, y)

        module, out = ray.get(score.remote(), timeout=240)
    finally:
        ray.shutdown()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 77, generator=g)
    y = torch.randint(0, 77, (5,), generator=g)
    assert module == "rl_logp.integrations.verl"
    assert torch.equal(out, rl_logp.logprobs(x, y, backend="chunked"))


def test_entropy_from_logits_is_patched_too(patched):
    import verl.utils.torch_functional as tf

    x = torch.randn(6, 301)
    assert torch.equal(tf.entropy_from_logits(x), rl_logp.entropy(x))
    assert torch.equal(tf.entropy_from_logits_with_chunking(x, chunk_size=2), rl_logp.entropy(x))


def test_fsdp_engine_temperature_step_then_logprobs_give_the_contract_bits():
    """verl 0.9.1's FSDP engine: `_scale_logits_by_temperature` then `logprobs_from_logits`, as its forward
    calls them (fp32 per-token temperature, bf16 logits). Unpatched it divides by bf16(T); patched it
    scores the contract's fp32(x) / T."""
    engine = importlib.import_module(adapter.VERL_FSDP_ENGINE)
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(96, 1031, generator=gen) * 3).to(torch.bfloat16)
    y = torch.randint(0, 1031, (96,), generator=gen)
    t = torch.full((96, 1), 0.7)
    want = rl_logp.logprobs(x, y, backend="chunked", temperature=0.7)

    def verl_forward() -> torch.Tensor:
        z = engine._scale_logits_by_temperature(x, t, is_unit_temperature=False)
        return engine.logprobs_from_logits(logits=z, labels=y, inplace_backward=True)

    stock = verl_forward()
    assert int((stock != want).sum()) > 48  # bf16(0.7) = 0.69921875: most rows move
    adapter.apply(backend="chunked")
    try:
        got = verl_forward()
        unit = engine._scale_logits_by_temperature(x, t, is_unit_temperature=True)
    finally:
        adapter.revert()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert unit is x
