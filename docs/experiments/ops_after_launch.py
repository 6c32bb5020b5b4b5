"""What a scoring call costs the torch ops issued after it (host time), on a CUDA device.

Each step, after a sync: X (one of `CALLS`), then a fixed block of vLLM-sampler-like torch ops (`ops`:
cast, softmax, exponential noise, divide, argmax, top-k). Prints the median host us of X and of the ops
after it, the Xs alternating round by round. Among the Xs, rl-logp's planned call with its cluster kernel
launched three ways: through the driver as the package does (`cuCtxGetCurrent`, then `cuLaunchKernel`),
through the driver without the context check, through the driver holding the GIL (a `ctypes.PyDLL` of
libcuda: ctypes releases the GIL around every call of a `CDLL`'s functions), and through torch's CUDA
runtime (`cudaLaunchKernel` of the same cubin loaded by `cudaLibraryLoadData`), with and without the GIL;
each checked to give the driver launch's bits. Run with the
package importable and a GPU:

    PYTHONPATH=/tmp/pkg:/tmp/site python -P docs/experiments/ops_after_launch.py 8
"""

import ctypes
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

import rl_logp
from rl_logp.kernels import cuda_source


@triton.jit
def _touch(p):
    tl.store(p, 1.0)


CONFIG = rl_logp.resolve_config(None)
LOGITS = torch.randn(8, 151936, device="cuda", dtype=torch.bfloat16)
CELL = torch.zeros(1, device="cuda")
CUDA = cuda_source._launch_driver()
NOW = ctypes.c_void_p()
NOW_REF = ctypes.byref(NOW)


def rl_logp_call() -> torch.Tensor:
    return rl_logp.full_logprobs(LOGITS, config=CONFIG)


def swapped(owner: object, name: str, value: object):
    """rl-logp's planned call with `owner.name` set to `value` for its duration (the original put back)."""
    original = getattr(owner, name)

    def call() -> torch.Tensor:
        setattr(owner, name, value)
        try:
            return rl_logp.full_logprobs(LOGITS, config=CONFIG)
        finally:
            setattr(owner, name, original)
    return call


rl_logp_without_launch = swapped(cuda_source.BoundKernel, "__call__", lambda self, stream, pointers: None)


CUBINS: dict[int, tuple[bytes, str, int, int]] = {}  # a loaded Function's handle: what it was loaded from
_FUNCTION_INIT = cuda_source.Function.__init__


def _recording_init(self, cubin: bytes, name: str, dynamic_shared: int, device_index: int) -> None:
    _FUNCTION_INIT(self, cubin, name, dynamic_shared, device_index)
    CUBINS[self.handle.value] = (cubin, name, dynamic_shared, device_index)


cuda_source.Function.__init__ = _recording_init


def _cudart_path() -> str:
    """The path of the CUDA runtime torch loaded (from the process's mappings)."""
    with open("/proc/self/maps") as maps:
        return next(line.split()[-1] for line in maps if "libcudart.so" in line)


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


CUDART = ctypes.CDLL(_cudart_path())
CUDART_HOLDING_GIL = ctypes.PyDLL(_cudart_path())
RUNTIME_KERNELS: dict[int, tuple[ctypes.c_void_p, ctypes.c_void_p]] = {}


def _runtime_check(result: int, what: str) -> None:
    if result:
        raise RuntimeError(f"the CUDA runtime's {what} failed with error {result}")


def _runtime_kernel(handle: int) -> ctypes.c_void_p:
    """The cudaKernel_t of the same cubin as the driver's function `handle`, loaded by the runtime."""
    if handle not in RUNTIME_KERNELS:
        cubin, name, shared, device = CUBINS[handle]
        library, kernel = ctypes.c_void_p(), ctypes.c_void_p()
        _runtime_check(CUDART.cudaLibraryLoadData(ctypes.byref(library), cubin, None, None, 0, None, None, 0),
                       "library load")
        _runtime_check(CUDART.cudaLibraryGetKernel(ctypes.byref(kernel), library, name.encode()), "kernel lookup")
        if shared > 48 * 1024:  # cudaFuncAttributeMaxDynamicSharedMemorySize
            _runtime_check(CUDART.cudaKernelSetAttributeForDevice(kernel, 8, shared, device)
                           if hasattr(CUDART, "cudaKernelSetAttributeForDevice")
                           else CUDART.cudaFuncSetAttribute(kernel, 8, shared), "shared-memory setting")
        RUNTIME_KERNELS[handle] = (library, kernel)
    return RUNTIME_KERNELS[handle][1]


