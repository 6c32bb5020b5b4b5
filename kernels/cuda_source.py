"""CUDA C++ kernels of this package: compiled from source by NVRTC, loaded and launched through the CUDA
driver, all through ctypes (no build step, no extension module).

`compile_cubin` needs only NVRTC, no GPU: it runs on a CPU-only machine as well (the compile tests). NVRTC
is found in the `nvidia` wheels' directories (`nvidia-cuda-nvrtc`, which CUDA builds of torch install)
or on the loader's path. `Function` (a kernel loaded into a device's primary context, torch's), its
`launch` and `launch_kernel`, and `BoundKernel` (the repeated launch of a plan: the cluster forward's,
and `launcher.DriverLaunch`'s of Triton's compiled kernels) need a GPU; they make that context current
where it is not (a thread that has not used the device yet) and load with this thread's stream-capture
mode relaxed, so that a first use inside a CUDA-graph capture works.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
import threading
from collections.abc import Iterator, Sequence

_NVRTC_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED


@functools.lru_cache(maxsize=1)
def _nvrtc() -> ctypes.CDLL:
    candidates = []
    try:
        import nvidia

        for root in nvidia.__path__:
            candidates += sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so.*")), reverse=True)
    except ImportError:
        pass
    for name in [c for c in candidates if ".alt." not in c] + list(_NVRTC_NAMES):
        try:
            # NVRTC opens its builtins library by name: one beside it (a wheel's) is loaded first.
            for builtins in glob.glob(os.path.join(os.path.dirname(name), "libnvrtc-builtins.so.*")):
                if ".alt." not in builtins:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise RuntimeError("rl_logp: NVRTC was not found (install nvidia-cuda-nvrtc, which CUDA builds of torch "
                       "bring, or put libnvrtc on the loader path): the cluster forward compiles with it")


def _nvrtc_check(lib: ctypes.CDLL, result: int, what: str, log: str = "") -> None:
    if result != 0:
        raise RuntimeError(f"rl_logp: NVRTC {what} failed: {lib.nvrtcGetErrorString(result).decode()}\n{log}")


def compile_cubin(source: str, name: str, arch: str, options: Sequence[str]) -> bytes:
    """The cubin of `source` for `arch` (e.g. "sm_90"), compiled with `options`; the kernel `name` must be
    extern "C" (its symbol is its name)."""
    lib = _nvrtc()
    program = ctypes.c_void_p()
    _nvrtc_check(lib, lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{name}.cu".encode(), 0,
                                             None, None), "program creation")
    try:
        flags = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in options)]
        result = lib.nvrtcCompileProgram(program, len(flags), (ctypes.c_char_p * len(flags))(*flags))
        log_size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(log_size))
        log = ctypes.create_string_buffer(log_size.value)
        lib.nvrtcGetProgramLog(program, log)
        _nvrtc_check(lib, result, f"compilation of {name}", log.value.decode(errors="replace"))
        size = ctypes.c_size_t()
        _nvrtc_check(lib, lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib, lib.nvrtcGetCUBIN(program, cubin), "cubin")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    """libcuda, the argument types of the functions used here set, the driver initialised."""
    cuda = ctypes.CDLL("libcuda.so.1")
    pointer = ctypes.POINTER(ctypes.c_void_p)
    cuda.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    cuda.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    cuda.cuDevicePrimaryCtxRetain.argtypes = [pointer, ctypes.c_int]
    cuda.cuCtxGetCurrent.argtypes = [pointer]
    cuda.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
    cuda.cuCtxPopCurrent_v2.argtypes = [pointer]
    cuda.cuThreadExchangeStreamCaptureMode.argtypes = [ctypes.POINTER(ctypes.c_int)]
    cuda.cuModuleLoadData.argtypes = [pointer, ctypes.c_char_p]
    cuda.cuModuleGetFunction.argtypes = [pointer, ctypes.c_void_p, ctypes.c_char_p]
    cuda.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
        ctypes.c_void_p, pointer, ctypes.c_void_p]
    _raise_on(cuda, cuda.cuInit(0), "initialisation")
    return cuda


@functools.lru_cache(maxsize=1)
def _launch_driver() -> ctypes.CDLL:
    """libcuda (initialised) with no argument types set: `BoundKernel` passes ctypes objects of the driver's
    exact types only, which ctypes hands on without converting each (about a microsecond less a launch)."""
    _driver()
    return ctypes.CDLL("libcuda.so.1")


def _raise_on(cuda: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        known = cuda.cuGetErrorName(result, ctypes.byref(name)) == 0 and name.value
        raise RuntimeError(f"rl_logp: the CUDA driver's {what} failed with error {result}"
                           + (f" ({name.value.decode()})" if known else ""))


def _check(result: int, what: str) -> None:
    _raise_on(_driver(), result, what)


@functools.cache
def primary_context(device_index: int) -> int:
    """The handle of the device's primary context (the one torch's runtime calls use), retained for the
    process."""
    cuda = _driver()
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check(cuda.cuDeviceGet(ctypes.byref(device), device_index), "device lookup")
    _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "primary context")
    return context.value


@contextlib.contextmanager
def current(context: int, relaxed_capture: bool = False) -> Iterator[None]:
    """`context` current on this thread within the block (pushed where another or none is), and with
    `relaxed_capture` this thread's stream-capture mode relaxed: a module load is among the calls that a
    capture in the global mode (torch's default) refuses on every thread."""
    cuda = _driver()
    now = ctypes.c_void_p()
    _check(cuda.cuCtxGetCurrent(ctypes.byref(now)), "current context")
    pushed = now.value != context
    if pushed:
        _check(cuda.cuCtxPushCurrent_v2(context), "context push")
    mode, exchanged = ctypes.c_int(_CAPTURE_MODE_RELAXED), False
    try:
        if relaxed_capture:
            _check(cuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)), "capture mode exchange")
            exchanged = True
        yield
    finally:
        if exchanged:
            _check(cuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)), "capture mode exchange")
        if pushed:
            _check(cuda.cuCtxPopCurrent_v2(ctypes.byref(now)), "context pop")


