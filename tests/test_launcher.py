"""CachedLauncher (kernels/launcher.py): its key refines Triton's specialization, and it launches what
`kernel[grid](*args, **options)` launches: under the interpreter here, through its fast path on a GPU, and
through its fast path on the CPU with Triton's driver and compiled kernel stood in for."""

import itertools
import random
import sys
import threading

import pytest
import torch
import triton
import triton.language as tl
from helpers import FakeDriver, triton_launcher_bytes, value_bytes
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource, CompiledKernel
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

from rl_logp.kernels import cuda_source
from rl_logp.kernels import launcher as launcher_module
from rl_logp.kernels.fixed_point import INTERPRET
from rl_logp.kernels.launcher import CachedLauncher, arg_key, driver_values

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
BACKEND = CUDABackend(GPUTarget("cuda", 90, 32))
FLAGS = list(itertools.product([False, True], repeat=3))  # Triton's (is_const, specialize, align)


def _tensors() -> list:
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8, torch.bool):
        base = torch.empty(64, dtype=dtype)
        out += [base, base[1:], base[2:], base[16:], base[32:]]  # aligned and misaligned views
    return [*out, torch.nn.Parameter(torch.empty(8)), torch.nn.Parameter(torch.empty(8))[1:]]


INTS = [0, 1, -1, 2, 15, 16, 17, 32, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1, 2**32, 2**63 - 16,
        2**63 - 1, 2**63, 2**63 + 1, 2**64 - 16, 2**64 - 1, -(2**31), -(2**31) - 1, -(2**31) - 16, -(2**63)]
SCALARS = [*INTS, True, False, 0.0, -0.0, 1.0, 1.5, 16.0, float("nan"), float("inf"), None]


def _groups(keys, values) -> dict:
    groups: dict = {}
    for key, value in zip(keys, values, strict=True):
        groups.setdefault(key, set()).add(value)
    return groups


@pytest.mark.parametrize("is_const,specialize,align", FLAGS)
def test_arg_key_refines_native_specialization(is_const, specialize, align):
    args = _tensors() + SCALARS
    keys = [arg_key([a], [False])[0] for a in args]
    native = [repr(native_specialize_impl(BACKEND, a, is_const, specialize, align)) for a in args]
    mixed = {k: v for k, v in _groups(keys, native).items() if len(v) > 1}
    assert not mixed, f"one key, several Triton specializations: {mixed}"
    # the key holds no pointer value, so tensors of one dtype and alignment share it (the cache is hit)
    assert len(set(keys)) < len(keys) - 20


@pytest.mark.parametrize("arg", [2**64, -(2**63) - 1, "text", torch.float32])
def test_arg_key_leaves_errors_to_triton(arg):
    assert arg_key([arg], [False]) is None  # the plain path, where Triton raises
    with pytest.raises((OverflowError, TypeError)):
        native_specialize_impl(BACKEND, arg, False, True, True)


def test_arg_key_leaves_other_types_to_triton():
    for arg in [(1, 2), (torch.empty(2),), 1j, torch.float32]:
        assert arg_key([arg], [False]) is None
    assert arg_key([torch.empty(1)], [True]) is None and arg_key([(1, 2)], [True]) is None


def test_arg_key_constexprs_refine_their_string():
    values = [*SCALARS, float("nan"), "1", "a", "a", 2**70]
    keys = [arg_key([v], [True])[0] for v in values]
    # Triton's cache key holds str(value); equal values of another type (1, True, 1.0) differ in it
    mixed = {k: v for k, v in _groups(keys, [(type(v), str(v)) for v in values]).items() if len(v) > 1}
    assert not mixed


def _probe(X, Y, n, m, k: tl.int64, s, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 0):
    pass


