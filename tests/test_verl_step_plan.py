"""verl 0.9.1's own `FSDPEngineWithLMHead.prepare_model_outputs`, patched, on logits made like the lm_head
makes them (a matmul of a hidden-state leaf: non-leaf bf16 logits): the contract's bits for logp, entropy
and their gradients at T = 0.7 and 1, without a logits-sized temperature copy, with one rl-logp call for
logp and entropy, in-place backward only where nothing else reads the logits (verl's top-k distillation
does), remove-padding off and entropy checkpointing, Σπ², and the strict-mode audit.

The engine is `object.__new__(FSDPEngineWithLMHead)` with the attributes that method reads (engine config
flags, `compute_entropy_from_logits`, `use_ulysses_sp`); the micro-batch is a TensorDict shaped as
`prepare_model_inputs` leaves it (nested input_ids, non-tensor flags)."""

import functools
import logging
import types

import pytest
import torch
import verl  # noqa: F401  (plain import: a broken verl install fails here instead of skipping)
import verl.utils.torch_functional as tf
import verl.workers.engine.fsdp.transformer_impl as fsdp_engine
from helpers import mismatches
from verl.trainer.distillation.losses import distillation_ppo_loss
from verl.utils import tensordict_utils as tu
from verl.utils.experimental.torch_functional import FusedLinearForPPO

import rl_logp
from rl_logp.integrations import verl as adapter
from rl_logp.integrations.verl_step import StrictModeError

VERL_FUSED_FORWARD = FusedLinearForPPO.forward

VOCAB, HIDDEN, TOPK = 1031, 24, 4
LENGTHS = [9, 5, 12, 7]
VERL_SCALE = fsdp_engine._scale_logits_by_temperature  # verl's own (the import of verl patched nothing)
assert VERL_SCALE.__module__ == fsdp_engine.__name__, "RL_LOGP_BACKEND is set: run the tests without it"


def _engine(checkpointing: bool = False):
    engine = object.__new__(fsdp_engine.FSDPEngineWithLMHead)
    engine.engine_config = types.SimpleNamespace(
        entropy_checkpointing=checkpointing, entropy_from_logits_with_chunking=False, entropy_from_logits_chunk_size=2048
    )
    engine.compute_entropy_from_logits = torch.compile(tf.entropy_from_logits, dynamic=True)
    engine.model_config = types.SimpleNamespace(use_fused_kernels=False)
    engine.use_ulysses_sp = False
    return engine


class Step:
    """One micro-batch: hidden states (a leaf), lm_head weights, tokens, and verl's inputs for it."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.n = sum(LENGTHS)
        self.hidden = torch.randn(self.n, HIDDEN, generator=gen).to(dtype)
        self.weight = (torch.randn(HIDDEN, VOCAB, generator=gen) * 0.6).to(dtype)
        self.ids = torch.nested.nested_tensor(
            [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENGTHS], layout=torch.jagged
        )
        self.labels = torch.roll(self.ids.values(), shifts=-1, dims=0)
        self.teacher_ids = torch.randint(0, VOCAB, (self.n, TOPK), generator=gen)
        self.teacher_logp = torch.log_softmax(torch.randn(self.n, TOPK, generator=gen), dim=-1)

    def micro_batch(self, **flags):
        offsets = self.ids.offsets()
        nested = lambda v: torch.nested.nested_tensor_from_jagged(v, offsets)  # noqa: E731
        return tu.get_tensordict(
            tensor_dict={"input_ids": self.ids, "teacher_ids": nested(self.teacher_ids),
                         "teacher_logprobs": nested(self.teacher_logp)},
            non_tensor_dict={"use_remove_padding": True, **flags},
        )

    def output_args(self, temperature: float, rmpad: bool) -> dict:
        args = {"input_ids_rmpad_rolled": self.labels, "temperature_is_one": temperature == 1.0, "pad_size": 0}
        if rmpad:
            args["temperature_rmpad"] = torch.full((self.n,), temperature)
        else:
            args["temperature"] = torch.full((len(LENGTHS),), temperature)
        return args

    def logits(self, hidden: torch.Tensor, rmpad: bool) -> torch.Tensor:
        """What the lm_head returns: [1, nnz, V] packed, or [batch, longest, V] padded (left-aligned)."""
        x = hidden @ self.weight
        if rmpad:
            return x.unsqueeze(0)
        rows = torch.split(x, LENGTHS)
        return torch.stack([torch.nn.functional.pad(r, (0, 0, 0, max(LENGTHS) - len(r))) for r in rows])


def _distillation_processor(use_chunked_topk: bool):
    """verl's real top-k distillation logits processor (`distillation_ppo_loss` with `student_logits`)."""
    loss = types.SimpleNamespace(use_chunked_topk=use_chunked_topk, chunked_topk_chunk_size=16,
                                 log_prob_min_clamp=None, topk=TOPK)
    return functools.partial(distillation_ppo_loss, config=types.SimpleNamespace(strategy="fsdp2"),
                             distillation_config=types.SimpleNamespace(distillation_loss=loss))


