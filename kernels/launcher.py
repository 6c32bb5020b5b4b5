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

`launcher.bind(grid, args, options, slots)` goes one step further for a caller that launches the same
arguments again and again with only some tensors changing (a rollout's call at every decode step): a
`BoundLaunch` holding the arguments and the compiled kernel, which per call checks only what can differ
(each new tensor's dtype and alignment, the current device, the knobs and hooks, the globals) and declines
(launching nothing) where the launcher's key would differ. With `direct=True` it launches through the
CUDA driver itself (`DriverLaunch`): the kernel's parameters packed once as Triton's launcher packs them
(`driver_values`: every parameter that is not a constexpr, then the global and profile scratch pointers,
null), only the new tensors' pointers per call; Triton's launcher instead parses every argument and asks
the driver about every pointer at every call. The packing is checked when bound against the installed
Triton's own generated launcher (`make_launcher`'s source: the same arguments in the same order, each of
the packed size, the scratch pointers last) and the kernel's PTX (as many parameters, of those sizes);
where it cannot be known for sure (another parameter type, scratch memory, clusters, cooperative or PDL
launches, either check failing), the bound launch keeps Triton's launcher.
"""

from __future__ import annotations

import ctypes
import functools
import re
from collections.abc import Sequence
from typing import Any

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.knobs import HookChain
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from . import cuda_source
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

    def _plain_only(self, grid: Any, args: Sequence[Any]) -> bool:
        """Whether this launch must take Triton's own path (see the module docstring)."""
        rt = knobs.runtime
        return (not self.fast or type(grid) is not tuple or len(args) != len(self.constexpr)
                or bool(self.kernel.pre_run_hooks) or _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook))

    def _head(self, device: int) -> tuple:
        """The key items that are not arguments, but the options (the device, debug and instrumentation)."""
        return device, self.kernel.debug, knobs.runtime.debug, knobs.compilation.instrumentation_mode

    def __call__(self, grid: tuple[int, ...], args: Sequence[Any], options: dict[str, Any]) -> Any:
        kernel = self.kernel
        if self._plain_only(grid, args):
            return kernel[grid](*args, **options)
        items = arg_key(args, self.constexpr)
        if items is None:
            return kernel[grid](*args, **options)
        device = driver.active.get_current_device()
        # str(options): Triton's own key for the options (True and 1 are equal, but not in Triton's key)
        key = (*self._head(device), str(options), *items)
        entry = self.cache.get(key)
        if entry is None:
            compiled = kernel[grid](*args, **options)
            if isinstance(compiled, CompiledKernel):  # not None (a jit_cache_hook), nor an async future
                self.cache[key] = (compiled, compiled.run, compiled.function, compiled.packed_metadata)
            return compiled
        self.check_globals()
        _run(entry, grid, device, args)
        return entry[0]

    def check_globals(self) -> None:
        """Raise as `JITFunction.run` does when a global the kernel used no longer holds its value."""
        seen = self.globals_seen
        for name_scope, (value, scope) in self.kernel.used_global_vals.items():
            now = scope.get(name_scope[0], _MISSING)
            if now is not seen.get(name_scope, _UNSEEN):
                if now != value:
                    raise RuntimeError(f"Global variable {name_scope[0]} has changed since we compiled this "
                                       f"kernel, from {value} to {now}")
                seen[name_scope] = now

    def bind(self, grid: tuple[int, ...], args: Sequence[Any], options: dict[str, Any], slots: Sequence[int],
             direct: bool = False) -> BoundLaunch | None:
        """This launch with the tensors at `slots` left to each call (`BoundLaunch`), once `self(grid, args,
        options)` has run; None where that launch would not take the fast path (or has not been compiled).
        `direct`: launch through the driver where the kernel's parameters are known (`DriverLaunch`).
        Under the interpreter the bound launch is Triton's plain launch."""
        if not all(type(args[s]) is torch.Tensor for s in slots):
            return None
        if not self.fast:
            return BoundLaunch(self, grid, args, options, slots, None, None)
        items = None if self._plain_only(grid, args) else arg_key(args, self.constexpr)
        if items is None:
            return None
        head = self._head(driver.active.get_current_device())
        entry = self.cache.get((*head, str(options), *items))
        if entry is None:
            return None
        values = driver_values(entry[0], args) if direct else None
        through = None if values is None else DriverLaunch(entry[0], entry[2], grid, values, slots, head[0])
        return BoundLaunch(self, grid, args, options, slots, head, entry, through)