def test_key_refines_triton_cache_key_for_whole_calls():
    """Whole argument lists of a kernel with do_not_specialize, do_not_specialize_on_alignment and an
    annotated parameter: equal launcher keys give one Triton cache key (its binder and compute_cache_key)."""
    kernel = JITFunction(_probe, do_not_specialize=["m"], do_not_specialize_on_alignment=["Y"])
    binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
    constexpr = [p.is_constexpr for p in kernel.params]
    tensors, ints = [*_tensors()[:15], None], [0, 1, 16, 17, -1, 2**31, 2**32 + 16, 2**63]
    choices = [tensors, tensors, ints, ints, ints, [0.5, -0.0], [True, False, 1],
               [16, 32, 16.0, True, 1], [0, 1, None, "a", 0.0, -0.0, False]]
    rng, keys, triton_keys = random.Random(0), [], []
    for _ in range(3000):
        args = [rng.choice(c) for c in choices]
        options = rng.choice([{"num_warps": 4}, {"num_warps": 8}, {"num_warps": True}])
        _, spec, opts = binder(*args, **options, debug=False, instrumentation_mode="")
        keys.append((str(options), *arg_key(args, constexpr)))
        triton_keys.append(compute_cache_key({}, spec, opts))
    assert all(len(v) == 1 for v in _groups(keys, triton_keys).values())
    assert 100 < len(set(triton_keys)) <= len(set(keys))


class _Stream:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 777


class _Driver:
    active = _Stream()


def _stand_in_triton(kernel, launches: list) -> list:
    """JITFunction.run of Triton 3.6 with its compile and launch stood in for: the compiled kernel is the one
    Triton's binder and cache key pick, and its launcher records its arguments. Returns the list of keys
    of the calls that went through Triton."""
    binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
    compiled, calls = {}, []

    def run(*args, grid, warmup, **options):
        bound, spec, opts = binder(*args, **options, debug=False, instrumentation_mode="")
        key = compute_cache_key({}, spec, opts)
        calls.append(key)
        if key not in compiled:
            c = compiled[key] = CompiledKernel.__new__(CompiledKernel)
            c.function, c.packed_metadata, c.module, c._run = key, ("meta", key), object(), launches.append_args
        c = compiled[key]
        grid = (*grid, 1, 1)
        c.run(grid[0], grid[1], grid[2], 777, c.function, c.packed_metadata, None, None, None, *bound.values())
        return c

    kernel.run = run
    return calls


class _Launches(list):
    def append_args(self, *args):
        self.append(args)


class _Counted(tl.constexpr):
    compared = 0

    def __ne__(self, other):
        _Counted.compared += 1
        return super().__ne__(other)


def _stood_in_launcher(monkeypatch) -> tuple[JITFunction, CachedLauncher, _Launches, list]:
    """A CachedLauncher of `_probe` on its fast path, Triton's compile and launch stood in for: (the kernel,
    the launcher, the launches' arguments, the keys of the calls that went through Triton)."""
    monkeypatch.setattr(launcher_module, "INTERPRET", False)
    monkeypatch.setattr(launcher_module, "driver", _Driver)
    kernel = JITFunction(_probe, do_not_specialize=["m"])
    launches = _Launches()
    calls = _stand_in_triton(kernel, launches)
    return kernel, CachedLauncher(kernel), launches, calls


