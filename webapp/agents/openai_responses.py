"""Response bodies of ``POST /v1/chat/completions``: whole (``chat.completion``) or server-sent events
(``chat.completion.chunk``), for n choices, with OpenAI's logprobs shape when asked for.

``choices[i].logprobs.content[j]`` is ``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``
for every generated token of choice i, tool-call markup and the stop token included (so the entries'
logprobs sum to the completion's log-probability, and match ``flowstate.logprobs``). Streamed, each content
chunk carries the entries of the tokens behind its text; tokens that show no text come with the next
chunk, at the latest one with an empty delta before the choice's finish chunk.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from django.http import JsonResponse, StreamingHttpResponse

if TYPE_CHECKING:  # training.serving imports torch: the web process loads it only when a model is served
    from training.serving import ChatCompletion, ChatDelta
    from training.token_bytes import TokenBytes

UNLIKELY = -9999.0
"""Reported instead of -inf (a token a constraint ruled out), as OpenAI does: JSON has no infinity."""


def _logprob_entry(token_bytes: TokenBytes, token_id: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes.bytes_of(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob if math.isfinite(logprob) else UNLIKELY,
            "bytes": list(raw)}


def logprobs_content(token_bytes: TokenBytes, tokens: Iterable[tuple[int, float, list[tuple[int, float]]]]
                     ) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content`` for (token id, logprob, [(alternative id, logprob)]) triples."""
    return [{**_logprob_entry(token_bytes, token_id, logprob),
             "top_logprobs": [_logprob_entry(token_bytes, other, value) for other, value in top]}
            for token_id, logprob, top in tokens]


def _completion_logprobs(completion: ChatCompletion, token_bytes: TokenBytes | None) -> dict | None:
    if token_bytes is None:
        return None
    tops = completion.top_logprobs or [[] for _ in completion.token_ids]
    return {"content": logprobs_content(token_bytes, zip(completion.token_ids, completion.logprobs, tops, strict=True)),
            "refusal": None}


def _usage(completions: list[ChatCompletion]) -> dict:
    prompt = completions[0].prompt_tokens
    generated = sum(completion.completion_tokens for completion in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def _finished(first, stream: Iterator) -> list[ChatCompletion]:
    """Drain the stream; the completions ordered by choice index."""
    from training.serving import ChatCompletion

    completions = [item for item in chain([first], stream) if isinstance(item, ChatCompletion)]
    return sorted(completions, key=lambda completion: completion.index)


def completion_response(first, stream: Iterator, *, header: dict, n: int,
                        token_bytes: TokenBytes | None) -> JsonResponse:
    """A non-streaming answer: every choice generated to its end."""
    completions = _finished(first, stream)
    choices = []
    for completion in completions:
        message: dict[str, Any] = {"role": "assistant", "content": completion.content}
        if completion.tool_calls:
            message["tool_calls"] = completion.tool_calls
        choice = {"index": completion.index, "message": message, "finish_reason": completion.finish_reason,
                  "logprobs": _completion_logprobs(completion, token_bytes)}
        if n > 1:
            choice["flowstate"] = completion.flowstate_extension()
        choices.append(choice)
    return JsonResponse({**header, "object": "chat.completion", "choices": choices, "usage": _usage(completions),
                         "flowstate": completions[0].flowstate_extension()})


def _delta_logprobs(delta: ChatDelta, token_bytes: TokenBytes | None) -> dict | None:
    if token_bytes is None:
        return None
    return {"content": logprobs_content(token_bytes, ((t.token_id, t.logprob, t.top) for t in delta.tokens)),
            "refusal": None}


def _events(first, stream: Iterator, *, header: dict, n: int, token_bytes: TokenBytes | None,
            include_usage: bool) -> Iterator[str]:
    from training.serving import ChatDelta

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None,
              **extra) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs, **extra}
        return f"data: {json.dumps({**header, 'object': 'chat.completion.chunk', 'choices': [choice]})}\n\n"

    for index in range(n):
        yield chunk(index, {"role": "assistant", "content": ""})
    completions: list[ChatCompletion] = []
    try:
        for item in chain([first], stream):
            if isinstance(item, ChatDelta):
                if item.text or token_bytes is not None:
                    yield chunk(item.index, {"content": item.text} if item.text else {},
                                logprobs=_delta_logprobs(item, token_bytes))
                continue
            completions.append(item)
            if item.tool_calls:
                calls = [dict(call, index=number) for number, call in enumerate(item.tool_calls)]
                yield chunk(item.index, {"tool_calls": calls})
            extra = {"flowstate": item.flowstate_extension()} if n > 1 else {}
            yield chunk(item.index, {}, item.finish_reason, **extra)
        if include_usage:
            completions.sort(key=lambda completion: completion.index)
            body = {**header, "object": "chat.completion.chunk", "choices": [], "usage": _usage(completions),
                    "flowstate": completions[0].flowstate_extension()}
            yield f"data: {json.dumps(body)}\n\n"
    except Exception as exc:  # noqa: BLE001 - headers are sent; report in-stream as OpenAI does
        yield "data: " + json.dumps({"error": {"message": f"generation failed: {exc}", "type": "server_error"}}) + "\n\n"
    yield "data: [DONE]\n\n"


def streaming_response(first, stream: Iterator, *, header: dict, n: int, token_bytes: TokenBytes | None,
                       include_usage: bool) -> StreamingHttpResponse:
    """A server-sent-events answer: each choice's text (and logprobs) as generated, then its tool calls and
    finish reason; the usage of all choices last when asked for."""
    iterator = _events(first, stream, header=header, n=n, token_bytes=token_bytes, include_usage=include_usage)

    async def events_async():
        # Pull each chunk in a worker thread so the event loop keeps serving while tokens are generated.
        done = object()
        while (part := await sync_to_async(next, thread_sensitive=False)(iterator, done)) is not done:
            yield part

    response = StreamingHttpResponse(events_async(), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response
