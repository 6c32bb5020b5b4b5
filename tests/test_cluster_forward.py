"""The cluster forward (`kernels/cluster_row_stats.cu`, one HBM read per row): its slicing, its
compilation for sm_90 on the CPU (NVRTC needs no GPU), its loading and launching through the driver
(over a model of the driver), the devices it applies to, its own source run on the CPU under an
emulation of the CUDA thread model (`emulation/`) against the contract's CPU path, also under
ThreadSanitizer and AddressSanitizer, and on a GPU of compute capability 9.0 or more
the Triton forward's bits in every output (one label or several per row, every column's logprob), in
eager calls, CUDA-graph replays and rollout plans, and the Triton path for the calls it does not take."""

import ctypes
import dataclasses
import os
import pathlib
import re
import struct
import subprocess
import tempfile

import numpy
import pytest
import torch
from helpers import (
    HAS_CUDA,
    PAIR_MISSING_T,
    FakeDriver,
    bits,
    engine_request,
    mismatches,
    model_like_logits,
    nearest_fp32,
    pair_misses,
    random_labels,
)

from rl_logp.kernels import cluster_launch, cuda_source, division_setup
from rl_logp.kernels.launch import LaunchConfig

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9.0 or more (thread block clusters)")


@pytest.mark.parametrize("element_size", [2, 4])
def test_cluster_slices_cover_the_row_in_whole_vectors(element_size):
    per_vector = 16 // element_size
    for vocab in (8, 24, 1000, 32000, 128256, 151936, 262144, 1 << 20):
        for slice_bytes in (16384, 49152, 98304):
            plan = cluster_launch.cluster_width(vocab, element_size, slice_bytes)
            if plan is None:  # 8 blocks cannot hold it
                assert -(-vocab // (8 * per_vector)) * per_vector * element_size > slice_bytes
                continue
            cluster, width = plan
            assert width % per_vector == 0 and width * element_size <= slice_bytes
            assert cluster * width >= vocab > cluster * (width - per_vector)  # the narrowest such slices
            fewer = [c for c in cluster_launch.CLUSTERS if c < cluster]
            assert all(-(-vocab // (c * per_vector)) * per_vector * element_size > slice_bytes for c in fewer)


def test_cluster_kernel_compiles_for_sm90_without_spills():
    """Every variant compiles with NVRTC for sm_90, in the registers its blocks per SM allow, without local
    memory (register spills), the copy wait with and without a suspend-time hint."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    source = cluster_launch.SOURCE.read_text()
    for threads, slice_bytes, wait_ns in ((256, 98304, 0), (512, 98304, 0), (256, 49152, 0), (256, 98304, 10**7)):
        limit = 65536 // (threads * cluster_launch.blocks_per_sm(slice_bytes, threads))
        for element in cluster_launch.ELEMENT_CODES.values():
            for entropy in (False, True):
                for temperature in (False, True):
                    options = cluster_launch.variant_options(element, 4, entropy, temperature, threads, slice_bytes,
                                                             wait_ns)
                    cubin = cuda_source.compile_cubin(source, cluster_launch.KERNEL, "sm_90", options)
                    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                        f.write(cubin)
                        f.flush()
                        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                                               check=True).stdout
                    regs, local = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "LOCAL"))
                    assert regs <= limit and local == 0, (options, regs, local)


# (field, a value refused, what the error says, a value taken): the copy wait's suspend-time hint is a
# 32-bit PTX operand; the kernel's reductions take whole warps and a block holds at most 1024 threads.
REFUSED_KNOBS = [("cluster_wait_ns", -1, r"must be in \[0, 2\^32\)", 10**7),
                 ("cluster_wait_ns", 1 << 32, r"must be in \[0, 2\^32\)", 10**7),
                 ("cluster_threads", 0, r"must be a multiple of 32 in \[32, 1024\]", 96),
                 ("cluster_threads", 100, r"must be a multiple of 32 in \[32, 1024\]", 96),
                 ("cluster_threads", 1056, r"must be a multiple of 32 in \[32, 1024\]", 96),
                 ("cluster_rows", -1, r"must be >= 0 \(rows; 0: never\)", 0),
                 ("cluster_rows_eager", -1, r"must be >= 0 \(rows; 0: never\)", 64)]


@pytest.mark.parametrize(("field", "value", "message", "taken"), REFUSED_KNOBS)
def test_cluster_knobs_the_kernel_cannot_take_are_refused_by_name(monkeypatch, field, value, message, taken):
    """A value of a cluster knob the kernel cannot take, from code or from RL_LOGP_FUSED_CONFIG, is an error
    naming the field, not a compile failure at the first launch, a launch failure or a wrong result."""
    from rl_logp.engines.fused import TUNING_VARIABLE, config_from_environment

    with pytest.raises(ValueError, match=rf"{field}={value} {message}"):
        LaunchConfig(**{field: value})
    monkeypatch.setenv(TUNING_VARIABLE, f'{{"{field}": {value}}}')
    with pytest.raises(ValueError, match=field):
        config_from_environment()
    monkeypatch.setenv(TUNING_VARIABLE, f'{{"{field}": {taken}}}')
    assert getattr(config_from_environment(), field) == taken


@pytest.mark.parametrize(("rows", "settings", "eager", "captured"), [
    (1, {}, True, False), (255, {}, True, False), (256, {}, True, True),
    (8, {"cluster_rows_eager": 16}, False, False), (16, {"cluster_rows_eager": 16}, True, False),
    (300, {"cluster_rows_eager": 0}, False, True), (4, {"cluster_rows": 4}, True, True),
    (300, {"cluster_rows": 0}, False, False), (300, {"two_pass": True}, False, False)])
def test_eager_and_captured_calls_take_the_cluster_forward_from_their_own_row_counts(monkeypatch, rows, settings,
                                                                                      eager, captured):
    """`cluster_min_rows`: eager calls from `cluster_rows_eager` rows (1 by default: any size), calls captured
    in a CUDA graph from `cluster_rows` (256), none with `cluster_rows` 0 or `two_pass`; an eager
    `row_stats` where the cluster forward applies launches it exactly from there, else the Triton kernel."""
    from rl_logp.kernels import launch

    cfg = LaunchConfig(**settings)
    assert [rows >= launch.cluster_min_rows(cfg, c) > 0 for c in (False, True)] == [eager, captured]
    taken = []
    monkeypatch.setattr(cluster_launch, "applies", lambda *args: True)
    monkeypatch.setattr(cluster_launch, "row_stats_cluster", lambda *args: taken.append("cluster"))
    monkeypatch.setattr(launch, "row_stats_launch", lambda *args: taken.append("triton"))
    x = torch.zeros(rows, 64)
    out = torch.empty(rows)
    launch.row_stats(x, None, 0, None, 1.0, 40, False, out, out, out, None, None, cfg)
    assert taken[-1] == ("cluster" if eager else "triton") and len(set(taken)) == 1


def test_a_compile_error_names_the_kernel_and_shows_the_log():
    with pytest.raises(RuntimeError, match=r"(?s)compilation of broken failed.*undefined_name"):
        cuda_source.compile_cubin('extern "C" __global__ void broken() { undefined_name(); }', "broken", "sm_90", [])


@pytest.fixture
def driver(monkeypatch):
    def use(**state):
        fake = FakeDriver(**state)
        monkeypatch.setattr(cuda_source, "_driver", lambda: fake)
        monkeypatch.setattr(cuda_source, "_launch_driver", fake.untyped)
        cuda_source.primary_context.cache_clear()
        return fake

    yield use
    cuda_source.primary_context.cache_clear()


@pytest.mark.parametrize("capturing", [False, True], ids=["eager", "capturing"])
@pytest.mark.parametrize("current", [None, FakeDriver.PRIMARY + 1, 0xBEEF], ids=["no context", "primary", "another"])
def test_a_kernel_loads_and_launches_in_the_devices_primary_context(driver, current, capturing):
    """A first use on a thread that has not used the device (no current context), on one where torch's is
    current, or where another context is, and inside a global-mode CUDA-graph capture: the module loads at
    once in the device's primary context, every launch runs there, and the thread's context and capture
    mode are what they were after each."""
    fake = driver(current=current, capturing=capturing)
    function = cuda_source.Function(b"cubin", "kernel", 98304, 1)
    primary = FakeDriver.PRIMARY + 1
    assert fake.events == [("load", primary), ("shared", 98304), ("function load", primary)]
    assert (fake.current, fake.mode, fake.stack) == (current, 0, [])
    function.launch(12, 256, 4096, 0x5, cuda_source.parameters([ctypes.c_int32(3)]))
    assert fake.events[-1] == ("launch", primary, 12, 256, 4096, 0x5)
    assert (fake.current, fake.mode, fake.stack) == (current, 0, [])


@pytest.mark.parametrize("current", [None, FakeDriver.PRIMARY + 1, 0xBEEF], ids=["no context", "primary", "another"])
def test_a_bound_kernel_launches_each_calls_pointers_in_the_primary_context(driver, current):
    """`BoundKernel`, a plan's repeated launch: each call launches in the device's primary context (the
    thread's context as it was after it) on the call's stream, with the call's pointers in the bound slots
    and the other parameters as bound, the driver's arguments ctypes objects of its exact types (the
    untyped model checks them); an empty grid launches nothing."""
    fake = driver(current=current)
    function = cuda_source.Function(b"cubin", "kernel", 98304, 1)
    values = [ctypes.c_void_p(0x10), ctypes.c_int32(-7), ctypes.c_void_p(0x20)]
    kernel = cuda_source.BoundKernel(function.handle, function.context, (12, 2, 1), 256, 98304, values, (0, 2))
    fake.param_sizes = [8, 4, 8]
    for stream, pointers in ((0x5, (0x100, 0x200)), (0, (0x300, 0x400))):
        kernel(stream, pointers)
        want = [pointers[0].to_bytes(8, "little"), struct.pack("<i", -7), pointers[1].to_bytes(8, "little")]
        assert fake.launched[-1] == (0x2000, (12, 2, 1), (256, 1, 1), 98304, stream, want)
        assert fake.events[-1][:2] == ("launch", FakeDriver.PRIMARY + 1)
        assert (fake.current, fake.stack) == (current, [])
    cuda_source.BoundKernel(function.handle, function.context, (0, 1, 1), 256, 98304, values, (0, 2))(0x5, (1, 2))
    assert len(fake.launched) == 2


def test_a_failed_load_names_the_driver_error_and_restores_the_thread(driver):
    fake = driver(current=None, load_result=700)
    with pytest.raises(RuntimeError, match=r"module load failed with error 700 \(CUDA_ERROR_UNKNOWN\)"):
        cuda_source.Function(b"cubin", "kernel", 1024, 0)
    assert (fake.current, fake.mode, fake.stack, fake.events) == (None, 0, [], [])


def _stats(x, labels, temperature, cluster_rows, full=False, **cfg):
    """Every output of one engine call (M, L, lse, logp, entropy, and with `full` every column's logprob)."""
    from rl_logp.engines.fused import FusedEngine

    engine = FusedEngine(dataclasses.replace(LaunchConfig(), cluster_rows=cluster_rows, **cfg))
    req = engine_request(x, labels, temperature, engine="fused", entropy=True)
    req.normalizer, req.full = True, full
    s = engine.row_stats(req)
    return [s.row_max, s.log_sum, s.lse, s.logp, s.entropy] + ([s.full] if full else [])


def _edge_rows(x, labels):
    vocab = x.shape[1]
    x[0] = 0.0  # M = 0: outside the reciprocal's range (div_rn), every term exactly 1
    x[1] = float("-inf")
    x[2, 5:] = float("-inf")
    x[3, 17] = float("nan")
    x[4, vocab - 1] = float("inf")
    x[5, : vocab // 2] = -1e30 if x.dtype == torch.float32 else -3e38 if x.dtype == torch.bfloat16 else -6e4
    labels[6], labels[7], labels[8], labels[9] = -100, vocab, vocab - 1, 0
    x[10] = torch.linspace(0.0, -110.0, vocab)  # every exp(z - M) down to 0, through fp32's subnormals


EMULATION = pathlib.Path(__file__).with_name("emulation")
_emulators: dict[tuple, pathlib.Path] = {}


SANITIZERS = {None: [], "thread": ["-g", "-fsanitize=thread"],
              "address": ["-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]}


def _emulator(directory, element, cluster, entropy, temperature, threads, sanitize, nan_term=None) -> pathlib.Path:
    """The kernel's source compiled for the CPU with `emulation/cluster_emulation.h` (every thread of a
    cluster a CPU thread), once per variant; `sanitize`: None, "thread" (ThreadSanitizer) or "address"
    (AddressSanitizer and UndefinedBehaviorSanitizer); `nan_term`: what the emulated conversion gives a NaN
    (None: the header's default, 2^63)."""
    key = (element, cluster, entropy, temperature, threads, sanitize, nan_term)
    if key not in _emulators:
        binary = directory / ("emulator_" + "_".join(str(k) for k in key))
        macros = cluster_launch.variant_options(element, cluster, entropy, temperature, threads, 98304)[1:]
        if nan_term is not None:
            macros.append(f"-DEMULATED_NAN_TERM={nan_term}ull")
        subprocess.run(["g++", "-std=c++20", "-O1", *SANITIZERS[sanitize], "-pthread", "-frounding-math", "-ffp-contract=off",
                        "-DCLUSTER_HOST_EMULATION", f'-DKERNEL_SOURCE="{cluster_launch.SOURCE}"', *macros,
                        f"-I{EMULATION}", str(EMULATION / "cluster_emulation_main.cpp"), "-o", str(binary)],
                       check=True, capture_output=True, text=True)
        _emulators[key] = binary
    return _emulators[key]


def _emulate(directory, x, labels, temperature, entropy, full, slice_bytes, threads, sanitize=None, nan_term=None):
    """The cluster kernel's outputs for a launch as `ClusterLaunch` makes it (M, L, lse, the labels' logp,
    entropy, every column's logprob), run on the CPU (under a sanitizer, `_emulator`: what it reports
    fails the run)."""
    n, vocab = x.shape
    cluster, width = cluster_launch.cluster_width(vocab, x.element_size(), slice_bytes)
    binary = _emulator(directory, cluster_launch.ELEMENT_CODES[x.dtype], cluster, entropy, temperature is not None,
                       threads, sanitize, nan_term)
    run_dir = pathlib.Path(tempfile.mkdtemp(dir=directory))
    x.contiguous().view(torch.uint8).numpy().tofile(run_dir / "x.bin")
    picks = 1 if labels is None or labels.dim() == 1 else labels.shape[1]
    if labels is not None:
        labels.contiguous().numpy().tofile(run_dir / "labels.bin")
    t = 1.0 if temperature is None else temperature
    t_hi, t_lo, t_division = division_setup.division(t, cluster_launch.MANTISSA_BITS[x.dtype])
    t_bits = [struct.unpack("<I", struct.pack("<f", v))[0] for v in (t, t_hi, t_lo)]
    run = subprocess.run([str(binary), str(run_dir), str(n), str(vocab), str(vocab * x.element_size()), str(picks),
                          *map(str, t_bits), str(t_division), str(vocab), str(width), str(int(labels is not None)),
                          str(int(full))],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-6000:]

    def read(name, *shape):
        return torch.from_numpy(numpy.fromfile(run_dir / f"{name}.bin", dtype=numpy.float32).reshape(shape))

    return [read("max", n), read("log_sum", n), read("lse", n),
            read("logp", *labels.shape) if labels is not None else None,
            read("ent", n) if entropy else None, read("full", n, vocab) if full else None]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, any NaN matching any NaN (on the CPU a NaN keeps its payload through max and
    subtraction; on a GPU every NaN comes out canonical)."""
    return bool(((bits(a) == bits(b)) | (a.isnan() & b.isnan())).all())


# (logits' dtype, temperature, entropy, threads per block, blocks per row): every variant's macros, each
# cluster size with each dtype, one warp and four warps per block.
EMULATED = [(dtype, temperature, entropy, threads, cluster)
            for dtype, clusters in ((torch.bfloat16, (2, 4, 8, 4)), (torch.float16, (8, 2, 4, 2)),
                                    (torch.float32, (4, 8, 2, 8)))
            for (temperature, entropy), cluster in zip(((False, False), (True, False), (False, True), (True, True)),
                                                       clusters, strict=True)
            for threads in ((32 if temperature and not entropy else 128 if temperature else 64)
                            if dtype == torch.float32 else 64,)]
# Three warps a block (a warp count that is not a power of two: `cluster_threads` may be any multiple of 32).
# The launch's own slices (`LaunchConfig`) at Qwen2's vocabulary: 4 blocks of 256 threads for bf16, 8
# blocks of 512 threads for fp32 (cluster None).
EMULATED += [(torch.bfloat16, True, False, 96, 4), (torch.bfloat16, True, True, 256, None),
             (torch.float32, False, False, 512, None)]


def _check_emulated(tmp_path_factory, dtype, temperatures, entropy, threads, cluster, sanitize=None, nan_term=None,
                    n_picks=5):
    """The emulated kernel against the chunked engine on the CPU, every output bit for bit (see the test
    below), for each temperature of `temperatures`; `n_picks` labels a row in the rows of several."""
    size = torch.tensor([], dtype=dtype).element_size()
    per_vector = 16 // size
    # Slices without columns: 24 columns in 4 slices of 8 (the last empty); 72 in 8 of 16 (the last three,
    # the first of which starts at column 80).
    shapes = [(12, 1000), *{4: [(3, 24)], 8: [(3, 72)]}.get(cluster, [])] if cluster else [(3, 151936)]
    for n, vocab in shapes:
        if cluster:
            slice_bytes = -(-vocab // (cluster * per_vector)) * per_vector * size  # the narrowest slices
            assert cluster_launch.cluster_width(vocab, size, slice_bytes)[0] == cluster
        else:
            slice_bytes = LaunchConfig().cluster_slice_bytes
        x = model_like_logits(n, vocab, dtype, "cpu", seed=vocab + (cluster or 0))
        labels = random_labels(n, vocab, "cpu", seed=cluster or 0)
        if n > 10:
            _edge_rows(x, labels)
        picks = torch.cat([labels[:, None], random_labels(n * (n_picks - 1), vocab, "cpu", seed=2).view(n, -1)], dim=1)
        picks[:, 1] = -100
        _assert_emulated_bits(tmp_path_factory, x, labels, picks, temperatures, entropy, slice_bytes, threads, sanitize,
                              nan_term)


def _assert_emulated_bits(tmp_path_factory, x, labels, picks, temperatures, entropy, slice_bytes, threads,
                          sanitize=None, nan_term=None):
    """The emulated kernel's outputs on `x` and the chunked engine's, bit for bit, at each temperature: with
    one label a row (`labels`), several (`picks`), and several with every column's logprob."""
    from rl_logp.engines import make_engine

    directory = tmp_path_factory.getbasetemp() / "cluster_emulation"
    directory.mkdir(exist_ok=True)
    engine = make_engine("chunked", 1 << 28)
    for t in temperatures:
        for ids, full in ((labels, False), (picks, False), (picks, True)):
            req = engine_request(x, ids, t, engine="chunked", entropy=True)
            req.normalizer, req.full = True, full
            s = engine.row_stats(req)
            want = [s.row_max, s.log_sum, s.lse, s.logp, s.entropy, s.full]
            got = _emulate(directory, x, ids, t, entropy, full, slice_bytes, threads, sanitize, nan_term)
            for name, a, b in zip(("M", "L", "lse", "logp", "entropy", "full"), got, want, strict=True):
                if a is not None:
                    assert _same(a, b), (name, x.shape[1], t, full, int((bits(a) != bits(b)).sum()))


@pytest.mark.parametrize(("dtype", "temperature", "entropy", "threads", "cluster"), EMULATED,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_cluster_kernel_run_on_the_cpu_gives_the_contracts_bits(tmp_path_factory, dtype, temperature, entropy,
                                                                 threads, cluster):
    """The kernel's own source, built for the CPU with its threads as CPU threads (the barriers, shuffles
    and pushes into a peer's shared memory emulated; `expf` the contract's CPU exponential), against the
    contract's CPU path (the chunked engine), bit for bit in every output: rows with M = 0, all -inf,
    mostly -inf, NaN, +inf and huge magnitudes, labels outside the vocabulary, one label per row, five
    (a rollout's columns), and five with every column, temperatures inside and outside the reciprocal's range, vocabularies that leave
    blocks of the cluster without columns, and the launch's own slices at a model's vocabulary."""
    _check_emulated(tmp_path_factory, dtype, (0.7, 1.3, 2.0**-11, 0.1) if temperature else (None,), entropy, threads,
                    cluster)


@pytest.mark.parametrize("nan_term", [0, 1 << 62, (1 << 64) - 1], ids=["0", "2^62", "2^64-1"])
def test_masked_columns_entropy_terms_drop_out_whatever_the_gpu_converts_a_nan_to(tmp_path_factory, nan_term):
    """Where the kernel's entropy factor skips min(nd, 200), a masked column's term is the conversion of
    0 * inf = NaN, which the GPU defines: where it gives 0 or 2^63 (the emulation's default) the sum's
    bit 63, cleared, takes those terms out; where it gives anything else the kernel keeps the min. Either
    way the contract's bits, on rows of -inf columns among the others (fails if the kernel drops the min
    whatever the conversion gives, or keeps bit 63)."""
    _check_emulated(tmp_path_factory, torch.bfloat16, (None, 0.7), True, 64, 4, nan_term=nan_term)


def test_rows_with_more_labels_than_threads_keep_the_contracts_bits(tmp_path_factory):
    """Block 0's threads load their first label and its logit at the block's start and any further ones
    (labels past the block's threads) at the row's end: 40 labels a row for 32 threads, both kinds of
    load in one row, bit for bit."""
    _check_emulated(tmp_path_factory, torch.bfloat16, (None, 0.7), True, 32, 2, n_picks=40)


def test_the_division_set_ups_fma_rounds_the_exact_sum_where_fp64_cannot_hold_it():
    """`division_setup`'s fp32 fma: sums whose fp64 rounding lands on a midpoint of two fp32 values (the
    addend lost below fp64's last bit) round as the exact sum does, up or down; others as fp64 rounds them
    (exact rational arithmetic, `nearest_fp32`, is the reference)."""
    from fractions import Fraction

    a = numpy.array([1 + 2.0**-24, 1 + 2.0**-24, 1 + 3 * 2.0**-24, 1 + 3 * 2.0**-24, 1.5, 1 + 2.0**-24])
    b = numpy.array([2.0**-60, -(2.0**-60), 2.0**-60, -(2.0**-60), 2.0**-30, 0.0])
    got = division_setup._fma_fp32(a, b)
    want = [float(nearest_fp32(Fraction(x) + Fraction(y))) for x, y in zip(a, b, strict=True)]
    assert got.tolist() == want == [1 + 2.0**-23, 1.0, 1 + 2.0**-22, 1 + 2.0**-23, 1.5, 1.0]


def test_a_temperature_whose_quotients_the_pair_misses_gets_the_ieee_quotients(tmp_path_factory):
    """fp16 logits at a T where `row_divisor`'s pair misses one significand's IEEE quotient of 1024
    (`pair_misses`, exact arithmetic): the host's set-up (`division_setup`) checks every significand and
    refuses the pair, so every thread divides otherwise; two warps a block, rows holding every fp16
    significand at several exponents and both signs, labels on the missed one, bit for bit in every output
    (fails if the check covers only the first 32 significands: checked by mutation)."""
    assert pair_misses(PAIR_MISSING_T, 10) == [349]
    significands = 1.0 + torch.arange(1024, dtype=torch.float32) / 1024
    x = torch.stack([torch.cat([significands * 2.0 ** (r - 2), -significands * 2.0 ** (r - 5)]) for r in range(6)])
    x = x.to(torch.float16)
    labels = torch.full((6,), 349)
    picks = torch.stack([labels, torch.full((6,), 1024 + 349), random_labels(6, 2048, "cpu", seed=5)], dim=1)
    _assert_emulated_bits(tmp_path_factory, x, labels, picks, (PAIR_MISSING_T,), False, 2048, 64)  # 2 blocks a row


SANITIZED = [(torch.bfloat16, True, True, 64, 4), (torch.float16, True, False, 32, 2), (torch.float32, False, True, 64, 8)]


@pytest.mark.parametrize(("dtype", "temperature", "entropy", "threads", "cluster"), SANITIZED,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_cluster_kernel_synchronisation_has_no_data_race(tmp_path_factory, dtype, temperature, entropy, threads,
                                                         cluster):
    """The emulated kernel under ThreadSanitizer: every read of shared memory, its own block's or (through
    the pushes) its peers', is ordered after the write it reads by a barrier of its block or of the
    cluster, and no write overtakes a read it must follow (the emulation's barriers give exactly the
    ordering the kernel's `__syncthreads` and cluster barriers give; a barrier taken out of the kernel is
    reported as a race). The same outputs as without it."""
    _check_emulated(tmp_path_factory, dtype, (0.7,) if temperature else (None,), entropy, threads, cluster,
                    sanitize="thread")


@pytest.mark.parametrize(("dtype", "temperature", "entropy", "threads", "cluster"), SANITIZED,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_cluster_kernel_stays_inside_its_buffers(tmp_path_factory, dtype, temperature, entropy, threads, cluster):
    """The emulated kernel under AddressSanitizer and UndefinedBehaviorSanitizer, every buffer (the logits,
    labels, outputs, each block's slice and shared state) exactly its size: no access outside one (the
    last slice's columns, labels at the vocabulary's edge, every column's logprob of the last row) and no
    undefined arithmetic. The same outputs as without them."""
    _check_emulated(tmp_path_factory, dtype, (0.7,) if temperature else (None,), entropy, threads, cluster,
                    sanitize="address")


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("vocab", [151936, 128256, 32000, 1024, 262144])
def test_cluster_forward_gives_the_triton_bits(dtype, vocab):
    n = 37
    x = model_like_logits(n, vocab, dtype, "cuda", seed=vocab)
    labels = random_labels(n, vocab, "cuda", seed=vocab)
    _edge_rows(x, labels)
    fits = cluster_launch.cluster_width(vocab, x.element_size(), LaunchConfig().cluster_slice_bytes) is not None
    assert cluster_launch.applies(x, labels, False, 40, None, LaunchConfig().cluster_slice_bytes) == fits
    full = torch.empty(n, vocab, device="cuda")
    assert cluster_launch.applies(x, None, False, 40, full, LaunchConfig().cluster_slice_bytes) == fits
    picks = torch.cat([labels[:, None], random_labels(n * 4, vocab, "cuda", seed=1).view(n, 4)], dim=1)
    picks[:, 1] = -100
    for temperature in (None, 0.7, 1.3, 2.0**-11, 0.1):
        for ids, full in ((labels, False), (picks, False), (picks, True)):  # one label a row; five; with every column
            want = _stats(x, ids, temperature, 0, full)
            for cfg in ({}, {"cluster_threads": 512}, {"cluster_slice_bytes": 49152}, {"cluster_wait_ns": 10**7}):
                got = _stats(x, ids, temperature, 1, full, **cfg)
                for name, a, b in zip(("M", "L", "lse", "logp", "entropy", "full"), got, want, strict=False):
                    assert mismatches(a, b) == 0, (name, temperature, full, cfg)


@needs_hopper
def test_cluster_forward_replays_in_a_cuda_graph():
    x = model_like_logits(64, 151936, torch.bfloat16, "cuda", seed=1)
    labels = random_labels(64, 151936, "cuda", seed=1)
    eager = _stats(x, labels, 0.7, 1)
    static = x.clone()
    _stats(static, labels, 0.7, 1)  # compiled and loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _stats(static, labels, 0.7, 1)
    static.copy_(model_like_logits(64, 151936, torch.bfloat16, "cuda", seed=2))
    graph.replay()
    fresh = _stats(static, labels, 0.7, 0)
    for got, want, before in zip(captured, fresh, eager, strict=True):
        assert mismatches(got, want) == 0 and mismatches(got, before) > 0


@needs_hopper
def test_a_variant_first_used_inside_a_cuda_graph_capture_loads_there_and_replays():
    """No warm-up of the cluster forward: its compile and module load happen inside the capture (the
    thread's capture mode relaxed for the load) and the replay gives the Triton bits."""
    x = model_like_logits(64, 151936, torch.bfloat16, "cuda", seed=4)
    labels = random_labels(64, 151936, "cuda", seed=4)
    want = _stats(x, labels, 1.3, 0)  # the Triton path, loaded before the capture
    cluster_launch._function.cache_clear()
    static = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _stats(static, labels, 1.3, 1)
    assert cluster_launch._function.cache_info().currsize == 1
    static.copy_(x)
    graph.replay()
    for got, expected in zip(captured, want, strict=True):
        assert mismatches(got, expected) == 0


@needs_hopper
def test_calls_the_cluster_forward_cannot_take_keep_the_triton_bits():
    vocab = 151936
    x = model_like_logits(9, vocab + 8, torch.bfloat16, "cuda", seed=3)
    labels = random_labels(9, vocab, "cuda", seed=3)
    slice_bytes = LaunchConfig().cluster_slice_bytes
    cases = {
        "unaligned rows": (x[:, 1:vocab + 1], labels, None),
        "odd width": (x[:, : vocab + 3], labels, None),
        "int32 labels": (x[:, :vocab], labels.int(), None),
        "per-row temperature": (x[:, :vocab], labels, torch.linspace(0.5, 1.5, 9, device="cuda")),
    }
    unaligned_full = torch.empty(9 * vocab + 1, device="cuda")[1:].view(9, vocab)
    assert not cluster_launch.applies(x[:, :vocab], None, False, 40, unaligned_full, slice_bytes)
    assert not cluster_launch.applies(x[:, :vocab], labels.view(9, 1, 1), False, 40, None, slice_bytes)
    for name, (logits, ids, temperature) in cases.items():
        assert not cluster_launch.applies(logits, ids, isinstance(temperature, torch.Tensor), 40, None, slice_bytes), name
        for a, b in zip(_stats(logits, ids, temperature, 1), _stats(logits, ids, temperature, 0), strict=True):
            assert mismatches(a, b) == 0, name


@needs_hopper
def test_rollout_plans_take_the_cluster_forward_with_the_triton_bits(monkeypatch):
    """A rollout's calls (`logprobs`, `column_logprobs`, `full_logprobs`) repeated with new logits of one
    signature (a decode loop) bind the cluster launch as their plans (eager calls take it from
    `cluster_rows_eager` rows, 1 by default): every call launches it and gives the Triton bits (the calls
    with `cluster_rows` 0)."""
    import rl_logp
    from rl_logp import rollout_calls
    from rl_logp.engines import make_engine

    engine = make_engine("fused", rl_logp.resolve_config(None).chunk_bytes)
    launches = []  # a call's launch (`ClusterLaunch.run`) and a plan's (its `BoundKernel`)
    run, bound = cluster_launch.ClusterLaunch.run, cuda_source.BoundKernel.__call__
    monkeypatch.setattr(cluster_launch.ClusterLaunch, "run",
                        lambda self, params: launches.append(1) or run(self, params))
    monkeypatch.setattr(cuda_source.BoundKernel, "__call__",
                        lambda self, stream, pointers: launches.append(1) or bound(self, stream, pointers))
    saved = engine.config
    calls = {
        "logprobs": lambda x, ids, t: rl_logp.logprobs(x, ids[:, 0].contiguous(), backend="fused", temperature=t),
        "column_logprobs": lambda x, ids, t: rl_logp.column_logprobs(x, ids, backend="fused", temperature=t),
        "full_logprobs": lambda x, ids, t: rl_logp.full_logprobs(x, backend="fused", temperature=t),
    }
    for name, call in calls.items():
        for temperature in (None, 0.7):
            rollout_calls.clear()
            steps = [(model_like_logits(64, 151936, torch.bfloat16, "cuda", seed=s),
                      torch.randint(-1, 151937, (64, 21), generator=torch.Generator().manual_seed(s)).cuda())
                     for s in range(4)]
            engine.config = dataclasses.replace(saved, cluster_rows=0)
            try:
                want = [call(x, ids, temperature) for x, ids in steps]
            finally:
                engine.config = saved
            rollout_calls.clear()
            launches.clear()
            got = [call(x, ids, temperature) for x, ids in steps]
            assert len(launches) == len(steps) and len(rollout_calls._plans) == 1, name
            assert all(mismatches(a, b) == 0 for a, b in zip(got, want, strict=True)), (name, temperature)
    rollout_calls.clear()


def test_gpus_whose_blocks_cannot_hold_a_slice_keep_the_triton_kernel(monkeypatch):
    """`device_fits`: clusters (compute capability 9.0 or more) and a block's shared memory for the slice and
    its own beside it, as the device reports it (an H100/H200's 227 KB; 99 KB on a GPU such as sm_120's)."""
    import types

    devices = {0: (9, 0, 232448), 1: (8, 0, 166912), 2: (12, 0, 101376), 3: (10, 0, 232448)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(
        major=devices[index][0], minor=devices[index][1], shared_memory_per_block_optin=devices[index][2]))
    cluster_launch.device_fits.cache_clear()
    try:
        slice_bytes = LaunchConfig().cluster_slice_bytes
        assert [cluster_launch.device_fits(i, slice_bytes) for i in devices] == [True, False, False, True]
        assert cluster_launch.device_fits(2, 49152) and not cluster_launch.device_fits(2, 101376)
    finally:
        cluster_launch.device_fits.cache_clear()
