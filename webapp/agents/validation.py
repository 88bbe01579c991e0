"""Checks of a task's limits and policy options: types from AgentLimits, ranges from settings.

Used by the task service (so every path is covered) and by the REST serializer and the form (so the
error sits next to the field). Errors are Django ValidationErrors keyed by the limit's name.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ValidationError

from training.agent.config import AgentConfigError, AgentLimits
from webapp.core.validation import (
    Range,
    dataclass_field_kinds,
    integer_check,
    number_check,
    ranges_check,
    typed_fields_check,
)

SEED_RANGE = Range(0, 2**32 - 1)
STEP_DELAY_RANGE = Range(0, 60)


def agent_limit_bounds() -> dict[str, Range]:
    """The range of every AgentLimits field a user may set (upper ends from settings)."""
    return {
        "max_turns": Range(1, settings.AGENT_MAX_TURNS),
        "max_tokens": Range(1, settings.AGENT_MAX_TOKENS),
        "max_tokens_per_turn": Range(1, settings.AGENT_MAX_CONTEXT_TOKENS),
        "wall_time_s": Range(1, settings.AGENT_MAX_WALL_TIME_S),
        "context_tokens": Range(1, settings.AGENT_MAX_CONTEXT_TOKENS),
        "summarize_at": Range(0.1, 1.0),
        "max_summaries": Range(0, 100),
        "temperature": Range(0, 2),
        "top_p": Range(0, 1),
        "tool_output_chars": Range(1, 1_000_000),
    }


def _field_named_in(message: str) -> str:
    text = message.removeprefix("AgentLimits.")
    names = sorted(dataclass_field_kinds(AgentLimits), key=len, reverse=True)
    return next((name for name in names if text.startswith(name)), "limits")


def agent_limits_check(limits: Any) -> dict[str, Any]:
    """Every AgentLimits field, defaults filled in, or a ValidationError keyed by the field to fix:
    types first, then AgentLimits' own rules (their messages explain them), then the ranges."""
    values = typed_fields_check(AgentLimits, limits if limits is not None else {})
    try:
        checked = AgentLimits(**values).to_dict()
    except AgentConfigError as error:
        message = str(error).removeprefix("AgentLimits.")
        raise ValidationError({_field_named_in(str(error)): [message]}) from error
    ranges_check(values, bounds=agent_limit_bounds())
    return checked


def policy_options_check(*, backend: str, options: Any) -> dict[str, Any]:
    """Options of the policy backend: scripted takes step_delay_s (seconds), the others a seed."""
    from webapp.agents.models import AgentTask

    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValidationError({"policy_options": ["must be a JSON object"]})
    allowed = {"step_delay_s"} if backend == AgentTask.Backend.SCRIPTED else {"seed"}
    errors: dict[str, list[str]] = {}
    checked: dict[str, Any] = {}
    for name, value in options.items():
        try:
            if name not in allowed:
                raise ValueError(f"unknown option {str(name)[:100]!r} for backend {backend}; "
                                 f"allowed: {', '.join(sorted(allowed))}")
            if name == "step_delay_s":
                checked[name] = number_check(name, value, STEP_DELAY_RANGE)
            else:
                checked[name] = integer_check(name, value, SEED_RANGE)
        except ValueError as error:
            errors.setdefault("policy_options", []).append(str(error))
    if errors:
        raise ValidationError(errors)
    return checked


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit((url or "").strip())
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except ValueError:
        port = None
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


def is_operator_openai_url(url: str) -> bool:
    """Whether ``url`` is the operator's OpenAI-compatible server (``OPENAI_BASE_URL``): the only one that
    may get the operator's ``OPENAI_API_KEY`` and that the outbound address guard does not check."""
    configured = (settings.OPENAI_BASE_URL or "").strip().rstrip("/")
    return bool(configured) and (url or "").strip().rstrip("/") == configured


def base_url_check(*, url: str, builtin_base_url: str = "") -> str:
    """An openai-backend task's base URL: the operator's ``OPENAI_BASE_URL``, or a user's URL that passes the
    outbound address guard of git URLs (http(s), every address public unless allow-listed in
    FLOWSTATE_GIT_ALLOWED_HOSTS; a name that does not resolve yet is checked again when the task runs).
    This server's own ``/v1`` (``builtin_base_url``) is refused: that is backend=builtin, under the owner's token.
    """
    from sandboxes.git_fetch import OutboundRefused
    from sandboxes.outbound import check_http_url

    url = (url or "").strip()
    if is_operator_openai_url(url):
        return url
    if builtin_base_url and _origin(url) == _origin(builtin_base_url):
        raise ValidationError({"base_url": ["this is the server's own /v1 endpoint; choose backend=builtin for it"]})
    try:
        check_http_url(url, label="base_url", resolve_required=False)
    except OutboundRefused as exc:
        raise ValidationError({"base_url": [str(exc)]}) from None
    return url


def sandbox_runtime_check(runtime: str | None) -> str:
    """A task's isolation tier: blank (the configured ``SANDBOX_DOCKER_RUNTIME``) or one of
    ``SANDBOX_RUNTIMES_ALLOWED``; another runtime than the default needs Docker sandboxes."""
    runtime = (runtime or "").strip()
    if not runtime:
        return ""
    allowed = list(settings.SANDBOX_RUNTIMES_ALLOWED)
    if runtime not in allowed:
        raise ValidationError({"sandbox_runtime": f"'{runtime[:64]}' is not an allowed sandbox runtime; choose one of "
                                                  f"{', '.join(allowed)} (SANDBOX_RUNTIMES_ALLOWED)"})
    where = settings.AGENT_SANDBOX_BACKEND or settings.SANDBOX_BACKEND
    if where != "docker" and runtime != settings.SANDBOX_DOCKER_RUNTIME:
        raise ValidationError({"sandbox_runtime": f"the sandbox runtime {runtime} needs Docker sandboxes; this server's "
                                                  f"tasks run on the {where} backend"})
    return runtime
