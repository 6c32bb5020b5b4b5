"""CUDA C++ kernels of this package: compiled from source by NVRTC, loaded and launched through the CUDA
driver, all through ctypes (no build step, no extension module).

`compile_cubin` needs only NVRTC, no GPU: it runs on a CPU-only machine as well (the compile tests). NVRTC
is found in the `nvidia` wheels' directories (`nvidia-cuda-nvrtc`, which CUDA builds of torch install)
or on the loader's path. `Function` (a loaded kernel) and its `launch` need a GPU, with torch's context current
on the device.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from collections.abc import Sequence

_NVRTC_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


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
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
    cuda.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
    cuda.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return cuda


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"rl_logp: the CUDA driver's {what} failed with error {result}")


class Function:
    """A kernel loaded into the current context (torch's, on the current device), its module kept alive."""

    def __init__(self, cubin: bytes, name: str, dynamic_shared: int) -> None:
        cuda = _driver()
        self.module, self.handle = ctypes.c_void_p(), ctypes.c_void_p()
        _check(cuda.cuModuleLoadData(ctypes.byref(self.module), cubin), "module load")
        _check(cuda.cuModuleGetFunction(ctypes.byref(self.handle), self.module, name.encode()), "function lookup")
        if dynamic_shared > 48 * 1024:
            _check(cuda.cuFuncSetAttribute(self.handle, _MAX_DYNAMIC_SHARED, dynamic_shared), "shared-memory setting")

    def launch(self, grid: int, block: int, shared: int, stream: int, args: Sequence[ctypes._SimpleCData]) -> None:
        """One launch on `stream` (a CUDA stream handle) with `args`, each a ctypes value of the kernel's
        parameter type."""
        params = (ctypes.c_void_p * len(args))(*map(ctypes.addressof, args))
        _check(_driver().cuLaunchKernel(self.handle, grid, 1, 1, block, 1, 1, shared, stream, params, None), "launch")
