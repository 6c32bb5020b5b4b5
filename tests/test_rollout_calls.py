"""Rollout calls' plans (rl_logp/rollout_calls.py): a call whose signature was seen skips the set-up and gives
the bits of the ordinary path; any change of what the set-up reads takes the ordinary path (which checks
it); a bound launch that declines falls back; a plan keeps no tensor of a call alive. On the fused kernel
under Triton's interpreter here, through the compiled kernel on a GPU."""

import dataclasses
import gc
import weakref

import pytest
import torch
from helpers import bits, model_like_logits, needs_cuda

import rl_logp
from rl_logp import api, rollout_calls
from rl_logp.engines import fused_runs_on, make_engine

DEVICES = [pytest.param("cpu", id="fused-interpret-cpu",
                        marks=pytest.mark.skipif(not fused_runs_on(torch.device("cpu")),
                                                 reason="needs Triton's interpreter (TRITON_INTERPRET=1)")),
           pytest.param("cuda", id="fused-cuda", marks=needs_cuda)]


@pytest.fixture
def ordinary_calls(monkeypatch) -> list:
    """No plan at the start; the list of the calls that took the ordinary path (built a request)."""
    rollout_calls.clear()
    calls, request = [], api._request

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return request(*args, **kwargs)

    monkeypatch.setattr(api, "_request", counted)
    yield calls
    rollout_calls.clear()


def _inputs(n, vocab, dtype, device, seed):
    x = model_like_logits(n, vocab, dtype, device, seed=seed)
    ids = torch.randint(-1, vocab + 1, (n, 5), generator=torch.Generator().manual_seed(seed)).to(device)
    return x, ids


def _ordinary(fn, *args, **kwargs) -> torch.Tensor:
    """The call on the ordinary path alone (no plan is looked up or kept)."""
    with rollout_calls.ordinary_path():
        return fn(*args, **kwargs)


CALLS = {  # each function with a plan: (logits, ids [n, 5]) -> its arguments
    "logprobs": (rl_logp.logprobs, lambda x, ids: (x, ids[:, 0].contiguous())),
    "column_logprobs": (rl_logp.column_logprobs, lambda x, ids: (x, ids)),
    "full_logprobs": (rl_logp.full_logprobs, lambda x, ids: (x,)),
}


