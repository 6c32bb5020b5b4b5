"""A launcher that binds a Triton kernel's compiled form once per specialization, then launches it directly.

`kernel[grid](...)` re-derives the compile options, formats a cache key and looks up the stream on every
call: tens of microseconds of host time, paid once per decode step by a rollout. `CachedKernel` computes
the same specialization Triton does (its native `specialize_impl` over the runtime arguments: dtypes,
16-byte alignment, divisibility by 16, integer width), keyed with the constexprs, the launch options and
the device; the first launch of a key goes through Triton (compiling if needed) and keeps the compiled
kernel, later ones call its driver launcher with the same arguments. Under Triton's interpreter, or when
a launch hook is installed (a profiler), every launch takes Triton's own path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
from triton.runtime import driver

from .fixed_point import INTERPRET

try:
    from triton import knobs
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    # NVIDIA's backend specializes as the base backend does (AMD's does not): the key below is Triton's.
    CUDA_SPECIALIZATION = torch.version.hip is None
except ImportError:  # another Triton release: every launch takes Triton's own path
    CUDA_SPECIALIZATION = False


class CachedKernel:
    """Launch `fn` (a `@triton.jit` function) with every argument positional, in its signature order."""

    def __init__(self, fn: triton.JITFunction) -> None:
        self.fn = fn
        self.constexpr = () if INTERPRET else tuple(p.is_constexpr for p in fn.params)
        self.compiled: dict[tuple, object] = {}

    def _key(self, device: int, args: Sequence, options: tuple) -> tuple:
        spec = [device, options]
        for arg, is_constexpr in zip(args, self.constexpr, strict=True):
            if is_constexpr or arg is None:
                spec.append(arg)
            elif isinstance(arg, float):
                spec.append(float)
            else:
                spec.append(native_specialize_impl(BaseBackend, arg, False, True, True))
        return tuple(spec)

    def __call__(self, grid: tuple[int, int, int], device: int, *args, num_warps: int, ftz: bool = False) -> None:
        options = (num_warps, ftz)
        if INTERPRET or not CUDA_SPECIALIZATION or knobs.runtime.launch_enter_hook is not None:
            self._launch_through_triton(grid, args, options)
            return
        key = self._key(device, args, options)
        kernel = self.compiled.get(key)
        if kernel is None:
            kernel = self._launch_through_triton(grid, args, options)
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            self.compiled[key] = kernel
            return
        stream = driver.active.get_current_stream(device)
        kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, None,
                   *args)

    def _launch_through_triton(self, grid, args, options):
        num_warps, ftz = options
        return self.fn[grid](*args, num_warps=num_warps, enable_fp_fusion=False, enable_reflect_ftz=ftz)


def on_device(x: torch.Tensor):
    """A context making x's GPU current when it is not (Triton launches on the current device's stream)."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()