def test_fast_path_launches_what_triton_picks(monkeypatch):
    kernel, launch, launches, calls = _stood_in_launcher(monkeypatch)
    binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
    x, y = torch.empty(64), torch.empty(64, dtype=torch.bfloat16)
    opts = {"num_warps": 4}

    def check(grid, args, options=opts, through_triton=False) -> CompiledKernel:
        """One launch: through Triton or not, and the kernel, grid, stream and arguments Triton launches."""
        before = len(calls)
        compiled = launch(grid, args, options)
        assert len(calls) == before + through_triton
        bound, spec, opts_ = binder(*args, **options, debug=False, instrumentation_mode="")
        key = compute_cache_key({}, spec, opts_)
        assert compiled.function == key
        grid3 = (*grid, 1, 1)[:3]
        assert launches[-1] == (*grid3, 777, key, ("meta", key), None, None, None, *bound.values())
        return compiled

    base = (x, y, 16, 16, 5, 0.5, True, 32, 1)
    first = check((3,), base, through_triton=True)
    check((3,), base)
    check((4, 2), (torch.empty(32), torch.empty(8, dtype=torch.bfloat16), *base[2:]))  # new aligned tensors
    check((4, 2, 5), (x[1:], *base[1:]), through_triton=True)  # misaligned: a new specialization
    check((1,), (x[1:], *base[1:]))
    check((6, 1, 3), (x[1:], *base[1:]))
    for n, new in [(17, True), (1, True), (33, False), (16, False), (2**31, True), (None, True)]:
        check((2,), (x, y, n, *base[3:]), through_triton=new)
    # m is not specialized: new keys of the launcher (finer than Triton's), the kernel Triton had
    assert check((2,), (x, y, 16, 17, *base[4:]), through_triton=True) is first
    assert check((2,), (x, y, 16, 1, *base[4:]), through_triton=True) is first
    check((2,), base, {"num_warps": 8}, through_triton=True)
    check((2,), (*base[:7], 64, 1), through_triton=True)  # a constexpr changes
    check((2,), (*base[:7], 32.0, 1), through_triton=True)
    check((2,), base[:-1], through_triton=True)  # a parameter left to its default: Triton binds it
    check((2,), base[:-1], through_triton=True)
    assert (len(launch.cache), len(set(calls))) == (11, 10)  # the two for m are one of Triton's

    hook_calls = []
    knobs.runtime.launch_enter_hook.add(hook_calls.append)
    try:
        check((2,), base, through_triton=True)  # a launch hook: every launch through Triton
    finally:
        knobs.runtime.launch_enter_hook.remove(hook_calls.append)
    check((2,), base)
    kernel.add_pre_run_hook(lambda *args, **kwargs: None)
    check((2,), base, through_triton=True)
    kernel.pre_run_hooks.clear()
    with pytest.raises(OverflowError):
        launch((2,), (x, y, 2**64, *base[3:]), opts)

    scope = {"G": _Counted(5)}
    kernel.used_global_vals = {("G", id(scope)): (tl.constexpr(5), scope)}  # Triton keeps a deep copy
    check((2,), base)
    check((2,), base)
    scope["G"] = _Counted(5)  # another object, an equal value: as Triton, no error
    check((2,), base)
    check((2,), base)
    assert _Counted.compared == 2  # once per object
    for changed in (tl.constexpr(6), None):
        scope["G"] = changed
        with pytest.raises(RuntimeError, match="Global variable G has changed"):
            launch((2,), base, opts)
    del scope["G"]
    launch.globals_seen.clear()
    with pytest.raises(RuntimeError, match="Global variable G has changed"):
        launch((2,), base, opts)


