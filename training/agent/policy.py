"""Policy backends behind one interface: ``complete(...) -> PolicyTurn``.

``OpenAIChatPolicy`` talks to any OpenAI-compatible chat-completions server with tool calling
through the official ``openai`` client. Flowstate's built-in model is served by the project's own
``/v1/chat/completions`` (webapp.agents.openai_api), so it goes through exactly this class too.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import openai

from sandboxes.outbound import pinned_http_client


class PolicyError(Exception):
    """The policy could not produce a turn.

    ``infrastructure`` is True when the cause is the serving side (connection refused, timeout,
    5xx), so RL must drop the rollout instead of scoring it as a zero reward.
    """

    def __init__(self, message: str, *, infrastructure: bool) -> None:
        super().__init__(message)
        self.infrastructure = infrastructure


@dataclass
class PolicyToolCall:
    """One tool call the model requested, arguments still as the raw JSON text it produced."""

    id: str
    name: str
    arguments_json: str


@dataclass
class PolicyTurn:
    """One model response."""

    content: str
    tool_calls: list[PolicyToolCall]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str = "stop"
    tokens_estimated: bool = False
    """True when token counts are a length-based estimate (scripted expert), not a tokenizer count."""
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    routed_experts: Any = None
    duration_s: float = 0.0


class Policy(Protocol):
    name: str

    def complete(
        self, *, messages: list[dict], tools: list[dict], max_tokens: int, temperature: float, top_p: float,
        timeout_s: float,
    ) -> PolicyTurn: ...


@dataclass
class OpenAIChatPolicy:
    """Any OpenAI-compatible chat-completions server (OpenAI, vLLM, Flowstate's own ``/v1``)."""

    base_url: str
    """Server root including the version prefix, e.g. ``http://127.0.0.1:8000/v1``."""
    model: str
    """Model name sent in every request (see the server's ``/v1/models``)."""
    api_key: str
    """Bearer token; for Flowstate's endpoint, the user's API token."""
    max_retries: int = 2
    """Retries of the openai client on connection errors, 429 and 5xx."""
    seed: int | None = None
    """Sampling seed forwarded to servers that honour it."""
    extra_body: dict = field(default_factory=dict)
    """Extra JSON fields sent with every request (server-specific options)."""
    user_url: bool = False
    """True when a user chose ``base_url``: its host goes through the outbound address guard now (every
    address public unless allow-listed, ``sandboxes.outbound``), raising OutboundRefused, and the client
    connects only to the address checked, following no redirects, sending ``api_key`` (if any) as its only
    credential. False: the operator configured it."""

    def __post_init__(self) -> None:
        if not self.base_url or not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"OpenAIChatPolicy.base_url must be an http(s) URL, got {self.base_url!r}")
        if not self.model:
            raise ValueError("OpenAIChatPolicy.model must name the model to call")
        # A user's server gets the key given here or none: the pinned client drops whatever the openai
        # library adds from this process's environment (OPENAI_ORG_ID, OPENAI_CUSTOM_HEADERS, ...).
        http_client = pinned_http_client(self.base_url, label="base_url", bearer_token=self.api_key) \
            if self.user_url else None
        self._client = openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "none",
                                     max_retries=self.max_retries, http_client=http_client)

    @property
    def name(self) -> str:
        return f"{self.model} @ {self.base_url}"

    def complete(
        self, *, messages: list[dict], tools: list[dict], max_tokens: int, temperature: float, top_p: float,
        timeout_s: float,
    ) -> PolicyTurn:
        request: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "timeout": max(1.0, timeout_s),
        }
        if tools:
            request["tools"] = tools
        if self.seed is not None:
            request["seed"] = self.seed
        if self.extra_body:
            request["extra_body"] = self.extra_body
        started = time.monotonic()
        try:
            response = self._client.chat.completions.create(**request)
        except (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError) as exc:
            raise PolicyError(f"policy server unreachable or failing: {exc}", infrastructure=True) from exc
        except openai.RateLimitError as exc:
            raise PolicyError(f"policy server rate limit: {exc}", infrastructure=True) from exc
        except openai.APIStatusError as exc:
            raise PolicyError(f"policy server refused the request ({exc.status_code}): {exc.message}",
                              infrastructure=exc.status_code in (401, 403, 404, 503)) from exc
        if not response.choices:
            raise PolicyError("policy server returned no choices", infrastructure=True)
        choice = response.choices[0]
        message = choice.message
        calls = [
            PolicyToolCall(id=call.id or f"call_{index}", name=call.function.name, arguments_json=call.function.arguments or "{}")
            for index, call in enumerate(message.tool_calls or [])
        ]
        usage = response.usage
        extension = (response.model_extra or {}).get("flowstate") or {}
        logprobs = extension.get("logprobs")
        if logprobs is None and choice.logprobs is not None and choice.logprobs.content:
            logprobs = [item.logprob for item in choice.logprobs.content]
        return PolicyTurn(
            content=message.content or "",
            tool_calls=calls,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            finish_reason=choice.finish_reason or "stop",
            token_ids=extension.get("token_ids"),
            logprobs=logprobs,
            routed_experts=extension.get("routed_experts"),
            duration_s=time.monotonic() - started,
        )


def tool_call_json(call: PolicyToolCall) -> dict:
    """The call as it appears in an OpenAI assistant message."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}


def parse_arguments(call: PolicyToolCall) -> tuple[dict | None, str | None]:
    """Decode the model's argument JSON; on failure return the error to show the model."""
    try:
        arguments = json.loads(call.arguments_json or "{}")
    except json.JSONDecodeError as exc:
        return None, f"arguments of {call.name} are not valid JSON ({exc.msg} at position {exc.pos})"
    if not isinstance(arguments, dict):
        return None, f"arguments of {call.name} must be a JSON object, got {type(arguments).__name__}"
    return arguments, None
