"""Fail closed on every bypass of verl 0.9.1's FSDP step, strict or not (issue 22), and verl's fused heads routed
to `rl_logp.linear_logprobs` (issue 27).

verl's own `prepare_model_inputs`, a tiny Qwen2's forward and `prepare_model_outputs`
(`tests/verl_step/engine_step.py`) at T = 0.7, after `apply()`, with one of the sites the step reads
rebound (as another library wrapping verl's function, or a user, would), or an engine that refuses the
patch. Not strict: the step is bypassed, so the rebound site returns exactly what verl's own step returns
(the same function run unpatched, bit for bit), every consumer still rl-logp's scores the logits verl's own
temperature step returned, and a rebound fused head gives verl's own numbers. Strict: the step raises
`StrictModeError` naming the site. verl's fused kernels (`use_fused_kernels=True`), patched, give
`rl_logp.linear_logprobs`'s bits, strict or not. Before the fix, not strict, the rebound sites' outputs here
differed from stock verl's on 24 to 33 of 33 tokens (logp at T = 1; the tiny model's logits are small, so
by at most 0.125 nats; on lm_head-like logits a rebound `logprobs_from_logits` was up to 7.7 nats off).
"""

import functools
import gc
import logging

import pytest
import torch
import verl  # noqa: F401  (plain import: a broken verl install fails here instead of skipping)
import verl.utils.experimental.torch_functional as fused_torch
import verl.utils.torch_functional as tf
import verl.workers.engine.fsdp.transformer_impl as fsdp_engine
from helpers import HAS_CUDA, mismatches, needs_cuda
from verl_step import engine_step as es

import rl_logp
from rl_logp.integrations import verl as adapter
from rl_logp.integrations.verl_step import StrictModeError

T = 0.7
VERL_SCALE = fsdp_engine._scale_logits_by_temperature  # verl's own (the import of verl patched nothing)
VERL_ENTROPY = tf.entropy_from_logits
assert VERL_SCALE.__module__ == fsdp_engine.__name__, "RL_LOGP_BACKEND is set: run the tests without it"


def _wrapped(function):
    """What another library patching verl binds: a wrapper that calls verl's function."""
    return functools.wraps(function)(lambda *args, **kwargs: function(*args, **kwargs))


# id -> (where the step looks the site up (None: the step's engine), its name, verl's function bound there,
# the output it makes (None: all outputs are still rl-logp's), the step's flags)
REBOUND = {
    "logprobs_from_logits": (fsdp_engine, "logprobs_from_logits", tf.logprobs_from_logits, "log_probs", {}),
    "logprobs_from_logits-padded": (fsdp_engine, "logprobs_from_logits", tf.logprobs_from_logits, "log_probs",
                                    {"use_remove_padding": False}),
    "entropy_from_logits-padded": (tf, "entropy_from_logits", tf.entropy_from_logits, "entropy",
                                   {"use_remove_padding": False}),
    "calculate_sum_pi_squared_from_logits": (tf, "calculate_sum_pi_squared_from_logits",
                                             tf.calculate_sum_pi_squared_from_logits, "sum_pi_squared",
                                             {"calculate_sum_pi_squared": True}),
    "_scale_logits_by_temperature": (fsdp_engine, "_scale_logits_by_temperature", VERL_SCALE, None, {}),
    "engine.compute_entropy_from_logits": (None, "compute_entropy_from_logits", VERL_ENTROPY, "entropy", {}),
}


@pytest.fixture(scope="module")
def model():
    return es.make_model()


def _apply(strict: bool = False) -> None:
    gc.collect()  # no engine left over from another test is adopted (a fused one would refuse strict mode)
    adapter.apply(backend="chunked", strict=strict)