@triton.jit
def _affine_kernel(X, OUT, ADD, n, s, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(X + offs, mask=mask) * 2 + s
    if ADD is not None:
        y += tl.load(ADD + offs, mask=mask)
    tl.store(OUT + offs, y, mask=mask)


DEVICE = "cuda" if HAS_CUDA else "cpu"
OPTIONS = {"num_warps": 4}


def _affine(launch, x, add, n, s, block=64) -> torch.Tensor:
    out = torch.full_like(x, -7.0)
    launch((triton.cdiv(n, block),), (x, out, add, n, s, block), OPTIONS)
    return out


def _expected(x, add, n, s) -> torch.Tensor:
    out = torch.full_like(x, -7.0)
    out[:n] = x[:n] * 2 + s + (0 if add is None else add[:n])
    return out


def _plain(grid, args, options):
    return _affine_kernel[grid](*args, **options)


def test_launcher_matches_plain_launch():
    """Under the interpreter (no CUDA) the launcher is the plain launch; on a GPU, first and cached calls."""
    launch = CachedLauncher(_affine_kernel)
    x, add = torch.randn(300, device=DEVICE), torch.randn(300, device=DEVICE)
    for n, a, s in [(300, None, 0.25), (300, add, -1.5), (200, add, 3.0), (300, None, 0.25)]:
        got = _affine(launch, x, a, n, s)
        assert torch.equal(got, _affine(_plain, x, a, n, s))
        assert torch.equal(got, _expected(x, a, n, s))
    assert len(launch.cache) == (0 if INTERPRET else 2)


def _counting(monkeypatch) -> tuple[CachedLauncher, list]:
    """A launcher and the list of the calls that went through Triton's JITFunction.run."""
    calls, run = [], _affine_kernel.run

    def counted(*args, **kwargs):
        calls.append(args[3])
        return run(*args, **kwargs)

    monkeypatch.setattr(_affine_kernel, "run", counted)
    return CachedLauncher(_affine_kernel), calls


@needs_cuda
def test_gpu_cache_hit_and_new_specializations(monkeypatch):
    launch, calls = _counting(monkeypatch)
    x, add = torch.randn(256, device="cuda"), torch.randn(256, device="cuda")
    first = launch((4,), (x, torch.empty_like(x), add, 256, 0.5, 64), OPTIONS)
    assert isinstance(first, CompiledKernel) and len(calls) == 1 and len(launch.cache) == 1
    for _ in range(3):
        assert torch.equal(_affine(launch, x, add, 256, 0.5), _expected(x, add, 256, 0.5))
    assert len(calls) == 1 and len(launch.cache) == 1
    # a misaligned view after aligned tensors of the same shape: a new specialization, correct results
    big = torch.randn(257, device="cuda")
    for view, a in [(big[1:], add), (big[1:], add), (big[:256], add)]:
        assert torch.equal(_affine(launch, view, a, 256, 0.5), _expected(view, a, 256, 0.5))
    assert len(calls) == 2 and len(launch.cache) == 2
    # an int argument 16, 17, 1: three specializations (multiple of 16, not, constexpr 1), each correct
    for n in (16, 17, 1, 16, 17, 1):
        assert torch.equal(_affine(launch, x, add, n, 0.5), _expected(x, add, n, 0.5))
    assert len(calls) == 4 and len(launch.cache) == 4
    assert torch.equal(_affine(launch, x, None, 256, 0.5), _expected(x, None, 256, 0.5))
    assert len(calls) == 5


@needs_cuda
def test_gpu_fast_path_same_bits_as_plain():
    launch = CachedLauncher(_affine_kernel)
    x, add = torch.randn(10_000, device="cuda") * 1e3, torch.randn(10_000, device="cuda")
    plain = _affine(_plain, x, add, 9_999, 1 / 3, block=256)
    for _ in range(3):  # the first call compiles, the others take the fast path
        assert torch.equal(_affine(launch, x, add, 9_999, 1 / 3, block=256), plain)
    assert len(launch.cache) == 1


@needs_cuda
def test_gpu_launch_hook_sees_every_launch(monkeypatch):
    launch, calls = _counting(monkeypatch)
    x = torch.randn(64, device="cuda")
    _affine(launch, x, None, 64, 1.0)
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert torch.equal(_affine(launch, x, None, 64, 1.0), _expected(x, None, 64, 1.0))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["_affine_kernel"] and len(calls) == 2


@needs_cuda
def test_gpu_graph_capture():
    launch = CachedLauncher(_affine_kernel)
    x, out = torch.randn(1000, device="cuda"), torch.zeros(1000, device="cuda")
    args = (x, out, None, 1000, 0.5, 128)
    launch((8,), args, OPTIONS)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch((8,), args, OPTIONS)
    x.copy_(torch.randn(1000, device="cuda"))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2 + 0.5) and len(launch.cache) == 1