@pytest.mark.parametrize("temperature", [None, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_repeated_calls_take_the_plan_and_give_the_ordinary_bits(ordinary_calls, device, dtype, temperature):
    """Each function called again with new tensors of one signature takes its plan and gives the ordinary
    path's bits, each output a new contiguous fp32 tensor (a plan allocates every call's own)."""
    outs = []
    for seed in range(3):
        x, ids = _inputs(4, 5000, dtype, device, seed)
        for fn, args in CALLS.values():
            got = fn(*args(x, ids), backend="fused", temperature=temperature)
            assert torch.equal(bits(got), bits(_ordinary(fn, *args(x, ids), backend="fused", temperature=temperature)))
            assert got.is_contiguous() and got.dtype == torch.float32
            assert all(got.untyped_storage().data_ptr() != o.untyped_storage().data_ptr() for o in (*outs, x, ids))
            outs.append(got)
    assert len(ordinary_calls) == 3 + 3 * 3  # the first call of each function and the references
    assert len(rollout_calls._plans) == 3


@pytest.mark.parametrize("device", DEVICES)
def test_calls_given_a_config_alone_run_their_plan_before_resolving_options(ordinary_calls, device, monkeypatch):
    """`column_logprobs` and `full_logprobs` given a `LogpConfig` as their only option (how the vLLM adapter
    calls them at every decode step): a signature's first call takes `_rollout_scores` and keeps the plan,
    every later one runs the plan without it (no option resolved) and gives the ordinary path's bits, also
    on logits that require grad (neither output is differentiable); another config object is another
    signature."""
    cfg = rl_logp.resolve_config(None, backend="fused")
    scored, through = [], api._rollout_scores
    monkeypatch.setattr(api, "_rollout_scores", lambda *a, **k: scored.append(1) or through(*a, **k))
    took = []
    for seed in range(3):
        x, ids = _inputs(4, 5000, torch.float32, device, seed)
        for temperature in (None, 0.7):
            for name in ("column_logprobs", "full_logprobs"):
                fn, args = CALLS[name]
                want = _ordinary(fn, *args(x, ids), backend="fused", temperature=temperature)
                before = len(scored)
                got = fn(*args(x.requires_grad_(seed == 2), ids), config=cfg, temperature=temperature)
                took.append(len(scored) - before)
                assert torch.equal(bits(got), bits(want)) and not got.requires_grad, (name, seed, temperature)
    assert took == [1] * 4 + [0] * 8
    fn, args = CALLS["full_logprobs"]
    before = len(scored)
    fn(*args(x.detach(), ids), config=dataclasses.replace(cfg))
    assert len(scored) == before + 1 and len(rollout_calls._plans) == 5


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_plans_through_the_driver_give_the_ordinary_bits(ordinary_calls, dtype, monkeypatch):
    """With `LaunchConfig.driver` the plans launch Triton's compiled kernel through the CUDA driver
    (`launcher.DriverLaunch`): the ordinary path's bits for every call, temperature and batch (the cluster
    forward off, `cluster_rows` 0: at any size its eager calls would take its own launch)."""
    from rl_logp.kernels import launcher

    launches, through = [], launcher.DriverLaunch.__call__
    monkeypatch.setattr(launcher.DriverLaunch, "__call__", lambda self, *a: launches.append(1) or through(self, *a))
    engine = make_engine("fused", rl_logp.resolve_config(None).chunk_bytes)
    saved = engine.config
    engine.config = dataclasses.replace(saved, driver=True, cluster_rows=0)
    try:
        for n in (1, 4, 64):
            for seed in range(3):
                x, ids = _inputs(n, 5000, dtype, "cuda", seed)
                for temperature in (None, 0.7):
                    for fn, args in CALLS.values():
                        got = fn(*args(x, ids), backend="fused", temperature=temperature)
                        want = _ordinary(fn, *args(x, ids), backend="fused", temperature=temperature)
                        assert torch.equal(bits(got), bits(want)), (fn.__name__, n, temperature)
    finally:
        engine.config = saved
    assert len(launches) == 3 * 2 * 3 * 2  # every call after a signature's first: batches, temperatures, calls


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_to_differentiate_take_the_autograd_path(ordinary_calls, device):
    x, ids = _inputs(4, 3000, torch.float32, device, 0)
    labels = ids[:, 0].contiguous()
    with torch.no_grad():
        rl_logp.logprobs(x.requires_grad_(), labels, backend="fused")
    planned = rl_logp.logprobs(x.detach(), labels, backend="fused")
    assert len(rollout_calls._plans) == 1 and not planned.requires_grad
    logp = rl_logp.logprobs(x, labels, backend="fused")
    logp.sum().backward()
    assert logp.requires_grad and x.grad is not None and torch.equal(bits(logp.detach()), bits(planned))
    assert len(ordinary_calls) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_options_outside_the_signature_take_the_ordinary_path(ordinary_calls, device):
    """A vocab split without a group is an error, a baseline has no plan: after a plan, as before it."""
    x, ids = _inputs(4, 3000, torch.float32, device, 0)
    labels = ids[:, 0].contiguous()
    for _ in range(2):
        rl_logp.logprobs(x, labels, backend="fused")
    with pytest.raises(ValueError, match="pass tp_group with them"):
        rl_logp.logprobs(x, labels, backend="fused", vocab_start=0)
    for _ in range(2):
        baseline = rl_logp.logprobs(x, labels, backend="torch")
    assert torch.allclose(baseline, rl_logp.logprobs(x, labels, backend="fused"), atol=1e-5)
    assert len(rollout_calls._plans) == 1 and len(ordinary_calls) == 4


@pytest.mark.parametrize("device", DEVICES)
def test_a_changed_signature_takes_the_ordinary_path(ordinary_calls, device):
    x, ids = _inputs(4, 3000, torch.bfloat16, device, 0)
    rl_logp.column_logprobs(x, ids, backend="fused")
    wide = model_like_logits(4, 3100, torch.bfloat16, device, seed=1)
    changed = [
        (x[:3], ids[:3], {}),  # another shape
        (wide[:, :3000], ids, {}),  # other strides
        (x.float(), ids, {}),  # another dtype
        (x, ids, {"temperature": 0.5}),  # another temperature
        (x, ids[:, :2].contiguous(), {}),  # another number of columns
        (x, ids.to(torch.int32), {}),  # cast by the set-up: never a plan
        (x, ids.to(torch.int32), {}),
        (x, ids[:, :2], {}),  # strided columns, copied by the set-up: never a plan
        (x, ids[:, :2], {}),
        (x, ids, {"config": rl_logp.LogpConfig(backend="fused", fixed_point_bits=36)}),  # another config
    ]
    for logits, columns, kwargs in changed:
        before = len(ordinary_calls)
        kwargs = {"backend": "fused", **kwargs} if "config" not in kwargs else kwargs
        got = rl_logp.column_logprobs(logits, columns, **kwargs)
        assert len(ordinary_calls) == before + 1
        assert torch.equal(bits(got), bits(_ordinary(rl_logp.column_logprobs, logits, columns, **kwargs)))
    assert len(rollout_calls._plans) == 7  # the first call, and each change but the two copied


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_after_a_plan_still_raises(ordinary_calls, device):
    x, ids = _inputs(4, 3000, torch.bfloat16, device, 0)
    rl_logp.column_logprobs(x, ids, backend="fused")
    rl_logp.column_logprobs(x, ids, backend="fused")
    with pytest.raises(ValueError, match="columns have shape"):
        rl_logp.column_logprobs(x, ids[:3], backend="fused")
    with pytest.raises(TypeError, match="labels have dtype"):
        rl_logp.column_logprobs(x, ids.float(), backend="fused")
    with pytest.raises(ValueError, match="must be finite and > 0"):
        rl_logp.full_logprobs(x, backend="fused", temperature=-1.0)
    assert len(rollout_calls._plans) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_declined_launch_falls_back_to_the_ordinary_path(ordinary_calls, device):
    """The same signature with logits 4 bytes off a 16-byte boundary: the bound launch declines, the plan is
    bound anew to the call's alignment."""
    base = model_like_logits(1, 4 * 3000 + 1, torch.float32, device, seed=2)[0]
    aligned, shifted = base[:-1].view(4, 3000), base[1:].view(4, 3000)
    assert rollout_calls.signature(("full",), aligned) == rollout_calls.signature(("full",), shifted)
    for x in (aligned, aligned, shifted, aligned, shifted):
        got = rl_logp.full_logprobs(x, backend="fused")
        assert torch.equal(bits(got), bits(_ordinary(rl_logp.full_logprobs, x, backend="fused")))
    assert len(ordinary_calls) == 1 + 3 + 5  # the first call, the three after a change, the references


@pytest.mark.parametrize("device", DEVICES)
def test_new_launch_parameters_take_the_ordinary_path(ordinary_calls, device):
    """A plan declines once the engine's launch parameters are replaced; the call after binds them."""
    engine = make_engine("fused", rl_logp.resolve_config(None).chunk_bytes)
    x, ids = _inputs(4, 3000, torch.bfloat16, device, 0)
    want = rl_logp.column_logprobs(x, ids, backend="fused")
    saved = engine.config
    engine.config = dataclasses.replace(saved, chunk=1024)
    try:
        for _ in range(2):
            assert torch.equal(bits(rl_logp.column_logprobs(x, ids, backend="fused")), bits(want))
    finally:
        engine.config = saved
    assert torch.equal(bits(rl_logp.column_logprobs(x, ids, backend="fused")), bits(want))
    assert len(ordinary_calls) == 3 and len(rollout_calls._plans) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_plan_holds_no_tensor_of_a_call(ordinary_calls, device):
    x, ids = _inputs(4, 3000, torch.bfloat16, device, 0)
    out = rl_logp.column_logprobs(x, ids, backend="fused")
    refs = [weakref.ref(t) for t in (x, ids, out)]
    del x, ids, out
    gc.collect()
    assert all(r() is None for r in refs) and len(rollout_calls._plans) == 1


def test_plans_are_dropped_past_their_limit(ordinary_calls, monkeypatch):
    monkeypatch.setattr(rollout_calls, "MAX_PLANS", 2)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: Triton's interpreter (conftest)
    for n in (1, 2, 3):
        rl_logp.full_logprobs(model_like_logits(n, 300, torch.float32, device), backend="fused")
    assert len(rollout_calls._plans) == 1


def test_a_plan_of_several_outputs_allocates_each_fresh_and_a_declined_one_is_dropped():
    """A plan kept with a tuple of outputs (vLLM V1's gather: ids, logprobs, ranks) gives new tensors of each
    output's shape, dtype and device at every call, passed to its launch after the call's tensors in that
    order; a launch that declines gives None and drops the plan."""
    rollout_calls.clear()
    seen, answer = [], [True]

    def bound(tensors) -> bool:
        seen.append(tensors)
        return answer[0]

    x = torch.zeros(3, 5)
    first = (torch.empty(3, 2, dtype=torch.int32), torch.empty(3, 2), torch.empty(3, dtype=torch.int64))
    key = rollout_calls.signature(("several",), x)
    try:
        rollout_calls.remember(key, None, bound, first)
        outs = rollout_calls.run(key, (x,))
        again = rollout_calls.run(key, (x,))
        assert [(o.shape, o.dtype, o.device, o.is_contiguous()) for o in outs] == [
            (f.shape, f.dtype, f.device, True) for f in first]
        assert len({o.data_ptr() for o in (*outs, *again, *first)}) == 9  # every call's outputs its own
        assert seen[0][0] is x and all(a is b for a, b in zip(seen[0][1:], outs, strict=True))
        answer[0] = False
        assert rollout_calls.run(key, (x,)) is None and key not in rollout_calls._plans
    finally:
        rollout_calls.clear()


def test_the_chunked_engine_and_tensor_temperatures_have_no_plan(ordinary_calls):
    x, ids = _inputs(4, 300, torch.float32, "cpu", 0)
    for _ in range(2):
        rl_logp.column_logprobs(x, ids, backend="chunked")
        if fused_runs_on(torch.device("cpu")):
            rl_logp.column_logprobs(x, ids, backend="fused", temperature=torch.full((4,), 0.7))
    assert not rollout_calls._plans and len(ordinary_calls) == (4 if fused_runs_on(torch.device("cpu")) else 2)


@needs_cuda
def test_gpu_capture_takes_the_ordinary_path_and_replays_the_same_bits(ordinary_calls):
    x, ids = _inputs(8, 151936, torch.bfloat16, "cuda", 0)
    eager = rl_logp.column_logprobs(x, ids)
    rl_logp.column_logprobs(x, ids)  # the plan
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rl_logp.column_logprobs(x, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    before = len(ordinary_calls)
    with torch.cuda.graph(graph):
        captured = rl_logp.column_logprobs(x, ids)
    assert len(ordinary_calls) == before + 1
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(captured), bits(eager))
