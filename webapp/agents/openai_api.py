"""OpenAI-compatible endpoint serving the configured Flowstate checkpoint.

``POST /v1/chat/completions`` (tools, streaming, ``stream_options.include_usage``) and
``GET /v1/models``, authenticated with a Flowstate API token as the bearer key, so the official
``openai`` client, the agent loop's ``OpenAIChatPolicy`` and third-party tools all work unchanged.
``n`` (1..16 independent samples; choice i seeded from ``seed`` and i), ``logprobs`` and ``top_logprobs``
(0..20) work for the built-in and every registered model, streamed or not (webapp.agents.openai_responses).
Responses carry the standard fields plus ``flowstate`` (prompt/completion token ids, logprobs,
routed experts) for RL.

Per-user limits (webapp.accounts.limits): USER_MAX_V1_CONCURRENT requests in flight and
USER_MAX_V1_TOKENS_PER_MINUTE tokens (n x max_tokens reserved up front, settled to prompt + generated
tokens when the request ends); past either the answer is OpenAI's 429 with Retry-After and the limit's name.
The shared model shares its batch slots fairly between users (training.serving_scheduler).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import redis
from django.conf import settings
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST
from rest_framework.authtoken.models import Token

from webapp.accounts.limits import V1_TOKENS_PER_MINUTE, LimitExceeded, V1Usage, v1_request_begin
from webapp.agents.openai_responses import completion_response, streaming_response
from webapp.core.validation import Range, finite_json_loads, integer_check, number_check

MAX_CHOICES = 16
"""Most choices (``n``) per request; training.serving.MAX_CHOICES."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per token (``top_logprobs``), OpenAI's limit; training.sampling.MAX_TOP_LOGPROBS."""


logger = logging.getLogger(__name__)


def _error(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> JsonResponse:
    return JsonResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status)


def _authenticated(request):
    """The active user whose API token is the bearer key, or None."""
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    token = Token.objects.select_related("user").filter(key=key.strip(), user__is_active=True).first()
    return token.user if token else None


def _registered_chat_model(user, name: str):
    """(HFChatModel of the registered model `name` visible to `user`, None), or (None, error response)."""
    from training.hf.chat import TemplateRenderError
    from training.hf.loading import HFDirectoryError
    from training.hf.serving import HFChatModel
    from training.hf.weights import WeightsError
    from webapp.registry.selectors import registered_models_visible_to

    registered = registered_models_visible_to(user=user).filter(name=name).first()
    if registered is None:
        return None, _error(404, f"model '{name}' does not exist; see /v1/models for the models you may use",
                            param="model", code="model_not_found")
    try:
        return HFChatModel.shared(registered.directory, registered.name, context=settings.MODELS_SERVING_CONTEXT), None
    except (HFDirectoryError, WeightsError, TemplateRenderError, OSError, ValueError) as exc:
        return None, _error(503, f"model '{name}' cannot be loaded: {exc}", kind="server_error",
                            code="model_unavailable")


def _chat_model():
    from training.checkpoint import CheckpointError
    from training.serving import ChatModel

    if not settings.MODEL_CHECKPOINT:
        return None, _error(503, "no model is configured: set FLOWSTATE_MODEL_CHECKPOINT to a checkpoint directory",
                            kind="server_error", code="model_not_configured")
    try:
        return ChatModel.shared(settings.MODEL_CHECKPOINT), None
    except (CheckpointError, OSError, ValueError) as exc:
        return None, _error(503, f"the configured checkpoint cannot be loaded: {exc}", kind="server_error",
                            code="model_unavailable")