def test_bound_launch_launches_what_the_launcher_does(monkeypatch):
    """A BoundLaunch gives Triton's launcher the arguments the CachedLauncher would, and declines (launching
    nothing) wherever the launcher's key would change; Triton's compile and launch stood in for."""
    kernel, launch, launches, calls = _stood_in_launcher(monkeypatch)
    x, y, opts = torch.empty(64), torch.empty(64, dtype=torch.bfloat16), {"num_warps": 4}
    base = (x, y, 16, 16, 5, 0.5, True, 32, 1)
    assert launch.bind((3,), base, opts, (0, 1)) is None  # nothing compiled yet
    launch((3,), base, opts)
    assert launch.bind((3,), base, opts, (0, 2)) is None  # a slot that holds no tensor
    bound = launch.bind((3,), base, opts, (0, 1))
    assert bound.args[:2] == [None, None]  # it keeps no tensor of the call it was bound from
    for new in [(torch.empty(64), torch.empty(32, dtype=torch.bfloat16)), (x[4:], y[8:]), (x, y)]:
        assert bound(new)
        via_bound = launches[-1]
        launch((3,), (*new, *base[2:]), opts)
        assert launches[-1] == via_bound
    assert len(calls) == 1

    def declines(tensors) -> bool:
        before = len(launches)
        return bound(tensors) is False and len(launches) == before

    assert declines((x[1:], y))  # another alignment
    assert declines((x, y[1:]))
    assert declines((x.half(), y))  # another dtype
    assert declines((torch.nn.Parameter(x), y))  # a subclass: the launcher's key differs
    knobs.runtime.launch_enter_hook.add(hook := lambda metadata: None)
    try:
        assert declines((x, y))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    kernel.add_pre_run_hook(lambda *args, **kwargs: None)
    assert declines((x, y))
    kernel.pre_run_hooks.clear()
    monkeypatch.setattr(_Stream, "get_current_device", lambda self: 1)  # another current device
    assert declines((x, y))
    monkeypatch.setattr(_Stream, "get_current_device", lambda self: 0)
    kernel.debug = True
    assert declines((x, y))
    kernel.debug = None
    assert bound((x, y)) and len(calls) == 1
    scope = {"G": tl.constexpr(5)}
    kernel.used_global_vals = {("G", id(scope)): (tl.constexpr(5), scope)}
    assert bound((x, y))
    scope["G"] = tl.constexpr(6)
    with pytest.raises(RuntimeError, match="Global variable G has changed"):
        bound((x, y))


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's launch (on a GPU: test_gpu_bound_launch)")
def test_bound_launch_under_the_interpreter_is_the_plain_launch():
    launch = CachedLauncher(_affine_kernel)
    x, out = torch.randn(300), torch.empty(300)
    launch((5,), (x, out, None, 300, 0.5, 64), OPTIONS)
    bound = launch.bind((5,), (x, out, None, 300, 0.5, 64), OPTIONS, (0, 1))
    for _ in range(2):
        x2, out2 = torch.randn(300), torch.full((300,), -7.0)
        assert bound((x2, out2)) and torch.equal(out2, _expected(x2, None, 300, 0.5))


@needs_cuda
def test_gpu_bound_launch():
    launch = CachedLauncher(_affine_kernel)
    x, out = torch.randn(1000, device="cuda"), torch.empty(1000, device="cuda")
    args = (x, out, None, 1000, 0.5, 128)
    launch((8,), args, OPTIONS)
    bound = launch.bind((8,), args, OPTIONS, (0, 1))
    for _ in range(3):
        x2, out2 = torch.randn(1000, device="cuda"), torch.full((1000,), -7.0, device="cuda")
        assert bound((x2, out2)) and torch.equal(out2, _expected(x2, None, 1000, 0.5))
    misaligned = torch.randn(1001, device="cuda")[1:]
    assert bound((misaligned, torch.empty(1000, device="cuda"))) is False
    assert len(launch.cache) == 1


