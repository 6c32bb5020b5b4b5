"""Import hook for verl workers: the `verl.plugins` entry point and the
`actor_rollout_ref.model.external_lib=rl_logp.integrations.verl_hook` route.

Patches verl once per process when `RL_LOGP_BACKEND` is set (the other `RL_LOGP_*` variables tune it);
does nothing when no `RL_LOGP_*` variable asks for it, so installing rl-logp never changes verl by itself.

Fail-closed: verl's plugin loader (`verl/__init__.py`) catches any exception an entry point raises and logs
it at DEBUG, so an invalid value would leave verl silently unpatched. Instead, an invalid `RL_LOGP_*`
value (or `RL_LOGP_STRICT=1` without `RL_LOGP_BACKEND`) is logged at ERROR naming the variable and the
valid values, verl's logp functions are replaced by stand-ins that raise the same message (the first logp
call fails), and the import raises `ConfigurationError` (fatal on the `external_lib` route, which verl
does not catch).
"""

from __future__ import annotations

import dataclasses
import os

import rl_logp

ENV_PREFIX = "RL_LOGP_"
BACKEND_VAR = "RL_LOGP_BACKEND"
STRICT_VAR = "RL_LOGP_STRICT"


class ConfigurationError(ValueError):
    """An `RL_LOGP_*` environment variable asks for rl-logp with a value it cannot use."""


def config_variables() -> list[str]:
    """The environment variables `rl_logp.resolve_config` reads."""
    return [ENV_PREFIX + f.name.upper() for f in dataclasses.fields(rl_logp.LogpConfig)]


def config_from_environment(environ: dict[str, str] | None = None) -> rl_logp.LogpConfig | None:
    """The config the environment asks for, None when it asks for nothing; `ConfigurationError` naming
    each bad variable, its value and the valid values otherwise."""
    env = dict(os.environ if environ is None else environ)
    present = {name: env[name] for name in config_variables() if name in env}
    if BACKEND_VAR not in present:
        strict = present.get(STRICT_VAR, "").strip().lower()
        if strict not in ("", "0", "false", "no", "off"):
            raise ConfigurationError(
                f"rl_logp: {STRICT_VAR}={present[STRICT_VAR]!r} asks for strict rl-logp but {BACKEND_VAR} is not "
                f"set, so nothing would be patched; set {BACKEND_VAR}=auto (one of {', '.join(rl_logp.BACKENDS)})"
            )
        return None
    problems = []
    for name, value in present.items():
        try:
            rl_logp.resolve_config(environ={name: value})
        except (ValueError, TypeError) as err:
            problems.append(f"{name}={value!r}: {err}")
    if not problems:
        try:
            return rl_logp.resolve_config(environ=present)
        except (ValueError, TypeError) as err:
            problems.append(f"{', '.join(f'{k}={v!r}' for k, v in present.items())}: {err}")
    raise ConfigurationError("rl_logp: invalid environment for verl: " + "; ".join(problems))


def load() -> None:
    """Entry point: apply the verl patch from the environment (idempotent), or fail closed."""
    from rl_logp.integrations import verl as adapter

    try:
        config = config_from_environment()
    except ConfigurationError as err:
        adapter.refuse(str(err))
        raise
    if config is not None and adapter.active_config() is None:
        adapter.apply(config=config)


load()
