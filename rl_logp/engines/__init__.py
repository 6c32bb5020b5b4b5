"""The invariant engines and which one runs: `auto` resolution, the fused kernels' availability, and
engine construction.

`base`: the interface (`LogpEngine`) and its results (`RowStats`); `chunked`: the contract in plain torch
with a bounded workspace (any device); `fused`: the Triton kernels of `rl_logp.kernels` (CUDA, or the CPU
under Triton's interpreter).
"""

from __future__ import annotations

import functools

import torch

from rl_logp.engines.base import LogpEngine, RowStats
from rl_logp.engines.chunked import ChunkedEngine

INVARIANT_ENGINES = ("fused", "chunked")


_IMPORT_ERROR: list[str | None] = []  # fused_import_error's answer, once asked
_RUNS_ON: dict[str, bool] = {}  # fused_runs_on's answer per device type


def fused_import_error() -> str | None:
    """Why the fused kernels cannot be imported here, or None when they can (asked once a process)."""
    if not _IMPORT_ERROR:
        try:
            import rl_logp.engines.fused  # noqa: F401
        except ImportError as err:
            _IMPORT_ERROR.append(str(err))
        else:
            _IMPORT_ERROR.append(None)
    return _IMPORT_ERROR[0]


@torch.compiler.assume_constant_result
def _fused_runs_on_type(device_type: str) -> bool:
    runs = _RUNS_ON.get(device_type)
    if runs is None:
        runs = fused_import_error() is None
        if runs:
            from rl_logp.kernels.fixed_point import INTERPRET  # what the kernels were decorated with

            runs = device_type == "cuda" or (device_type == "cpu" and INTERPRET)
        _RUNS_ON[device_type] = runs
    return runs


def fused_runs_on(device: torch.device) -> bool:
    """True where `fused` can run: a CUDA device with Triton, or the CPU under TRITON_INTERPRET=1 (as it was
    when the kernels were imported: Triton reads it then). torch.compile traces this function (through
    `resolve_backend`): the answer, fixed for the process, is a constant to it (run, not traced: no guard
    on the memo, so no recompile once it is filled), and the memo is a plain dict, as Dynamo warns at every
    `functools` cache wrapper it traces through."""
    return _fused_runs_on_type(device.type)


def resolve_backend(backend: str, device: torch.device) -> str:
    """`auto` becomes `fused` where the kernel runs on `device` (CUDA), else `chunked`; others are checked."""
    if backend == "auto":
        return "fused" if device.type == "cuda" and fused_runs_on(device) else "chunked"
    if backend == "fused" and not fused_runs_on(device):
        reason = fused_import_error() or f"the logits are on {device}"
        raise ValueError(
            f"rl_logp: backend='fused' needs CUDA logits and Triton ({reason}); "
            "use backend='chunked' (any device) or 'auto'"
        )
    return backend


@functools.lru_cache(maxsize=16)
def make_engine(name: str, chunk_bytes: int) -> LogpEngine:
    """The engine of an invariant backend (`fused` or `chunked`); engines are stateless and cached."""
    if name == "fused":
        from rl_logp.engines.fused import FusedEngine

        return FusedEngine()
    if name == "chunked":
        return ChunkedEngine(chunk_bytes)
    raise ValueError(f"rl_logp: {name!r} is not an invariant engine; use one of {', '.join(INVARIANT_ENGINES)}")


__all__ = ["INVARIANT_ENGINES", "LogpEngine", "RowStats", "fused_runs_on", "make_engine", "resolve_backend"]