@needs_cuda
def test_gpu_bound_launch_through_the_driver():
    """A bound launch through the CUDA driver (`DriverLaunch`) computes what Triton's launcher does, with
    and without the optional tensor, and declines a misaligned tensor."""
    launch = CachedLauncher(_affine_kernel)
    x, out, add = torch.randn(1000, device="cuda"), torch.empty(1000, device="cuda"), torch.randn(1000, device="cuda")
    for extra in (None, add):
        args = (x, out, extra, 1000, 0.5, 128)
        launch((8,), args, OPTIONS)
        slots = (0, 1) if extra is None else (0, 1, 2)
        bound = launch.bind((8,), args, OPTIONS, slots, direct=True)
        assert bound.through is not None
        for _ in range(3):
            x2, out2, add2 = torch.randn(1000, device="cuda"), torch.full((1000,), -7.0, device="cuda"), torch.randn(
                1000, device="cuda")
            tensors = (x2, out2) if extra is None else (x2, out2, add2)
            assert bound(tensors) and torch.equal(out2, _expected(x2, None if extra is None else add2, 1000, 0.5))
        misaligned = torch.randn(1001, device="cuda")[1:]
        assert bound((misaligned, *tensors[1:])) is False


def _compiled_probe(args, options):
    """`_probe` compiled for sm_90 as `kernel[grid](*args, **options)` would compile it (Triton's own
    compiler and ptxas, on the CPU)."""
    kernel = JITFunction(_probe, do_not_specialize=["m"])
    binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
    bound, spec, parsed = binder(*args, **options, debug=False, instrumentation_mode="")
    parsed, signature, constexprs, attrs = kernel._pack_args(BACKEND, options, bound, spec, parsed)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=BACKEND.target,
                          options=parsed.__dict__)


def test_driver_values_are_the_parameters_tritons_launcher_passes():
    """For kernels Triton compiled for sm_90 (on the CPU), `driver_values` packs exactly the bytes Triton's
    generated launcher passes: pointers, i32 / i64 / u64 integers, fp32 values rounded as Triton rounds them
    (NaN, -0.0, a subnormal, an overflow to inf), booleans; constexprs (the value 1, None) left out; the
    two scratch pointers last. Checked against the kernel's PTX parameters as well (or it returns None)."""
    x, y = torch.empty(64), torch.empty(64, dtype=torch.bfloat16)
    cases = [
        (x, y, 17, 16, 5, 0.5, True, 32, 1),
        (x[1:], y, 1, 2**31, -7, float("nan"), False, 16, 0),  # n = 1 a constexpr; m an i64
        (x, None, 2**40, -3, 2**62, -0.0, True, 64, 2),  # Y None: a constexpr
        (x, y, 2**63 + 5, 0, -(2**63), 1e-45, False, 32, 1),  # a u64
        (x, y, 33, 7, 1, 1e39, True, 32, 1),  # k = 1 is no constexpr: annotated tl.int64
    ]
    for args in cases:
        compiled = _compiled_probe(args, {"num_warps": 4})
        values = driver_values(compiled, args)
        assert values is not None, args
        assert value_bytes(values) == triton_launcher_bytes(compiled, args), args


