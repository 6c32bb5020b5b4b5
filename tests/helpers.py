"""Shared pieces of the test suite: logits that look like a model's, bitwise comparisons, and the
backend/device matrix (CPU twins of the GPU tests run the same functions with other parameters)."""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import struct
from fractions import Fraction

import pytest
import torch

from rl_logp import fused_runs_on

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def invariant_targets() -> list:
    """(backend, device) pairs that claim invariance and can run here."""
    targets = [pytest.param("chunked", "cpu", id="chunked-cpu")]
    if fused_runs_on(torch.device("cpu")):
        targets.append(pytest.param("fused", "cpu", id="fused-interpret-cpu"))
    targets.append(pytest.param("chunked", "cuda", id="chunked-cuda", marks=needs_cuda))
    targets.append(pytest.param("fused", "cuda", id="fused-cuda", marks=needs_cuda))
    return targets


def model_like_logits(n: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """Logits with an LLM's spread: a few large values over a broad, shifted background."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, vocab, generator=gen) * 2.5 - 3.0
    hot = torch.randint(0, vocab, (n, max(1, vocab // 500)), generator=gen)
    x.scatter_(1, hot, torch.rand(hot.shape, generator=gen) * 12 + 4)
    return x.to(dtype).to(device)


def random_labels(n: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    return torch.randint(0, vocab, (n,), generator=gen).to(device)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a float tensor, for exact comparisons (NaN == NaN, -0 != +0)."""
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype]
    return t.detach().contiguous().view(view)


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of elements whose bits differ."""
    assert a.shape == b.shape and a.dtype == b.dtype
    return int((bits(a) != bits(b)).sum())


def _fp32_pattern(f: float | Fraction) -> int:
    """The bit pattern of f rounded to fp32 as struct rounds it (f's double, then to nearest)."""
    return struct.unpack("<i", struct.pack("<f", float(f)))[0]


def _fp32_value(pattern: int) -> Fraction:
    """The fp32 of a bit pattern, exactly."""
    return Fraction(struct.unpack("<f", struct.pack("<i", pattern))[0])


def nearest_fp32(q: Fraction) -> Fraction:
    """q rounded to the nearest fp32, ties to even (q positive, in fp32's normal range): of the pattern
    struct gives, within an ulp, and its two neighbours, the nearest."""
    near = _fp32_pattern(q)
    return _fp32_value(min((near - 1, near, near + 1), key=lambda p: (abs(_fp32_value(p) - q), p & 1)))


PAIR_MISSING_T = 1.9852384328842163  # an fp32 T whose fp16 quotients the pair misses on one significand


def pair_misses(t: float, fraction_bits: int) -> list[int]:
    """The significands 1 + i 2^-fraction_bits (bf16 7, fp16 10) whose quotient by T (fp32) the kernels'
    pair hi + lo ~ 1/T (`fixed_point.row_divisor`) misses: fl(x hi + fl(x lo)) != fl(x / T), in exact
    arithmetic with each fp32 rounding done as the GPU does it. hi: 1/T rounded, one ulp down where that is
    above 1/T; lo: (1 - hi T) / T rounded (hi 2^-30 where it is 0). The kernels must refuse the pair for
    any T with such a significand."""
    tq = _fp32_value(_fp32_pattern(t))
    recip = nearest_fp32(1 / tq)
    hi = recip if recip * tq <= 1 else _fp32_value(_fp32_pattern(recip) - 1)
    lo = nearest_fp32((1 - hi * tq) / tq) if hi * tq != 1 else hi / (1 << 30)
    return [i for i in range(1 << fraction_bits)
            if nearest_fp32((x := 1 + Fraction(i, 1 << fraction_bits)) * hi + nearest_fp32(x * lo))
            != nearest_fp32(x / tq)]


def logp_and_grad(logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """rl_logp.logprobs and d(sum logp)/d logits."""
    from rl_logp import logprobs

    x = logits.detach().clone().requires_grad_(True)
    out = logprobs(x, labels, **kwargs)
    out.sum().backward()
    return out.detach(), x.grad


def batch_sizes(limit: int) -> list[int]:
    """1..9, then 2^k - 1, 2^k, 2^k + 1 up to `limit`."""
    sizes = list(range(1, 10))
    k = 4
    while 2**k <= limit:
        sizes += [2**k - 1, 2**k, 2**k + 1]
        k += 1
    return sorted({s for s in sizes if s <= limit + 1})


def batch_invariance_mismatches(
    probes: torch.Tensor, probe_labels: torch.Tensor, fill: torch.Tensor, fill_labels: torch.Tensor,
    sizes: list[int], **kwargs,
) -> dict:
    """Score each probe row alone, then inside batches of every size at the front, middle and back.

    Returns counts of differing logp values and differing dlogits elements over all placements.
    """
    alone = [logp_and_grad(probes[i : i + 1], probe_labels[i : i + 1], **kwargs) for i in range(len(probes))]
    counts = {"placements": 0, "logp": 0, "dlogits": 0}
    for size in sizes:
        for p, position in enumerate(sorted({0, size // 2, size - 1})):
            i = p % len(probes)
            rows = fill[:size].clone()
            labels = fill_labels[:size].clone()
            rows[position] = probes[i]
            labels[position] = probe_labels[i]
            logp, grad = logp_and_grad(rows, labels, **kwargs)
            counts["placements"] += 1
            counts["logp"] += mismatches(logp[position : position + 1], alone[i][0])
            counts["dlogits"] += mismatches(grad[position : position + 1], alone[i][1])
    return counts


def random_cuts(vocab: int, pieces: int, seed: int) -> list[int]:
    """Uneven cut points 0 = c0 < c1 < ... < c_pieces = vocab (a piece may be one column)."""
    gen = torch.Generator().manual_seed(seed)
    inner = torch.randperm(vocab - 1, generator=gen)[: pieces - 1] + 1
    return [0, *sorted(int(c) for c in inner), vocab]


def engine_request(logits, labels=None, temperature=None, *, engine="chunked", entropy=False, bits=40,
                   start=0, vocab_total=None, chunk_bytes=1 << 28):
    """A `LogpRequest` for calling an engine directly; `start`/`vocab_total` place a vocabulary slice."""
    from rl_logp.request import LogpRequest
    from rl_logp.shard_layout import VocabShard
    from rl_logp.temperature import Temperature

    if temperature is None or isinstance(temperature, Temperature):
        temp = temperature or Temperature()
    elif isinstance(temperature, torch.Tensor):
        temp = Temperature(rows=temperature)
    else:
        temp = Temperature(scalar=temperature)
    shard = None
    if vocab_total is not None:
        shard = VocabShard(group=None, start=start, width=logits.shape[1], vocab_size=vocab_total,
                           comm_device=logits.device)
    return LogpRequest(logits, labels, temp, entropy, True, engine, bits, chunk_bytes,
                       torch.Size([logits.shape[0]]), False, shard)


def split_vocab_stats(engine, logits, labels, cuts, bits=40, temperature=None, entropy=False):
    """What the TP provider computes, with the all-reduces done in-process over vocabulary slices:
    (logp, entropy or None, d(sum logp + sum entropy)/d logits)."""
    from rl_logp import contract
    from rl_logp.engines import RowStats

    vocab = logits.shape[1]
    requests = [engine_request(logits[:, a:b], labels, temperature, engine=engine.name, entropy=entropy, bits=bits,
                               start=a, vocab_total=vocab) for a, b in itertools.pairwise(cuts)]
    row_max = torch.stack([contract.nan_as_inf(engine.shard_max(r)) for r in requests]).amax(dim=0)
    sums = [engine.shard_sums(r, row_max) for r in requests]
    fixed = torch.stack([s for s, _ in sums]).sum(dim=0)
    entropy_fixed = torch.stack([e for _, e in sums]).sum(dim=0) if entropy else None
    divisor = requests[0].temperature.divisor(slice(0, logits.shape[0]), logits.device)
    target = torch.stack(
        [contract.shard_target_logit(r.logits, labels - a, divisor) for r, a in zip(requests, cuts, strict=False)]
    ).sum(dim=0)
    log_sum, _, ent = contract.finalize(row_max, fixed, entropy_fixed, bits)
    logp = contract.assemble_logp(target, row_max, log_sum, labels, vocab)
    ones = torch.ones_like(logp)
    stats = RowStats(row_max=row_max, log_sum=log_sum, entropy=ent)
    grads = []
    for r in requests:
        out = torch.empty_like(r.logits)
        engine.grad(r, stats, ones, ones if entropy else None, out)
        grads.append(out)
    return logp, ent, torch.cat(grads, dim=1)


def make_engine(backend: str, chunk_bytes: int = 1 << 28):
    from rl_logp.engines import make_engine as make

    return make(backend, chunk_bytes)


class FakeDriver:
    """The CUDA driver calls `cuda_source` makes, modelled: a thread's current context and capture mode, a
    stream capture in progress (in the global mode, torch's default, it refuses a module load on every
    thread whose mode is not relaxed) and a record of the loads and launches."""

    PRIMARY = 0xC0

    def __init__(self, current=None, capturing=False, load_result=0):
        self.current, self.capturing, self.load_result = current, capturing, load_result
        self.mode, self.stack, self.events = 0, [], []
        self.param_sizes, self.launched = None, []

    def cuGetErrorName(self, result, ref):
        ref._obj.value = b"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED" if result == 900 else b"CUDA_ERROR_UNKNOWN"
        return 0

    def cuDeviceGet(self, ref, index):
        ref._obj.value = index
        return 0

    def cuDevicePrimaryCtxRetain(self, ref, device):
        ref._obj.value = self.PRIMARY + device.value
        return 0

    def cuCtxGetCurrent(self, ref):
        ref._obj.value = self.current
        return 0

    def cuCtxPushCurrent_v2(self, context):
        self.stack.append(self.current)
        self.current = context
        return 0

    def cuCtxPopCurrent_v2(self, ref):
        ref._obj.value, self.current = self.current, self.stack.pop()
        return 0

    def cuThreadExchangeStreamCaptureMode(self, ref):
        ref._obj.value, self.mode = self.mode, ref._obj.value
        return 0

    def cuModuleLoadData(self, ref, cubin):
        if self.capturing and self.mode != 2:
            return 900  # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        if self.load_result:
            return self.load_result
        self.events.append(("load", self.current))
        ref._obj.value = 0x1000
        return 0

    def cuModuleGetFunction(self, ref, module, name):
        ref._obj.value = 0x2000
        return 0

    def cuFuncSetAttribute(self, handle, attribute, value):
        self.events.append(("shared", value))
        return 0

    def cuFuncLoad(self, handle):
        self.events.append(("function load", self.current))
        return 0

    def cuLaunchKernel(self, handle, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        """Recorded: the context current, the grid's x (and with `param_sizes` set, the handle, the whole
        grid and block and each parameter's bytes, read at the launch as the driver reads them)."""
        self.events.append(("launch", self.current, gx, bx, shared, stream))
        if self.param_sizes is not None:
            assert len(params) == len(self.param_sizes)
            self.launched.append((handle, (gx, gy, gz), (bx, by, bz), shared, stream,
                                  [ctypes.string_at(p, n) for p, n in zip(params, self.param_sizes, strict=True)]))
        return 0

    def untyped(self) -> UntypedDriver:
        """This model as `cuda_source._launch_driver` gives the driver: no argument types set."""
        return UntypedDriver(self)


class UntypedDriver:
    """A `FakeDriver` called as libcuda without argument types (`cuda_source._launch_driver`): every argument
    must be a ctypes object of the driver's exact type (checked; ctypes would pass a Python int as a C int),
    which the model then reads as the typed calls' values."""

    LAUNCH_TYPES = (ctypes.c_void_p, *(ctypes.c_uint,) * 7, ctypes.c_void_p)

    def __init__(self, fake: FakeDriver) -> None:
        self.fake = fake

    def cuCtxGetCurrent(self, ref):
        assert type(ref._obj) is ctypes.c_void_p
        return self.fake.cuCtxGetCurrent(ref)

    def cuLaunchKernel(self, *args):
        assert len(args) == 11 and [type(a) for a in args[:9]] == list(self.LAUNCH_TYPES), args
        assert isinstance(args[9], ctypes.Array) and args[9]._type_ is ctypes.c_void_p and args[10] is None
        handle, *dims, stream, params, extra = args
        return self.fake.cuLaunchKernel(handle.value, *(d.value for d in dims), stream.value or 0, params, extra)


_C_FORMATS = {"CUdeviceptr": "<Q", "int8_t": "<b", "int16_t": "<h", "int32_t": "<i", "int64_t": "<q",
              "uint8_t": "<B", "uint16_t": "<H", "uint32_t": "<I", "uint64_t": "<Q"}


def triton_launcher_bytes(compiled, args) -> list[bytes]:
    """The bytes of each parameter Triton's own generated launcher passes `compiled` for `args`: its
    `_launch` declares a C type per argument that is not a constexpr, and its `params` array holds those
    and the global and profile scratch pointers (null: no scratch memory); floats travel as their fp32 or
    fp64 bits (`pack_fp32`: the value rounded to fp32)."""
    import numpy
    from triton.backends.nvidia.driver import make_launcher

    source = make_launcher(getattr(compiled.src, "constants", {}), dict(compiled.src.signature), None)
    declared = re.search(r"static void _launch\((.*?)\)", source).group(1).split(", ")
    c_types = dict(reversed(d.rsplit(" ", 1)) for d in declared)
    order = re.search(r"void \*params\[\] = \{ (.*?) \};", source).group(1).split(", ")
    assert order[-2:] == ["&global_scratch", "&profile_scratch"]
    types = list(compiled.src.signature.values())
    out = []
    for name in order[:-2]:
        i = int(name.removeprefix("&arg"))
        value, c_type = args[i], c_types[name[1:]]
        if types[i].startswith("*"):
            out.append(struct.pack("<Q", value.data_ptr()))
        elif types[i] in ("fp32", "f32"):
            with numpy.errstate(over="ignore"):  # C's (float)f: to nearest, inf beyond the range
                out.append(numpy.array(value, dtype="<f4").tobytes())
        elif types[i] == "fp64":
            out.append(struct.pack("<d", value))
        else:
            out.append(struct.pack(_C_FORMATS[c_type], value))
    return [*out, bytes(8), bytes(8)]


def value_bytes(values) -> list[bytes]:
    """The bytes of each ctypes value."""
    return [ctypes.string_at(ctypes.addressof(v), ctypes.sizeof(v)) for v in values]