def _run(entry: tuple, grid: tuple[int, ...], device: int, args: Sequence[Any]) -> None:
    """Launch a cached CompiledKernel as `JITFunction.run` does, on the device's current stream."""
    _, run, function, metadata = entry
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, driver.active.get_current_stream(device),
        function, metadata, None, None, None, *args)


class BoundLaunch:
    """`launcher(grid, args, options)` with the tensors at `slots` given at each call: `bound(tensors)`
    launches with `tensors` in those places and returns True, or returns False launching nothing where
    the launcher's key would not be the bound one (a tensor of another dtype or 16-byte alignment, another
    current device, a changed debug or instrumentation knob, a launch or pre-run hook); a changed global
    raises as Triton does. It holds the other arguments (not the tensors of the slots), so a caller binds
    only what its own key fixes."""

    __slots__ = ("args", "entry", "grid", "head", "launcher", "options", "slots", "tensor_keys", "through")

    def __init__(self, launcher: CachedLauncher, grid: tuple[int, ...], args: Sequence[Any], options: dict[str, Any],
                 slots: Sequence[int], head: tuple | None, entry: tuple | None,
                 through: DriverLaunch | None = None) -> None:
        self.launcher, self.grid, self.options, self.slots = launcher, grid, options, tuple(slots)
        self.args = [None if i in self.slots else a for i, a in enumerate(args)]  # holds no tensor of a slot
        self.tensor_keys = tuple((args[s].dtype, not args[s].data_ptr() & 15) for s in slots)
        self.head, self.entry = head, entry  # entry None: Triton's plain launch (the interpreter)
        self.through = through  # None: Triton's launcher

    def __call__(self, tensors: Sequence[torch.Tensor]) -> bool:
        args = self.args.copy()
        for slot, t, (dtype, aligned) in zip(self.slots, tensors, self.tensor_keys, strict=True):
            if type(t) is not torch.Tensor or t.dtype is not dtype or (not t.data_ptr() & 15) is not aligned:
                return False
            args[slot] = t
        launcher = self.launcher
        if self.entry is None:
            launcher.kernel[self.grid](*args, **self.options)
            return True
        device = driver.active.get_current_device()
        if launcher._plain_only(self.grid, args) or launcher._head(device) != self.head:
            return False
        launcher.check_globals()
        if self.through is None:
            _run(self.entry, self.grid, device, args)
        else:
            self.through(driver.active.get_current_stream(device), tensors)
        return True


# ctypes of the kernel parameters Triton's launcher passes by value (its `ty_to_cpp`; floats as their bits)
_PARAM_TYPES = {"i1": ctypes.c_int8, "i8": ctypes.c_int8, "i16": ctypes.c_int16, "i32": ctypes.c_int32,
                "i64": ctypes.c_int64, "u1": ctypes.c_uint8, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16,
                "u32": ctypes.c_uint32, "u64": ctypes.c_uint64, "fp32": ctypes.c_float, "f32": ctypes.c_float,
                "fp64": ctypes.c_double}
_SCRATCH = ("&global_scratch", "&profile_scratch")  # appended by Triton 3.6's launcher to every kernel's parameters
_C_BYTES = {"CUdeviceptr": 8, "int8_t": 1, "int16_t": 2, "int32_t": 4, "int64_t": 8, "uint8_t": 1, "uint16_t": 2,
            "uint32_t": 4, "uint64_t": 8}
_PTX_PARAM_BITS = re.compile(r"\.param\s+\.[a-z]+(\d+)\b")


