"""Configuration of rl-logp: which backend runs, how big a chunk is, how many fixed-point bits.

A `LogpConfig` is built from (lowest to highest precedence) the defaults, environment variables
(`RL_LOGP_BACKEND`, `RL_LOGP_CHUNK_BYTES`, `RL_LOGP_FIXED_POINT_BITS`, `RL_LOGP_STRICT`,
`RL_LOGP_TP_AGREEMENT`), a dict (for a
verl/hydra config block) and keyword arguments. Every value is validated here, so a bad value fails at
configuration time with a message that names the setting and the accepted values.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch

BACKENDS = ("auto", "fused", "chunked", "flash_attn", "torch")
INVARIANT_BACKENDS = ("auto", "fused", "chunked")
ENV_PREFIX = "RL_LOGP_"
MIN_FIXED_POINT_BITS = 20
MAX_FIXED_POINT_BITS = 52
MIN_CHUNK_BYTES = 4096
TP_AGREEMENTS = ("every_call", "first_call")


@dataclasses.dataclass(frozen=True)
class LogpConfig:
    """Settings of one `rl_logp.logprobs` call.

    backend: one of `BACKENDS`; `auto` picks `fused` where the GPU kernel runs, else `chunked`.
    chunk_bytes: workspace budget of the `chunked` path per chunk (bytes), independent of N.
    fixed_point_bits: F in q(t) = trunc(t * 2^F); the vocabulary must stay below 2^(63-F) columns.
    strict: refuse backends that are not batch- and TP-invariant (`torch`, `flash_attn`).
    tp_agreement: when vocab-parallel ranks check on the host that they agree: `every_call` (a host sync
        per call) or `first_call` (once per layout, then on the device; see `rl_logp.shard_layout`).
    """

    backend: str = "auto"
    chunk_bytes: int = 256 * 1024 * 1024
    fixed_point_bits: int = 40
    strict: bool = False
    tp_agreement: str = "every_call"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"rl_logp: backend={self.backend!r} is unknown; choose one of {', '.join(BACKENDS)}")
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int):
            raise TypeError(f"rl_logp: chunk_bytes must be an int (bytes), got {type(self.chunk_bytes).__name__}")
        if self.chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError(f"rl_logp: chunk_bytes={self.chunk_bytes} is below the minimum {MIN_CHUNK_BYTES}")
        if isinstance(self.fixed_point_bits, bool) or not isinstance(self.fixed_point_bits, int):
            raise TypeError("rl_logp: fixed_point_bits must be an int")
        if not MIN_FIXED_POINT_BITS <= self.fixed_point_bits <= MAX_FIXED_POINT_BITS:
            raise ValueError(
                f"rl_logp: fixed_point_bits={self.fixed_point_bits} is outside "
                f"[{MIN_FIXED_POINT_BITS}, {MAX_FIXED_POINT_BITS}]; 40 suits vocabularies below 2^23"
            )
        if self.tp_agreement not in TP_AGREEMENTS:
            raise ValueError(
                f"rl_logp: tp_agreement={self.tp_agreement!r} is unknown; choose one of {', '.join(TP_AGREEMENTS)}"
            )
        if self.strict and self.backend not in INVARIANT_BACKENDS:
            raise ValueError(
                f"rl_logp: backend={self.backend!r} is not batch/TP-invariant and strict=True; "
                f"use one of {', '.join(INVARIANT_BACKENDS)} or set strict=False"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LogpConfig:
        """Defaults overridden by `RL_LOGP_*` environment variables."""
        return cls(**_parse_env(os.environ if environ is None else environ))


_FIELDS = {f.name: f for f in dataclasses.fields(LogpConfig)}


def _coerce(name: str, value: Any) -> Any:
    kind = _FIELDS[name].type
    if kind == "bool" and isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"rl_logp: {name}={value!r} is not a boolean (use 1/0, true/false)")
    if kind == "int" and isinstance(value, str):
        try:
            return int(value.strip().replace("_", ""), 0)
        except ValueError:
            raise ValueError(f"rl_logp: {name}={value!r} is not an integer") from None
    if kind == "str" and isinstance(value, str):
        return value.strip().lower()
    return value


def _parse_env(environ: Mapping[str, str]) -> dict[str, Any]:
    found = {}
    for name in _FIELDS:
        key = ENV_PREFIX + name.upper()
        if key in environ:
            found[name] = _coerce(name, environ[key])
    return found


_ENV_KEYS = tuple(os.environ.encodekey(ENV_PREFIX + name.upper()) for name in _FIELDS)
_RESOLVED: dict[tuple, LogpConfig] = {}


def _env_values() -> tuple:
    """The raw RL_LOGP_* values; os.environ's own mapping (os.environ.get re-encodes each key: ~2 us)."""
    raw = os.environ._data
    return tuple(raw.get(k) for k in _ENV_KEYS)


def resolve_config(
    values: Mapping[str, Any] | LogpConfig | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> LogpConfig:
    """Merge defaults < environment < `values` (dict or config) < keyword overrides, and validate.

    A `LogpConfig` with no overrides is returned as it is (it was validated when built, and a config
    object ignores the environment). Other eager calls without a dict are memoised on (config, the
    RL_LOGP_* values, the overrides): the rollout calls this at every decode step, and a changed variable
    still takes effect.
    """
    if type(values) is LogpConfig and all(v is None for v in overrides.values()):
        return values
    if environ is None and not isinstance(values, Mapping) and not torch.compiler.is_compiling():
        key = (values, _env_values(), *overrides.items())
        found = _RESOLVED.get(key)
        if found is None:
            found = _RESOLVED[key] = _resolve(values, None, overrides)
        return found
    return _resolve(values, environ, overrides)


def _resolve(values, environ, overrides) -> LogpConfig:
    if values is not None and not isinstance(values, (LogpConfig, Mapping)):
        hint = f"; to choose a backend pass backend={values!r}" if isinstance(values, str) else ""
        raise TypeError(
            f"rl_logp: config must be a LogpConfig or a dict of settings, got {type(values).__name__}{hint}"
        )
    if isinstance(values, LogpConfig):
        merged: dict[str, Any] = dataclasses.asdict(values)
    else:
        merged = _parse_env(os.environ if environ is None else environ)
        for key, value in dict(values or {}).items():
            if key not in _FIELDS:
                raise ValueError(f"rl_logp: unknown config key {key!r}; known keys: {', '.join(_FIELDS)}")
            merged[key] = _coerce(key, value)
    for key, value in overrides.items():
        if key not in _FIELDS:
            raise TypeError(f"rl_logp: unknown option {key}=...; known options: {', '.join(_FIELDS)}")
        if value is not None:
            merged[key] = _coerce(key, value)
    return LogpConfig(**merged)