def _patched_then_stock(engine, batch, strict: bool, refusal: str):
    """One step with verl patched (by the caller), then, not strict, the same step unpatched:
    (outputs, logits, stock outputs). Strict: the step must raise `StrictModeError` matching `refusal`;
    returns None."""
    try:
        with torch.no_grad():
            if strict:
                with pytest.raises(StrictModeError, match=refusal):
                    es.run(engine, batch)
                return None
            got, logits = es.run(engine, batch)
            adapter.revert()
            return got, logits, es.run(engine, batch)[0]
    finally:
        adapter.revert()


def _on_verl_s_scaling(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """What rl-logp's consumers return in a bypassed step: rl-logp on verl's own scaled logits."""
    z = VERL_SCALE(logits, torch.full((logits.shape[0], 1), T), is_unit_temperature=False)
    return {"log_probs": rl_logp.logprobs(z, es.labels(), backend="chunked"),
            "entropy": rl_logp.entropy(z, backend="chunked")}


def _rebound_run(monkeypatch, engine, site: str, batch):
    """The step with `site` rebound to verl's function (wrapped), on an engine already adopted."""
    owner, attr, function, _, _ = REBOUND[site]
    with monkeypatch.context() as m:  # undone before revert: revert must not find the wrapper
        m.setattr(engine if owner is None else owner, attr, _wrapped(function))
        return es.run(engine, batch)


@pytest.mark.parametrize("site", list(REBOUND))
def test_a_site_rebound_after_apply_gets_verl_s_own_logits_not_strict(model, monkeypatch, caplog, site):
    _, attr, _, key, flags = REBOUND[site]
    batch = es.micro_batch(T, calculate_entropy=True, **flags)
    engine = es.make_engine(model)  # holds verl's entropy function; adopted by apply
    _apply()
    try:
        with torch.no_grad() if key == "sum_pi_squared" else torch.enable_grad():  # verl: Σπ² under no_grad
            es.run(engine, batch)
            with caplog.at_level(logging.WARNING, logger="rl_logp.verl"):
                got, logits = _rebound_run(monkeypatch, engine, site, batch)
            adapter.revert()
            stock, stock_logits = es.run(engine, batch)
    finally:
        adapter.revert()
    assert mismatches(logits, stock_logits) == 0  # the forward is verl's either way
    assert any(attr in r.getMessage() and "does not route through rl-logp" in r.getMessage() for r in caplog.records)
    want = _on_verl_s_scaling(logits)
    for name, value in got.items():
        assert mismatches(value, stock[name] if name == key else want[name]) == 0, name


@pytest.mark.parametrize("site", list(REBOUND))
def test_a_site_rebound_after_apply_raises_in_strict_mode(model, monkeypatch, site):
    _, attr, _, _, flags = REBOUND[site]
    batch = es.micro_batch(T, calculate_entropy=True, **flags)
    engine = es.make_engine(model)
    _apply(strict=True)
    try:
        with torch.no_grad():
            es.run(engine, batch)
            with pytest.raises(StrictModeError, match=attr):
                _rebound_run(monkeypatch, engine, site, batch)
    finally:
        adapter.revert()


def test_rebound_logp_gives_verl_s_own_gradient(model, monkeypatch):
    """Entropy off: logp is the step's only consumer, so the bypassed step is verl's own, backward included."""
    batch = es.micro_batch(T)

    def weight_grad(run) -> torch.Tensor:
        model.zero_grad()
        out, _ = run()
        out["log_probs"].sum().backward()
        return model.lm_head.weight.grad.clone()

    engine = es.make_engine(model)
    _apply()
    try:
        got = weight_grad(lambda: _rebound_run(monkeypatch, engine, "logprobs_from_logits", batch))
        adapter.revert()
        stock = weight_grad(lambda: es.run(engine, batch))
    finally:
        adapter.revert()
    assert mismatches(got, stock) == 0


def test_rebound_logp_with_entropy_checkpointing(model, monkeypatch):
    """The entropy is recomputed in the backward, outside the step: it scores verl's scaled logits there too."""
    batch = es.micro_batch(T, calculate_entropy=True)
    engine = es.make_engine(model, checkpointing=True)
    _apply()
    try:
        got, logits = _rebound_run(monkeypatch, engine, "logprobs_from_logits", batch)
        (got["log_probs"].sum() + got["entropy"].sum()).backward()
        adapter.revert()
        stock, _ = es.run(engine, batch)
    finally:
        adapter.revert()
    assert mismatches(got["log_probs"], stock["log_probs"]) == 0
    assert mismatches(got["entropy"], _on_verl_s_scaling(logits)["entropy"]) == 0


class FrozenEngine(fsdp_engine.FSDPEngineWithLMHead):
    """An engine that refuses attribute writes, so the adapter cannot patch its `compute_entropy_from_logits`."""

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is frozen")


@pytest.mark.parametrize("strict", [False, True], ids=["warn", "strict"])
def test_an_engine_that_refuses_the_patch_gets_verl_s_own_logits_or_raises(model, strict):
    batch = es.micro_batch(T, calculate_entropy=True)
    _apply(strict)
    # built after apply with verl's own function (as one built before it), adopted on its first step
    engine = es.make_engine(model, engine_cls=FrozenEngine, entropy=VERL_ENTROPY)
    ran = _patched_then_stock(engine, batch, strict, refusal=r"FrozenEngine\.compute_entropy_from_logits")
    if ran is None:
        return
    got, logits, stock = ran
    assert engine.compute_entropy_from_logits is VERL_ENTROPY
    assert mismatches(got["entropy"], stock["entropy"]) == 0
    assert mismatches(got["log_probs"], _on_verl_s_scaling(logits)["log_probs"]) == 0


def _fused_run(model, engine, batch):
    """es.run, plus the base model's hidden states and the labels the fused head scored (`shift_labels`
    with remove-padding, else the padded input ids rolled, as verl's fused forward does)."""
    seen = {}
    hooks = [model.model.register_forward_hook(lambda m, args, out: seen.__setitem__("hidden", out[0])),
             model.register_forward_pre_hook(lambda m, args, kwargs: seen.__setitem__("inputs", kwargs),
                                             with_kwargs=True)]
    try:
        got, logits = es.run(engine, batch)
    finally:
        for hook in hooks:
            hook.remove()
    inputs = seen["inputs"]
    labels = inputs.get("shift_labels")
    return got, logits, seen["hidden"], torch.roll(inputs["input_ids"], -1, -1) if labels is None else labels


def _packed(values: torch.Tensor) -> torch.Tensor:
    """[1, N] (remove-padding) or padded [B, S] per-token values as verl packs them: the valid tokens in order."""
    if values.shape[0] == 1:
        return values[0]
    mask = torch.arange(values.shape[1], device=values.device) < torch.tensor(es.LENGTHS, device=values.device)[:, None]
    return values[mask]


@pytest.mark.parametrize("rmpad", [True, False], ids=["rmpad", "padded"])
@pytest.mark.parametrize("backend", ["torch", "liger"])
@pytest.mark.parametrize("strict", [False, True], ids=["warn", "strict"])
def test_verl_s_fused_kernels_give_rl_logp_linear_logprobs_bits(backend, rmpad, strict):
    """verl's fused forward (`FusedLinearForPPO`; its "liger" backend is Liger's fused linear cross entropy
    where `liger_kernel` imports, else verl's torch implementation) scores the hidden states without
    materialising logits; patched, that head is `rl_logp.linear_logprobs`: logp and entropy are the bits of
    rl-logp on `linear_logits(hidden, lm_head.weight)` at T, strict mode included (nothing is bypassed).
    On a CUDA machine it runs there (Liger's kernels need it)."""
    device = "cuda" if HAS_CUDA else "cpu"
    model = es.make_model(fused_backend=backend, device=device)
    batch = es.micro_batch(T, device, calculate_entropy=True, use_fused_kernels=True, use_remove_padding=rmpad)
    gc.collect()
    cfg = adapter.apply(backend="chunked", strict=strict)
    try:
        engine = es.make_engine(model, fused=True)  # adopted on its first step
        with torch.no_grad():
            got, logits, hidden, labels = _fused_run(model, engine, batch)
    finally:
        adapter.revert()
    assert logits is None  # the lm_head never ran
    assert set(got) == {"log_probs", "entropy"}
    weight = model.lm_head.weight
    logp, ent = rl_logp.linear_logprobs(hidden, weight, labels, temperature=T, entropy=True, config=cfg)
    x = rl_logp.linear_logits(hidden, weight, config=cfg)
    unfused = rl_logp.logprobs_and_entropy(x, labels, temperature=T, config=cfg)
    for name, want, also in (("log_probs", logp, unfused[0]), ("entropy", ent, unfused[1])):
        assert mismatches(got[name], _packed(want)) == 0, name
        assert mismatches(want, also) == 0, name


VERL_FUSED_FORWARD = fused_torch.FusedLinearForPPO.forward


@pytest.mark.parametrize("strict", [False, True], ids=["warn", "strict"])
def test_a_fused_head_rebound_after_apply_gives_verl_s_own_numbers_or_raises(monkeypatch, caplog, strict):
    """`FusedLinearForPPO.forward` rebound after `apply` (to a wrapper of verl's own): not strict, the step
    warns and returns stock verl's numbers; strict, it raises naming the site."""
    model = es.make_model(fused_backend="torch")
    batch = es.micro_batch(T, calculate_entropy=True, use_fused_kernels=True)
    _apply(strict)
    engine = es.make_engine(model, fused=True)
    try:
        with torch.no_grad(), monkeypatch.context() as m:
            m.setattr(fused_torch.FusedLinearForPPO, "forward", _wrapped(VERL_FUSED_FORWARD))
            if strict:
                with pytest.raises(StrictModeError, match=r"FusedLinearForPPO\.forward"):
                    es.run(engine, batch)
                return
            with caplog.at_level(logging.WARNING, logger="rl_logp.verl"):
                got, _ = es.run(engine, batch)
    finally:
        adapter.revert()
    assert any("FusedLinearForPPO.forward" in r.getMessage() and "does not route through rl-logp" in r.getMessage()
               for r in caplog.records)
    with torch.no_grad():
        stock, _ = es.run(engine, batch)
    for name, value in got.items():
        assert mismatches(value, stock[name]) == 0, name


@pytest.mark.parametrize("liger", [False, pytest.param(True, marks=needs_cuda)], ids=["hf", "liger"])
@pytest.mark.parametrize("rmpad", [True, False], ids=["rmpad", "padded"])
def test_nothing_bypassed_strict_step_gives_the_contract_bits(rmpad, liger):
    """Nothing bypassed (with `actor_rollout_ref.model.use_liger=True` too: verl applies Liger to the model
    with `fused_linear_cross_entropy=False`, which swaps RoPE, RMSNorm and the SwiGLU MLP and leaves the
    logits to verl's step): strict mode runs, logp and entropy are rl-logp's on the lm_head's logits at T.
    Liger's Triton kernels need a CUDA GPU (its RMSNorm does not run under the Triton interpreter)."""
    device = "cuda" if liger else "cpu"
    model = es.make_model(device=device)
    if liger:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False, swiglu=True)  # as verl does
    gc.collect()
    cfg = adapter.apply(backend="auto", strict=True)
    try:
        engine = es.make_engine(model)
        with torch.no_grad():
            got, logits = es.run(engine, es.micro_batch(T, device, calculate_entropy=True, use_remove_padding=rmpad))
    finally:
        adapter.revert()
    y = es.labels(device)
    assert mismatches(got["log_probs"], rl_logp.logprobs(logits, y, temperature=T, config=cfg)) == 0
    assert mismatches(got["entropy"], rl_logp.entropy(logits, temperature=T, config=cfg)) == 0