def _run(step: Step, temperature: float, *, rmpad: bool = True, entropy: bool = True, distill: bool = False,
         chunked_topk: bool = True, checkpointing: bool = False, sum_pi: bool = False, backward: bool = True):
    """verl's prepare_model_outputs on fresh logits; returns (outputs, d(loss)/d hidden)."""
    hidden = step.hidden.clone().requires_grad_(True)
    flags = {"calculate_entropy": entropy, "distillation_use_topk": distill, "calculate_sum_pi_squared": sum_pi,
             "use_remove_padding": rmpad}
    out = _engine(checkpointing).prepare_model_outputs(
        types.SimpleNamespace(logits=step.logits(hidden, rmpad)), step.output_args(temperature, rmpad),
        step.micro_batch(**flags), _distillation_processor(chunked_topk) if distill else None,
    )
    values = {k: v.values() for k, v in out.items()}
    if backward:
        loss = values["log_probs"].sum()
        if entropy:
            loss = loss + 0.3 * values["entropy"].sum()
        if distill:
            loss = loss + values["distillation_losses"].sum()
        loss.backward()
    return values, hidden.grad


def _reference(step: Step, temperature: float, entropy: bool = True, materialised: bool = False):
    """rl-logp on the same logits, out of place: logp, entropy and d(logp + 0.3 H)/d hidden, through the
    graph the adapter builds: one `logprobs_and_entropy` node with T inside (remove-padding), or, where
    the temperature step materialises `fp32(x) / T` (no remove-padding, entropy checkpointing), separate
    logp and entropy nodes on that quotient."""
    hidden = step.hidden.clone().requires_grad_(True)
    x = hidden @ step.weight
    h = None
    if materialised:
        z = x.to(torch.float32) / torch.full((step.n, 1), temperature) if temperature != 1.0 else x
        logp = rl_logp.logprobs(z, step.labels)
        h = rl_logp.entropy(z) if entropy else None
    elif entropy:
        logp, h = rl_logp.logprobs_and_entropy(x, step.labels, temperature=temperature)
    else:
        logp = rl_logp.logprobs(x, step.labels, temperature=temperature)
    loss = logp.sum() if h is None else logp.sum() + 0.3 * h.sum()
    loss.backward()
    return logp.detach(), None if h is None else h.detach(), hidden.grad


@pytest.fixture
def patched():
    cfg = adapter.apply(backend="chunked")
    yield cfg
    adapter.revert()


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "no-entropy"])
@pytest.mark.parametrize("rmpad", [True, False], ids=["rmpad", "padded"])
def test_prepare_model_outputs_gives_the_contract_bits_and_gradients(patched, temperature, entropy, rmpad):
    step = Step()
    got, grad = _run(step, temperature, rmpad=rmpad, entropy=entropy)
    logp, h, want_grad = _reference(step, temperature, entropy, materialised=not rmpad)
    assert mismatches(got["log_probs"], logp) == 0
    if entropy:
        assert mismatches(got["entropy"], h) == 0
    assert mismatches(grad, want_grad) == 0