def test_driver_values_decline_what_they_cannot_pack(monkeypatch):
    """None (Triton's launcher kept) for what the driver launch cannot pack, and wherever the installed
    Triton's own generated launcher would pass other parameters (another order, scratch pointers placed
    elsewhere) or reads otherwise."""
    from triton.backends.nvidia import driver as nvidia_driver

    args = (torch.empty(64), torch.empty(64, dtype=torch.bfloat16), 17, 16, 5, 0.5, True, 32, 1)
    compiled = _compiled_probe(args, {"num_warps": 4})
    assert driver_values(compiled, args) is not None
    real = nvidia_driver.make_launcher
    changes = {
        "two arguments swapped": lambda src: src.replace("{ &arg0, &arg1,", "{ &arg1, &arg0,"),
        "the scratch pointers first": lambda src: src.replace("{ &arg0,", "{ &global_scratch, &profile_scratch, &arg0,")
        .replace(", &global_scratch, &profile_scratch };", " };"),
        "a source of another shape": lambda src: src.replace("static void _launch(", "static void launch_kernel("),
    }
    try:
        for name, change in changes.items():
            monkeypatch.setattr(nvidia_driver, "make_launcher", lambda *a, change=change: change(real(*a)))
            launcher_module._triton_parameters.cache_clear()
            assert change(real({}, dict(enumerate(compiled.src.signature.values())), None)) != real(
                {}, dict(enumerate(compiled.src.signature.values())), None), name
            assert driver_values(compiled, args) is None, name
    finally:
        monkeypatch.undo()
        launcher_module._triton_parameters.cache_clear()
    assert driver_values(compiled, args) is not None
    wrong = [("a missing parameter", args[:-1]), ("an int where Triton compiled a pointer", (0, *args[1:]))]
    for name, changed in wrong:
        assert driver_values(compiled, changed) is None, name
    for field, value in [("global_scratch_size", 128), ("profile_scratch_size", 64), ("num_ctas", 2),
                         ("launch_cooperative_grid", True), ("launch_pdl", True)]:
        meta = compiled.metadata
        compiled.metadata = meta._replace(**{field: value})
        assert driver_values(compiled, args) is None, field
        compiled.metadata = meta
    ptx = compiled.asm["ptx"]
    compiled.asm["ptx"] = ptx.replace(".param .u32", ".param .u64", 1)  # a parameter of another size
    assert driver_values(compiled, args) is None
    compiled.asm["ptx"] = ptx


def test_bound_launch_through_the_driver_passes_what_tritons_launcher_would(monkeypatch):
    """`bind(..., direct=True)` of a kernel Triton compiled for sm_90: each call launches through the
    driver (over a model of it), in the device's primary context, with the grid, block, shared memory,
    stream and the parameter bytes of the new tensors that Triton's launcher would pass, and never
    through Triton's launcher; it declines as the launcher's key would (a misaligned tensor, a launch
    hook), and `direct=False` keeps Triton's launcher."""
    monkeypatch.setattr(launcher_module, "INTERPRET", False)
    monkeypatch.setattr(launcher_module, "driver", _Driver)
    fake = FakeDriver(current=None)  # a thread that has not used the device
    monkeypatch.setattr(cuda_source, "_driver", lambda: fake)
    monkeypatch.setattr(cuda_source, "_launch_driver", fake.untyped)
    cuda_source.primary_context.cache_clear()
    kernel = JITFunction(_probe, do_not_specialize=["m"])
    triton_launches, compiled_kernels = [], []

    def run(*args, grid, warmup, **options):
        compiled = _compiled_probe(args, options)
        compiled.module, compiled.function = object(), 0x2000  # loaded (stood in for)
        compiled._run = lambda *a: triton_launches.append(a)
        compiled.run(*grid, 1, 1, 777, compiled.function, compiled.packed_metadata, None, None, None, *args)
        compiled_kernels.append(compiled)
        return compiled

    kernel.run = run
    launch = CachedLauncher(kernel)
    x, y = torch.empty(64), torch.empty(64, dtype=torch.bfloat16)
    args, options = (x, y, 17, 16, 5, 0.5, True, 32, 1), {"num_warps": 4}
    launch((3, 2), args, options)
    bound = launch.bind((3, 2), args, options, (0, 1), direct=True)
    assert bound.through is not None and len(triton_launches) == 1
    for new_x, new_y in [(torch.empty(32), torch.empty(64, dtype=torch.bfloat16)), (x, y)]:
        expected = triton_launcher_bytes(compiled_kernels[0], (new_x, new_y, *args[2:]))
        fake.param_sizes = [len(b) for b in expected]
        assert bound((new_x, new_y))
        assert fake.launched[-1] == (0x2000, (3, 2, 1), (128, 1, 1), compiled_kernels[0].metadata.shared, 777,
                                     expected)
        assert fake.events[-1][:2] == ("launch", FakeDriver.PRIMARY) and fake.current is None
    assert len(triton_launches) == 1 and len(fake.launched) == 2
    assert bound((x[1:], y)) is False  # another alignment: another specialization
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    assert bound((x, y)) is False
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    plain = launch.bind((3, 2), args, options, (0, 1))
    assert plain.through is None and plain((x, y)) and len(triton_launches) == 2 and len(fake.launched) == 2
    # X None (a constexpr) before the one tensor left to each call: Y is the kernel's first parameter
    shifted = (None, y, 17, 16, 5, 0.5, True, 32, 1)
    launch((4,), shifted, {"num_warps": 2})
    bound = launch.bind((4,), shifted, {"num_warps": 2}, (1,), direct=True)
    new_y = torch.empty(64, dtype=torch.bfloat16)
    expected = triton_launcher_bytes(compiled_kernels[-1], (None, new_y, *shifted[2:]))
    fake.param_sizes = [len(b) for b in expected]
    assert bound((new_y,)) and fake.launched[-1][1:3] == ((4, 1, 1), (64, 1, 1)) and fake.launched[-1][5] == expected
    cuda_source.primary_context.cache_clear()