def _parse_request(body: bytes) -> tuple[dict[str, Any] | None, JsonResponse | None]:
    try:
        data = finite_json_loads(body or b"{}")
    except (ValueError, RecursionError) as exc:
        return None, _error(400, f"the request body is not valid JSON: {exc}")
    if not isinstance(data, dict):
        return None, _error(400, "the request body must be a JSON object")
    if not isinstance(data.get("model"), str) or not data["model"]:
        return None, _error(400, "model must be a model name (see /v1/models)", param="model")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        return None, _error(400, "messages must be a non-empty list of objects with a role", param="messages")
    tools = data.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function" for t in tools):
        return None, _error(400, "tools must be a list of {\"type\": \"function\", \"function\": {...}} objects", param="tools")
    tokens = Range(1, settings.AGENT_MAX_CONTEXT_TOKENS)
    checks = (("max_tokens", integer_check, tokens), ("max_completion_tokens", integer_check, tokens),
              ("temperature", number_check, Range(0, 2)), ("top_p", number_check, Range(0, 1)),
              ("seed", integer_check, Range(-(2**63), 2**63 - 1)), ("n", integer_check, Range(1, MAX_CHOICES)),
              ("top_logprobs", integer_check, Range(0, MAX_TOP_LOGPROBS)))
    for name, check, bounds in checks:
        if data.get(name) is not None:
            try:
                check(name, data[name], bounds)
            except ValueError as exc:
                return None, _error(400, str(exc), param=name)
    if data.get("logprobs") is not None and not isinstance(data["logprobs"], bool):
        return None, _error(400, "logprobs must be true or false", param="logprobs")
    if data.get("top_logprobs") is not None and not data.get("logprobs"):
        return None, _error(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    return {
        "n": data.get("n") or 1, "logprobs": bool(data.get("logprobs")), "top_logprobs": data.get("top_logprobs") or 0,
        "messages": messages, "tools": tools, "max_tokens": data.get("max_completion_tokens") or data.get("max_tokens"),
        "temperature": float(data.get("temperature", 1.0)), "top_p": float(data.get("top_p", 1.0)), "seed": data.get("seed"),
        "model": data["model"], "stream": bool(data.get("stream")), "include_usage": bool((data.get("stream_options") or {}).get("include_usage")),
    }, None


@csrf_exempt
@require_POST
def chat_completions(request):
    user = _authenticated(request)
    if user is None:
        return _error(401, "send your Flowstate API token as 'Authorization: Bearer <token>'", kind="authentication_error",
                      code="invalid_api_key")
    parsed, problem = _parse_request(request.body)
    if problem:
        return problem
    model_name = parsed["model"]
    if model_name == settings.AGENT_BUILTIN_MODEL_NAME:
        model, problem = _chat_model()
    else:
        model, problem = _registered_chat_model(user, model_name)
    if problem:
        return problem
    model.scheduler.reserved_slots = settings.SERVING_RESERVED_SLOTS
    try:
        usage = v1_request_begin(user=user, tokens=parsed["n"] * (parsed["max_tokens"] or model.engine.max_seq_len))
    except LimitExceeded as exc:
        return _rate_limited(exc)
    except redis.RedisError as exc:
        return _error(503, f"the request limits cannot be checked: {exc}", kind="server_error", code="limits_unavailable")
    arguments = {key: parsed[key] for key in ("messages", "tools", "n", "max_tokens", "temperature", "top_p", "seed",
                                              "top_logprobs")}
    try:
        stream = _metered(model.stream_choices(**arguments, owner=("user", user.pk)), usage)
        first = next(stream)
    except ValueError as exc:
        return _error(400, str(exc), param="messages", code="context_length_exceeded")
    except Exception as exc:  # noqa: BLE001 - any generation failure becomes an OpenAI-style 500
        return _error(500, f"generation failed: {type(exc).__name__}: {exc}", kind="server_error")
    header = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}
    token_bytes = model.token_bytes() if parsed["logprobs"] else None
    if not parsed["stream"]:
        return completion_response(first, stream, header=header, n=parsed["n"], token_bytes=token_bytes)
    return streaming_response(first, stream, header=header, n=parsed["n"], token_bytes=token_bytes,
                              include_usage=parsed["include_usage"])


def _rate_limited(exc: LimitExceeded) -> JsonResponse:
    """OpenAI's 429 (type "tokens" or "requests", code "rate_limit_exceeded") naming the limit, with Retry-After."""
    kind = "tokens" if exc.limit == V1_TOKENS_PER_MINUTE else "requests"
    response = JsonResponse({"error": {"message": f"{exc.limit}: {exc.message}", "type": kind, "param": None,
                                       "code": "rate_limit_exceeded", "limit": exc.limit,
                                       "retry_after": exc.retry_after}}, status=429)
    response["Retry-After"] = str(exc.retry_after)
    return response


def _metered(stream: Iterator, usage: V1Usage) -> Iterator:
    """`stream`'s items; when it ends (finished, failed or closed) the request's lease is given back and its
    token reservation settled to the prompt and generated tokens."""
    from training.serving import ChatCompletion

    prompt_tokens = generated = 0
    try:
        for item in stream:
            if isinstance(item, ChatCompletion):
                prompt_tokens = item.prompt_tokens
            else:
                generated += len(item.tokens)
            yield item
    finally:
        try:
            usage.finish(used_tokens=prompt_tokens + generated)
        except redis.RedisError:  # the lease expires on its own (V1_REQUEST_LEASE_S)
            logger.exception("could not give back a /v1 request's lease")


@require_GET
def models(request):
    from webapp.registry.selectors import registered_models_visible_to

    user = _authenticated(request)
    if user is None:
        return _error(401, "send your Flowstate API token as 'Authorization: Bearer <token>'", kind="authentication_error",
                      code="invalid_api_key")
    data = [{
        "id": settings.AGENT_BUILTIN_MODEL_NAME, "object": "model", "created": 0, "owned_by": "flowstate",
        "checkpoint_configured": bool(settings.MODEL_CHECKPOINT),
    }]
    for registered in registered_models_visible_to(user=user).select_related("owner"):
        data.append({
            "id": registered.name, "object": "model", "created": int(registered.created_at.timestamp()),
            "owned_by": registered.owner.username if registered.owner else "flowstate", "family": registered.family,
        })
    return JsonResponse({"object": "list", "data": data})