def test_stock_verl_differs_negative_control():
    adapter.revert()
    step = Step()
    got, _ = _run(step, 0.7, backward=False)
    logp, h, _ = _reference(step, 0.7)
    assert mismatches(got["log_probs"].float(), logp) > step.n // 2
    assert mismatches(got["entropy"].float(), h) > step.n // 2


def test_temperature_is_deferred_one_call_serves_logp_and_entropy_no_copy(patched, monkeypatch):
    """Remove-padding, T = 0.7, entropy on: rl-logp gets the lm_head's bf16 logits themselves (same
    storage: no fp32 / bf16 quotient materialised) with T per row, once for logp and entropy, in place."""
    calls = []
    combined = rl_logp.logprobs_and_entropy

    def spy(logits, labels, **kwargs):
        calls.append((logits.dtype, logits.data_ptr(), kwargs["temperature"], kwargs["inplace_backward"]))
        return combined(logits, labels, **kwargs)

    monkeypatch.setattr(rl_logp, "logprobs_and_entropy", spy)
    monkeypatch.setattr(rl_logp, "logprobs", lambda *a, **k: pytest.fail("logprobs called beside the combined op"))
    monkeypatch.setattr(rl_logp, "entropy", lambda *a, **k: pytest.fail("entropy called beside the combined op"))
    step = Step()
    hidden = step.hidden.clone().requires_grad_(True)
    logits = step.logits(hidden, rmpad=True)
    _engine().prepare_model_outputs(types.SimpleNamespace(logits=logits), step.output_args(0.7, True),
                                    step.micro_batch(calculate_entropy=True), None)
    assert len(calls) == 1
    dtype, ptr, temperature, inplace = calls[0]
    assert dtype == torch.bfloat16 and ptr == logits.data_ptr()
    assert temperature.shape == (step.n,) and bool((temperature == 0.7).all())
    assert inplace is True


def test_in_place_backward_writes_into_the_logits_only_when_rl_logp_alone_reads_them(patched):
    step = Step()
    for entropy, distill in ((False, False), (True, False), (False, True), (True, True)):
        hidden = step.hidden.clone().requires_grad_(True)
        logits = step.logits(hidden, rmpad=True)
        before = logits.detach().clone()
        flags = {"calculate_entropy": entropy, "distillation_use_topk": distill}
        out = _engine().prepare_model_outputs(types.SimpleNamespace(logits=logits), step.output_args(1.0, True),
                                              step.micro_batch(**flags), _distillation_processor(True))
        loss = out["log_probs"].values().sum()
        if distill:
            loss = loss + out["distillation_losses"].values().sum()
        loss.backward()
        overwritten = not torch.equal(logits.detach(), before)
        assert overwritten == (not distill), (entropy, distill)