@functools.lru_cache(maxsize=256)
def _triton_parameters(signature: tuple[str, ...]) -> tuple[tuple[int, int], ...] | None:
    """What the installed Triton's own generated launcher passes a kernel of `signature` (its parameter
    types in order): (argument index, bytes) of each entry of its parameter array, the scratch pointers as
    index -1; None where its source does not read as expected (another Triton)."""
    try:
        from triton.backends.nvidia.driver import make_launcher

        source = make_launcher({}, dict(enumerate(signature)), None)
        declared = re.search(r"static void _launch\((.*?)\)", source).group(1).split(", ")
        order = re.search(r"void \*params\[\] = \{ (.*?) \};", source).group(1).split(", ")
        c_types = {name: c_type for c_type, name in (d.rsplit(" ", 1) for d in declared)}
        if tuple(order[-2:]) != _SCRATCH:
            return None
        return (*((int(name.removeprefix("&arg")), _C_BYTES[c_types[name[1:]]]) for name in order[:-2]),
                (-1, 8), (-1, 8))
    except (ImportError, AttributeError, KeyError, TypeError, ValueError):
        return None


def _ptx_param_bytes(ptx: str | None, name: str) -> list[int] | None:
    """The byte size of each parameter of the entry `name` in `ptx`, in order."""
    entry = re.search(rf"\.entry\s+{re.escape(name)}\s*\((.*?)\)", ptx or "", re.S)
    if entry is None:
        return None
    params = [p for p in entry.group(1).split(",") if p.strip()]
    sizes = [_PTX_PARAM_BITS.search(p) for p in params]
    return None if not all(sizes) else [int(m.group(1)) // 8 for m in sizes]


def driver_values(compiled: Any, args: Sequence[Any]) -> list | None:
    """The parameters Triton's launcher passes `compiled` for `args` as ctypes values, in order: each
    argument that is not a constexpr (a tensor as its data pointer), then the scratch pointers (null);
    None where that cannot be known for sure (see the module docstring). Checked against the installed
    Triton's own generated launcher (the same arguments in the same order, each of the packed size) and
    against the kernel's PTX (as many parameters, each of the packed size)."""
    meta = getattr(compiled, "metadata", None)
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if (meta is None or getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", True)
            or getattr(meta, "launch_pdl", True) or getattr(meta, "global_scratch_size", 1)
            or getattr(meta, "profile_scratch_size", 1) or getattr(meta, "tensordesc_meta", None)
            or not isinstance(signature, dict) or len(signature) != len(args)):
        return None
    if not all(isinstance(ty, str) for ty in signature.values()):
        return None
    values, passed = [], []
    for i, (ty, a) in enumerate(zip(signature.values(), args, strict=True)):
        if ty == "constexpr":
            if type(a) is torch.Tensor:
                return None
            continue
        if ty.startswith("*") and type(a) is torch.Tensor:
            values.append(ctypes.c_uint64(a.data_ptr()))
        elif ty in _PARAM_TYPES and type(a) in ((int, float) if ty[0] == "f" else (int, bool)):
            values.append(_PARAM_TYPES[ty](a))
        else:
            return None
        passed.append(i)
    values += [ctypes.c_uint64(0) for _ in _SCRATCH]
    sizes = [ctypes.sizeof(v) for v in values]
    expected = (*zip(passed, sizes[:len(passed)], strict=True), (-1, 8), (-1, 8))
    if _triton_parameters(tuple(signature.values())) != expected:
        return None
    if _ptx_param_bytes(compiled.asm.get("ptx"), compiled.name) != sizes:
        return None
    return values


class DriverLaunch:
    """A compiled Triton kernel's launch through the CUDA driver (a `cuda_source.BoundKernel`) with the
    parameters `driver_values` packed, the tensors of `slots` replaced at each call: the grid, block (32
    threads a warp), dynamic shared memory and parameters Triton's launcher would pass (an empty grid
    launches nothing, as Triton's launcher does)."""

    __slots__ = ("kernel",)

    def __init__(self, compiled: Any, function: int, grid: tuple[int, ...], values: list, slots: Sequence[int],
                 device: int) -> None:
        n = len(grid)
        passed = [i for i, ty in enumerate(compiled.src.signature.values()) if ty != "constexpr"]
        self.kernel = cuda_source.BoundKernel(
            function, cuda_source.primary_context(device), (grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1),
            32 * compiled.metadata.num_warps, compiled.metadata.shared, values, [passed.index(s) for s in slots])

    def __call__(self, stream: int, tensors: Sequence[torch.Tensor]) -> None:
        self.kernel(stream, [t.data_ptr() for t in tensors])
