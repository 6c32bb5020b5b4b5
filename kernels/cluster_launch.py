"""Launches of the cluster forward (`cluster_row_stats.cu`: one HBM read per row, a row in the shared
memory of a cluster of blocks): compiled by NVRTC for the GPU at hand once per variant, loaded and
launched through the CUDA driver (`cuda_source`; the cluster size is fixed at compile time, so a plain
launch does).
Tensors and integers in, preallocated outputs written; no allocation, no host sync, capturable in a
CUDA graph. Same bits as `row_stats_kernel` (the kernel's header says why).

`applies` says whether a `launch.row_stats` call can take it: whole rows on one device (M, L, lse, the logp
of each of a row's int64 labels, entropy, every column's logprob), no per-row temperature, F = 40, on a
GPU of compute capability 9.0 or more whose blocks can take a slice (`device_fits`), with rows the bulk
copies can take (16-byte aligned, a multiple of 16 bytes long), a full-vocabulary output the vector
stores can take (16-byte aligned rows) and a vocabulary that 8 blocks' shared memory holds.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
from collections.abc import Sequence

import torch

from . import cuda_source, division_setup

SOURCE = pathlib.Path(__file__).with_name("cluster_row_stats.cu")
KERNEL = "cluster_row_stats"
ELEMENT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
# The fraction bits of each logits type, as `division_setup.division` takes them.
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
CLUSTERS = (2, 4, 8)  # blocks per row tried, fewest first (8: the portable cluster size's limit)
FRACTION_BITS = 40  # the kernel's fixed point, F
SHARED_PER_SM = 233472  # bytes of shared memory of an H100/H200 SM (228 KB; a block takes at most 227 KB)
BLOCK_OVERHEAD = 4096  # a block's shared memory beside its slice: its own (with the 1 KB reserved: 1408 bytes at 256 threads, 1920 at 1024), rounded up
SHARED_UNIT = 128  # an SM's shared memory goes to its blocks in units of this many bytes
SHARED_RESERVED = 1024  # bytes the system reserves in every block's shared memory


def blocks_per_sm(slice_bytes: int, threads: int) -> int:
    """Blocks of `threads` with slices of `slice_bytes` one SM holds: the number the registers must allow.
    A block's own shared memory (`BlockShared`: three mbarriers, the slots of up to 8 peers, each warp's
    partial results) at most 192 + 20 bytes a warp, the slice after it at a 128-byte boundary."""
    own = -(-(192 + 20 * (threads // 32)) // SHARED_UNIT) * SHARED_UNIT
    block = -(-(own + slice_bytes + SHARED_RESERVED) // SHARED_UNIT) * SHARED_UNIT
    return max(1, SHARED_PER_SM // block)


def cluster_width(n_cols: int, element_size: int, slice_bytes: int) -> tuple[int, int] | None:
    """(blocks per row, columns per block): the fewest blocks (`CLUSTERS`) whose slices, whole 16-byte
    vectors, hold at most `slice_bytes` each; None where 8 blocks do not."""
    per_vector = 16 // element_size
    for cluster in CLUSTERS:
        width = -(-n_cols // (cluster * per_vector)) * per_vector
        if width * element_size <= slice_bytes:
            return cluster, width
    return None


@functools.lru_cache(maxsize=64)
def device_fits(device_index: int, slice_bytes: int) -> bool:
    """Whether the GPU runs thread block clusters (compute capability 9.0 or more) and lets a block take a
    slice of `slice_bytes` and its own shared memory beside it (not every GPU with clusters has an H100's
    227 KB a block)."""
    properties = torch.cuda.get_device_properties(device_index)
    return (properties.major, properties.minor) >= (9, 0) and \
        slice_bytes + BLOCK_OVERHEAD <= properties.shared_memory_per_block_optin


def applies(x: torch.Tensor, labels: torch.Tensor | None, per_row_temperature: bool, bits: int,
            out_full: torch.Tensor | None, slice_bytes: int) -> bool:
    """Whether `row_stats_cluster` can compute this call (see the module docstring)."""
    if not x.is_cuda or x.dtype not in ELEMENT_CODES or x.dim() != 2 or per_row_temperature or bits != FRACTION_BITS:
        return False
    if labels is not None and (labels.dim() not in (1, 2) or labels.dtype != torch.int64 or not labels.is_contiguous()):
        return False
    if out_full is not None and (out_full.stride(1) != 1 or out_full.data_ptr() % 16 or (out_full.stride(0) * 4) % 16):
        return False
    size = x.element_size()
    n, vocab = x.shape
    if not (n and vocab) or x.stride(1) != 1 or x.data_ptr() % 16 or (x.stride(0) * size) % 16 or (vocab * size) % 16:
        return False
    return device_fits(x.device.index, slice_bytes) and cluster_width(vocab, size, slice_bytes) is not None


def variant_options(element: int, cluster: int, entropy: bool, temperature: bool, threads: int,
                    slice_bytes: int, wait_ns: int = 0) -> list[str]:
    """NVRTC's options for one variant of the kernel (its parameters are macros; no fp contraction);
    `slice_bytes`: a block's slice, which decides the blocks an SM holds and so the registers a thread may
    take; `wait_ns`: the copy wait's suspend-time hint (0: none)."""
    return ["-fmad=false", f"-DELEM={element}", f"-DCLUSTER={cluster}", f"-DTHREADS={threads}",
            f"-DMIN_BLOCKS={blocks_per_sm(slice_bytes, threads)}", f"-DENTROPY={int(entropy)}",
            f"-DTEMP={int(temperature)}", f"-DWAIT_NS={wait_ns}u"]