class Function:
    """A kernel loaded into the primary context of a device (torch's), its module kept alive; loaded at
    once, not at its first launch, so that a first launch inside a CUDA-graph capture loads nothing."""

    def __init__(self, cubin: bytes, name: str, dynamic_shared: int, device_index: int) -> None:
        cuda = _driver()
        self.context = primary_context(device_index)
        self.module, self.handle = ctypes.c_void_p(), ctypes.c_void_p()
        with current(self.context, relaxed_capture=True):
            _check(cuda.cuModuleLoadData(ctypes.byref(self.module), cubin), "module load")
            _check(cuda.cuModuleGetFunction(ctypes.byref(self.handle), self.module, name.encode()), "function lookup")
            if dynamic_shared > 48 * 1024:
                _check(cuda.cuFuncSetAttribute(self.handle, _MAX_DYNAMIC_SHARED, dynamic_shared), "shared-memory setting")
            if hasattr(cuda, "cuFuncLoad"):  # drivers of CUDA 12.4 on: load now what lazy loading would defer
                _check(cuda.cuFuncLoad(self.handle), "function load")

    def launch(self, grid: int, block: int, shared: int, stream: int, params: ctypes.Array) -> None:
        """One launch of `grid` blocks of `block` threads on `stream` (a CUDA stream handle of the function's
        context) with `params` (see `parameters`)."""
        launch_kernel(self.handle, self.context, (grid, 1, 1), block, shared, stream, params)


def parameters(args: Sequence[ctypes._SimpleCData]) -> ctypes.Array:
    """The kernel-parameter array of a launch: the address of each ctypes value of the kernel's parameter
    type (the values must outlive the array)."""
    return (ctypes.c_void_p * len(args))(*map(ctypes.addressof, args))


class BoundKernel:
    """Repeated launches of one loaded kernel (`function`, a CUfunction of `context`) with a fixed grid,
    block (`block` threads), dynamic shared memory and parameter `values` (ctypes values of the kernel's
    parameter types), of which the pointers at `slots` change at every call: `self(stream, pointers)`
    launches it on `stream` with `pointers` in those places (nothing for an empty grid), `context` made
    current where it is not. The driver's arguments are built once per thread, at its first call, as ctypes
    objects of the driver's exact types (`_launch_driver`: no conversion per argument), so threads launching
    at once never share them."""

    __slots__ = ("context", "dims", "empty", "function", "local", "slots", "values")

    def __init__(self, function: int | ctypes.c_void_p, context: int, grid: tuple[int, int, int], block: int,
                 shared: int, values: Sequence[ctypes._SimpleCData], slots: Sequence[int]) -> None:
        self.function = function.value if isinstance(function, ctypes.c_void_p) else function
        self.context, self.dims, self.empty = context, (*grid, block, 1, 1, shared), not all(grid)
        self.values, self.slots, self.local = list(values), tuple(slots), threading.local()

    def _own(self) -> tuple:
        held = [ctypes.c_uint64() for _ in self.slots]
        values = list(self.values)
        for at, value in zip(self.slots, held, strict=True):
            values[at] = value
        stream, now = ctypes.c_void_p(), ctypes.c_void_p()
        args = (ctypes.c_void_p(self.function), *map(ctypes.c_uint, self.dims), stream, parameters(values), None)
        own = self.local.own = (held, stream, args, now, ctypes.byref(now), values)  # the values outlive the array
        return own

    def __call__(self, stream: int, pointers: Sequence[int]) -> None:
        if self.empty:
            return
        own = getattr(self.local, "own", None) or self._own()
        held, stream_arg, args, now, now_ref, _ = own
        for value, pointer in zip(held, pointers, strict=True):
            value.value = pointer
        stream_arg.value = stream
        _launch_in(_launch_driver(), self.context, now, now_ref, args)


def launch_kernel(function: int | ctypes.c_void_p, context: int, grid: tuple[int, int, int], block: int, shared: int,
                  stream: int, params: ctypes.Array) -> None:
    """One launch of a loaded kernel (`function`, a CUfunction of `context`) on `stream` with `params` (see
    `parameters`); `context` is made current for it where it is not."""
    now = ctypes.c_void_p()
    _launch_in(_driver(), context, now, ctypes.byref(now), (function, *grid, block, 1, 1, shared, stream, params, None))


def _launch_in(cuda: ctypes.CDLL, context: int, now: ctypes.c_void_p, now_ref: object, args: tuple) -> None:
    """`cuLaunchKernel(*args)` through `cuda` with `context` current: as it is (`now`, read through
    `now_ref`), or pushed for the launch."""
    cuda.cuCtxGetCurrent(now_ref)
    if now.value == context:
        _check(cuda.cuLaunchKernel(*args), "launch")
        return
    with current(context):
        _check(cuda.cuLaunchKernel(*args), "launch")
