"""Cached kernel launches: `CachedLauncher(kernel)(grid, args, options)` does what
`kernel[grid](*args, **options)` does, with less host time per call.

Triton's `JITFunction.run` binds and specializes every argument and builds a cache key at every call. Here
the first call of a specialization goes through `kernel[grid]` (which compiles and launches) and its
CompiledKernel is kept under a key computed cheaply in Python; later calls with that key call the
CompiledKernel's launcher directly, with the arguments `JITFunction.run` passes it. The key refines
Triton's (`native_specialize_impl` per argument, constexpr values, str(options), device, debug and
instrumentation knobs): equal keys mean Triton would pick the same compiled kernel. Per argument:
  tensor -> its dtype and whether data_ptr() % 16 == 0 (Triton's "D"); None -> None;
  int -> a code: 2 for the value 1 (a constexpr for Triton), else its class by range (i32: 0, i64: 4,
  u64: 8) plus 1 for a multiple of 16 (Triton's "D"); float, bool -> the type (values are not specialized);
  a constexpr parameter -> its type and value (a float's repr when it is zero or NaN).
Triton's result is a function of these whatever a parameter's do_not_specialize(_on_alignment), const or
type annotation. Anything else (an int out of the i64 / u64 range, another type, a grid that is not a
tuple, a parameter left to its default, the interpreter, launch or pre-run hooks) takes the plain path
`kernel[grid](*args, **options)`.

As `JITFunction.run` does, every launch checks that the globals the kernel used still hold the values it
was compiled with: a global bound to another object than at the last check is compared (`!=`, as Triton
does) with the value Triton recorded, a deep copy, so never the same object; an object once found equal is
not compared again (Triton's check costs about 0.6 us per `Named` global per launch). Unlike Triton's,
this does not see a constexpr object changed in place after that first comparison.
Without launch hooks `JITFunction.run` hands the launcher a metadata dict and empty hook chains that do
nothing (Triton 3.6's hooks are HookChains, never None); this passes None for the three, which it skips.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.knobs import HookChain
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from .fixed_point import INTERPRET

_MISSING, _UNSEEN = object(), object()


def _hooked(hook: Any) -> bool:
    return hook is not None and (type(hook) is not HookChain or bool(hook.calls))


def arg_key(args: Sequence[Any], constexpr: Sequence[bool]) -> list | None:
    """The key items of `args` (a parameter is a constexpr where `constexpr` says so); None: no fast path."""
    items: list = []
    push = items.append
    for a, const in zip(args, constexpr, strict=True):
        t = type(a)
        if a is None:
            push(None)
        elif const:
            if t is float:
                push((t, a if a == a and a else repr(a)))  # 0.0, -0.0 differ in Triton's key; NaN != NaN
            elif t is int or t is bool or t is str:
                push((t, a))
            else:
                return None
        elif t is torch.Tensor:
            push((a.dtype, not a.data_ptr() & 15))
        elif t is int:
            if a == 1:
                push(2)
            elif -0x80000000 <= a <= 0x7FFFFFFF:
                push(not a & 15)
            elif -0x8000000000000000 <= a <= 0xFFFFFFFFFFFFFFFF:
                push((4 if a <= 0x7FFFFFFFFFFFFFFF else 8) + (not a & 15))
            else:
                return None
        elif t is float or t is bool:
            push(t)
        elif isinstance(a, torch.Tensor):  # a subclass (nn.Parameter): Triton reads dtype and data_ptr too
            push((t, a.dtype, not a.data_ptr() & 15))
        else:
            return None
    return items


class CachedLauncher:
    """Launches one @triton.jit kernel: `launcher(grid, args, options)` == `kernel[grid](*args, **options)`
    for `args` every parameter in signature order (constexprs included) and `options` the launch options.
    `cache` maps keys to the CompiledKernels the fast path launches."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.cache: dict[tuple, tuple] = {}
        self.globals_seen: dict[tuple, Any] = {}  # (name, id(scope)): the object last found equal
        self.fast = not INTERPRET and type(kernel) is JITFunction
        self.constexpr = tuple(p.is_constexpr for p in kernel.params) if self.fast else ()

    def __call__(self, grid: tuple[int, ...], args: Sequence[Any], options: dict[str, Any]) -> Any:
        kernel, rt = self.kernel, knobs.runtime
        if (not self.fast or type(grid) is not tuple or len(args) != len(self.constexpr) or kernel.pre_run_hooks
                or _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook)):
            return kernel[grid](*args, **options)
        items = arg_key(args, self.constexpr)
        if items is None:
            return kernel[grid](*args, **options)
        device = driver.active.get_current_device()
        # str(options): Triton's own key for the options (True and 1 are equal, but not in Triton's key)
        key = (device, kernel.debug, rt.debug, knobs.compilation.instrumentation_mode, str(options), *items)
        entry = self.cache.get(key)
        if entry is None:
            compiled = kernel[grid](*args, **options)
            if isinstance(compiled, CompiledKernel):  # not None (a jit_cache_hook), nor an async future
                self.cache[key] = (compiled, compiled.run, compiled.function, compiled.packed_metadata)
            return compiled
        seen = self.globals_seen
        for name_scope, (value, scope) in kernel.used_global_vals.items():
            now = scope.get(name_scope[0], _MISSING)
            if now is not seen.get(name_scope, _UNSEEN):
                if now != value:
                    raise RuntimeError(f"Global variable {name_scope[0]} has changed since we compiled this "
                                       f"kernel, from {value} to {now}")
                seen[name_scope] = now
        compiled, run, function, metadata = entry
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, driver.active.get_current_stream(device),
            function, metadata, None, None, None, *args)
        return compiled