@functools.lru_cache(maxsize=64)
def _function(device_index: int, element: int, cluster: int, entropy: bool, temperature: bool, threads: int,
              slice_bytes: int, wait_ns: int) -> cuda_source.Function:
    """One variant, compiled for the device's compute capability and loaded on it."""
    major, minor = torch.cuda.get_device_capability(device_index)
    cubin = cuda_source.compile_cubin(SOURCE.read_text(), KERNEL, f"sm_{major}{minor}", variant_options(
        element, cluster, entropy, temperature, threads, slice_bytes, wait_ns))
    return cuda_source.Function(cubin, KERNEL, slice_bytes, device_index)


def _pointer(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())


class ClusterLaunch:
    """A launch of the cluster forward for one call's signature (shapes, strides, dtype, device, settings,
    the outputs asked for): the variant, grid and scalar arguments worked out once. `run(params)` launches
    it (`cuda_source.parameters(self.args)`: over the tensors it was built with); called as a plan's bound
    launch (`launch.bind_row_stats`), `self(tensors)` launches it over new tensors of the same signature,
    (x, labels, out_logp) or (x, out_full), through `self.kernel` (a `cuda_source.BoundKernel`), and
    returns True, or returns False launching nothing where x or out_full is not 16-byte aligned (the bulk
    copies and vector stores need it) or another device is current. The caller makes x's device current."""

    __slots__ = ("args", "device", "function", "grid", "kernel", "shared", "threads")

    def __init__(self, x: torch.Tensor, labels: torch.Tensor | None, t_scalar: float | None, entropy: bool,
                 outs: tuple[torch.Tensor | None, ...], out_full: torch.Tensor | None, threads: int,
                 slice_bytes: int, wait_ns: int) -> None:
        n, vocab = x.shape
        size = x.element_size()
        cluster, width = cluster_width(vocab, size, slice_bytes)
        self.device, self.threads, self.grid, self.shared = x.device.index, threads, n * cluster, width * size
        self.function = _function(self.device, ELEMENT_CODES[x.dtype], cluster, entropy, t_scalar is not None, threads,
                                  self.shared, wait_ns)
        out_max, out_log_sum, out_lse, out_logp, out_ent = outs
        picks = 1 if labels is None or labels.dim() == 1 else labels.shape[1]
        t = 1.0 if t_scalar is None else t_scalar
        t_hi, t_lo, t_division = division_setup.division(t, MANTISSA_BITS[x.dtype])  # unused without T
        self.args = [_pointer(x), ctypes.c_int64(x.stride(0) * size), _pointer(labels), ctypes.c_int32(picks),
                     ctypes.c_float(t), ctypes.c_float(t_hi), ctypes.c_float(t_lo), ctypes.c_int32(t_division),
                     _pointer(out_max), _pointer(out_log_sum), _pointer(out_lse), _pointer(out_logp),
                     _pointer(out_ent if entropy else None), _pointer(out_full),
                     ctypes.c_int64(0 if out_full is None else out_full.stride(0)), ctypes.c_int32(vocab),
                     ctypes.c_int32(width)]
        # The places of a bound call's tensors: x, then labels if given, then its one output.
        self.kernel = cuda_source.BoundKernel(
            self.function.handle, self.function.context, (self.grid, 1, 1), threads, self.shared, self.args,
            (0, *((2,) if labels is not None else ()), 13 if out_full is not None else 11))

    def run(self, params: ctypes.Array) -> None:
        """One launch with `params` (`cuda_source.parameters(self.args)`, or a bound call's)."""
        # The current stream's handle, as Triton's launches read it (no Stream object built per call).
        self.function.launch(self.grid, self.threads, self.shared, torch._C._cuda_getCurrentRawStream(self.device),
                             params)

    def __call__(self, tensors: Sequence[torch.Tensor]) -> bool:
        pointers = [t.data_ptr() for t in tensors]
        if pointers[0] & 15 or pointers[-1] & 15 or torch.cuda.current_device() != self.device:
            return False
        self.kernel(torch._C._cuda_getCurrentRawStream(self.device), pointers)
        return True


def row_stats_cluster(x: torch.Tensor, labels: torch.Tensor | None, t_scalar: float | None, entropy: bool,
                      outs: tuple[torch.Tensor | None, ...], out_full: torch.Tensor | None, threads: int,
                      slice_bytes: int, wait_ns: int) -> None:
    """`launch.row_stats` of a call `applies` accepts (with the same `slice_bytes`): each given output of
    `outs` (M, L, lse, logp, entropy: fp32 [n], logp [n, K] for labels [n, K]) and `out_full` written;
    `t_scalar` None: no temperature; `threads` per block; `wait_ns` the copy wait's suspend-time hint (0:
    none). The caller makes x's device current."""
    call = ClusterLaunch(x, labels, t_scalar, entropy, outs, out_full, threads, slice_bytes, wait_ns)
    call.run(cuda_source.parameters(call.args))