def _runtime_own(self: cuda_source.BoundKernel) -> tuple:
    held, _, args, _, _, values = self._own()
    grid, block = Dim3(*self.dims[:3]), Dim3(*self.dims[3:6])
    own = self.local.runtime = (held, ctypes.c_void_p(), _runtime_kernel(self.function), grid, block, args[9],
                                ctypes.c_size_t(self.dims[6]), values)
    return own


def runtime_launcher(cudart: ctypes.CDLL):
    def runtime_launch(self: cuda_source.BoundKernel, stream: int, pointers: list[int]) -> None:
        """`BoundKernel.__call__` through the runtime: `cudaLaunchKernel` in the runtime's current device."""
        if self.empty:
            return
        own = getattr(self.local, "runtime", None) or _runtime_own(self)
        held, stream_arg, kernel, grid, block, params, shared, _ = own
        for value, pointer in zip(held, pointers, strict=True):
            value.value = pointer
        stream_arg.value = stream
        _runtime_check(cudart.cudaLaunchKernel(kernel, grid, block, params, shared, stream_arg), "launch")
    return runtime_launch


def driver_launch_unchecked(cuda: ctypes.CDLL, context: int, now: ctypes.c_void_p, now_ref: object,
                            args: tuple) -> None:
    """`cuda_source._launch_in` without its current-context check."""
    cuda_source._check(cuda.cuLaunchKernel(*args), "launch")


DRIVER_HOLDING_GIL = ctypes.PyDLL("libcuda.so.1")
rl_logp_runtime_launch = swapped(cuda_source.BoundKernel, "__call__", runtime_launcher(CUDART))
rl_logp_runtime_launch_holding_gil = swapped(cuda_source.BoundKernel, "__call__", runtime_launcher(CUDART_HOLDING_GIL))
rl_logp_unchecked_launch = swapped(cuda_source, "_launch_in", driver_launch_unchecked)
rl_logp_launch_holding_gil = swapped(cuda_source, "_launch_driver", lambda: DRIVER_HOLDING_GIL)


CALLS = {
    "none": lambda: None,
    "log_softmax": lambda: LOGITS.log_softmax(-1, dtype=torch.float32),
    "rl_logp": rl_logp_call,
    "rl_logp, no launch": rl_logp_without_launch,
    "rl_logp, runtime launch": rl_logp_runtime_launch,
    "rl_logp, launch unchecked": rl_logp_unchecked_launch,
    "rl_logp, launch holding the GIL": rl_logp_launch_holding_gil,
    "rl_logp, runtime launch holding the GIL": rl_logp_runtime_launch_holding_gil,
    "empty + cuCtxGetCurrent": lambda: (torch.empty(8, 151936, device="cuda"), CUDA.cuCtxGetCurrent(NOW_REF)),
    "triton launch": lambda: _touch[(1,)](CELL),
    "log_softmax + triton launch": lambda: (LOGITS.log_softmax(-1, dtype=torch.float32), _touch[(1,)](CELL)),
}


def ops() -> tuple:
    y = LOGITS.to(torch.float32)
    p = y.softmax(-1)
    q = torch.empty_like(p).exponential_()
    sampled = p.div_(q).argmax(-1)
    values, ids = torch.topk(y, 5, -1)
    return sampled.to(torch.int32), values, ids


def main(rounds: int) -> None:
    reference = rl_logp_call()
    for name, call in (("runtime launch", rl_logp_runtime_launch), ("launch unchecked", rl_logp_unchecked_launch),
                       ("launch holding the GIL", rl_logp_launch_holding_gil),
                       ("runtime launch holding the GIL", rl_logp_runtime_launch_holding_gil)):
        out = call()
        torch.cuda.synchronize()
        print(f"{name}: the same bits as the driver launch: {torch.equal(out, reference)}")
    print(f"kernels loaded by the runtime: {len(RUNTIME_KERNELS)}")
    for call in CALLS.values():
        for _ in range(20):
            call()
            ops()
    torch.cuda.synchronize()
    own = {name: [] for name in CALLS}
    after = {name: [] for name in CALLS}
    for _ in range(rounds):
        for name, call in CALLS.items():
            for _ in range(200):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call()
                t1 = time.perf_counter()
                ops()
                own[name].append((t1 - t0) * 1e6)
                after[name].append((time.perf_counter() - t1) * 1e6)
    print(f"{'X':32s} {'X us':>8s} {'ops after X us':>15s}")
    for name in CALLS:
        print(f"{name:32s} {statistics.median(own[name]):8.1f} {statistics.median(after[name]):15.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
