"""Settings helpers that read environment variables and fail loudly on bad values.

Every setting that comes from the environment goes through one of these helpers so a typo in a
deployment (``DEBUG=ture``, ``SANDBOX_BACKEND=dokcer``) stops the process at start-up with a message
naming the variable, instead of silently falling back to a default.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


class ConfigurationError(RuntimeError):
    """Raised when an environment variable holds a value the platform cannot use."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_str(name: str, default: str | None = None) -> str:
    value = os.environ.get(name)
    if value is None or value == "":
        if default is None:
            raise ConfigurationError(f"{name} must be set")
        return default
    return value


def env_optional(name: str) -> str | None:
    value = os.environ.get(name, "")
    return value or None


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigurationError(f"{name}={raw!r} is not a boolean; use one of {sorted(_TRUE | _FALSE)}")


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        value = default
    else:
        try:
            value = int(raw)
        except ValueError:
            raise ConfigurationError(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ConfigurationError(f"{name}={value} is below the minimum {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigurationError(f"{name}={value} is above the maximum {maximum}")
    return value


def env_choice(name: str, default: str, choices: Sequence[str]) -> str:
    value = env_str(name, default)
    if value not in choices:
        raise ConfigurationError(f"{name}={value!r} is not one of {list(choices)}")
    return value


def env_runtime_list(name: str, default: Sequence[str]) -> list[str]:
    """A comma-separated list of OCI runtime names (``docker info`` spells them so)."""
    from sandboxes.settings import RUNTIME_NAME

    names = env_list(name, default)
    bad = [item for item in names if not RUNTIME_NAME.fullmatch(item)]
    if bad:
        raise ConfigurationError(f"{name}: {', '.join(map(repr, bad))} is not an OCI runtime name (e.g. runc, runsc)")
    return names


def env_list(name: str, default: Sequence[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]