def test_bound_launch_through_the_driver_on_several_threads(monkeypatch):
    """Threads sharing one bound launch each launch their own tensors' pointers (each thread's parameter
    array is its own), switching threads as often as the interpreter can."""
    monkeypatch.setattr(launcher_module, "INTERPRET", False)
    monkeypatch.setattr(launcher_module, "driver", _Driver)
    fake = FakeDriver(current=FakeDriver.PRIMARY)
    monkeypatch.setattr(cuda_source, "_driver", lambda: fake)
    monkeypatch.setattr(cuda_source, "_launch_driver", fake.untyped)
    cuda_source.primary_context.cache_clear()
    kernel = JITFunction(_probe, do_not_specialize=["m"])

    def run(*args, grid, warmup, **options):
        compiled = _compiled_probe(args, options)
        compiled.module, compiled.function, compiled._run = object(), 0x2000, lambda *a: None
        return compiled

    kernel.run = run
    launch = CachedLauncher(kernel)
    args, options = (torch.empty(64), torch.empty(64, dtype=torch.bfloat16), 17, 16, 5, 0.5, True, 32, 1), {"num_warps": 4}
    launch((3,), args, options)
    bound = launch.bind((3,), args, options, (0, 1), direct=True)
    fake.param_sizes = [len(b) for b in triton_launcher_bytes(launch.cache[next(iter(launch.cache))][0], args)]
    tensors = [(torch.empty(64), torch.empty(64, dtype=torch.bfloat16)) for _ in range(4)]
    wrong = []

    def worker(x, y):
        want = [x.data_ptr().to_bytes(8, "little"), y.data_ptr().to_bytes(8, "little")]
        for _ in range(300):
            before = len(fake.launched)
            bound((x, y))
            mine = [entry for entry in fake.launched[before:] if entry[5][:2] == want]
            wrong.extend([] if mine else [(x.data_ptr(), before)])

    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=pair) for pair in tensors]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(0.005)
    launched = {bytes(b"".join(entry[5][:2])) for entry in fake.launched}
    assert len(fake.launched) == 4 * 300 and not wrong
    assert launched == {x.data_ptr().to_bytes(8, "little") + y.data_ptr().to_bytes(8, "little") for x, y in tensors}
    cuda_source.primary_context.cache_clear()