@pytest.mark.parametrize("chunked_topk", [True, False], ids=["use_chunked_topk", "log_softmax_topk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_distillation_top_k_is_a_bypassed_step_fed_by_verl_s_own_temperature_step(
    patched, chunked_topk, dtype, temperature
):
    """verl's top-k distillation processor reads the scaled logits, so the step is bypassed: verl's own
    temperature step (`x / bf16(T)` for bf16 logits) feeds both it and rl-logp's logp, scored out of place
    (the chunked top-k's logsumexp saves the fp32 logits), so the backward runs. The distillation losses
    are verl's own, bit for bit; logp and the gradient are those of the same graph built with verl's
    unpatched temperature step and rl-logp out of place."""
    step = Step(seed=3, dtype=dtype)
    got, grad = _run(step, temperature, distill=True, entropy=False, chunked_topk=chunked_topk)
    adapter.revert()
    stock, _ = _run(step, temperature, distill=True, entropy=False, chunked_topk=chunked_topk, backward=False)
    hidden = step.hidden.clone().requires_grad_(True)
    z = VERL_SCALE(hidden @ step.weight, torch.full((step.n, 1), temperature), is_unit_temperature=temperature == 1.0)
    logp = rl_logp.logprobs(z, step.labels)
    distilled = _distillation_processor(chunked_topk)(student_logits=z.unsqueeze(0), data=step.micro_batch())
    (logp.sum() + distilled["distillation_losses"].sum()).backward()
    assert mismatches(got["distillation_losses"], stock["distillation_losses"]) == 0
    assert mismatches(got["log_probs"], logp.detach()) == 0
    assert mismatches(grad, hidden.grad) == 0


def test_distillation_with_verl_s_in_place_flag_fails_negative_control():
    """What the adapter's rule prevents: verl passes inplace_backward=True here (entropy off); honoured
    on fp32 logits that the chunked top-k's logsumexp saved (in verl's order: distillation, then logp),
    autograd refuses the backward."""
    step = Step(seed=3, dtype=torch.float32)
    hidden = step.hidden.clone().requires_grad_(True)
    z = hidden @ step.weight
    distilled = _distillation_processor(True)(student_logits=z.unsqueeze(0), data=step.micro_batch())
    logp = rl_logp.logprobs(z, step.labels, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (logp.sum() + distilled["distillation_losses"].sum()).backward()


def test_entropy_checkpointing_recomputes_with_the_temperature_applied(patched):
    step = Step(seed=5)
    got, grad = _run(step, 0.7, checkpointing=True)
    logp, h, want_grad = _reference(step, 0.7, materialised=True)
    assert mismatches(got["log_probs"], logp) == 0
    assert mismatches(got["entropy"], h) == 0
    assert mismatches(grad, want_grad) == 0


def test_sum_pi_squared_is_batch_invariant_and_close_to_verl_s(patched):
    step = Step(seed=7)
    with torch.no_grad():
        got, _ = _run(step, 0.7, sum_pi=True, backward=False)
        logits = (step.hidden @ step.weight).double() / 0.7
        exact = torch.exp(torch.logsumexp(2 * logits, -1) - 2 * torch.logsumexp(logits, -1))
        assert torch.allclose(got["sum_pi_squared"].double(), exact, rtol=1e-5, atol=0)
        x = step.hidden @ step.weight
        alone = tf.calculate_sum_pi_squared_from_logits(x[:3])
        full = tf.calculate_sum_pi_squared_from_logits(x)
    assert mismatches(alone, full[:3]) == 0
    x = x.float().requires_grad_(True)
    with pytest.raises(RuntimeError, match="not differentiable under rl-logp"):
        tf.calculate_sum_pi_squared_from_logits(x)


def test_strict_mode_names_the_site_on_the_first_step_and_warns_once_otherwise(caplog, monkeypatch):
    step = Step()
    stock = tf.logprobs_from_logits
    adapter.apply(backend="chunked", strict=True)
    try:
        _run(step, 0.7)  # everything routed: runs
        with pytest.raises(StrictModeError, match=r"distillation top-k logits processor"):
            _run(step, 1.0, distill=True, entropy=False)
        with monkeypatch.context() as m:  # a binding changed after apply (another patcher, a reload)
            m.setattr(fsdp_engine, "logprobs_from_logits", stock)
            with pytest.raises(StrictModeError, match=r"transformer_impl\.logprobs_from_logits .*bound to "
                                                      r"verl\.utils\.torch_functional\.logprobs_from_logits"):
                _run(step, 0.7)
        with monkeypatch.context() as m:  # verl's own fused head: only steps with use_fused_kernels read it
            m.setattr(FusedLinearForPPO, "forward", VERL_FUSED_FORWARD)
            _run(step, 0.7)
            with pytest.raises(StrictModeError, match=r"FusedLinearForPPO\.forward .*bound to"):
                _engine().prepare_model_outputs(None, step.output_args(1.0, True),
                                                step.micro_batch(use_fused_kernels=True), None)
        adapter.apply(backend="chunked")
        with caplog.at_level(logging.WARNING, logger="rl_logp.verl"):
            _run(step, 1.0, distill=True, entropy=False)
            _run(step, 1.0, distill=True, entropy=False)
        warned = [r for r in caplog.records if "distillation top-k logits processor" in r.getMessage()]
        assert len(warned) == 1
    finally:
        adapter.revert()
