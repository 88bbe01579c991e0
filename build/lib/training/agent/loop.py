"""The agent loop: model turn -> concurrent tool calls -> results -> next turn.

Every step is reported through ``on_event`` as a dict ``{"seq", "kind", "turn", "ts", "payload"}``
with kinds:

- ``start``: prompt, policy name, limits.
- ``turn_start``: a model call begins (``payload.context_tokens`` estimates the prompt size).
- ``model_output``: content, tool call count, prompt/completion tokens, duration.
- ``tool_call``: one requested call (``call_id``, ``name``, ``arguments``, ``index``/``count``
  within the turn, so a UI can group the parallel calls of one turn).
- ``tool_result``: ``ok``, ``output`` (full text), ``display`` (truncated), ``duration_s``,
  ``meta`` and ``finished_at`` (unix time the call finished, for latency measurements).
- ``summary``: the context was replaced by a self-written summary (``summary``, ``context_tokens``).
- ``error``: the run stopped on an error (``message``, ``infrastructure``).
- ``final``: status, reason, final message, diff and token totals; always the last event.

Product tasks persist these events (webapp.agents.services.task_event_append) and RL rollouts keep
them in ``AgentResult.events`` (webapp.agents.services.rollout_record stores them the same way).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from sandboxes.base import Sandbox, SandboxError
from sandboxes.tools import ToolCall, ToolResult, execute_tool_calls, openai_tool_schemas
from training.agent.config import AgentLimits
from training.agent.policy import Policy, PolicyError, PolicyTurn, parse_arguments, tool_call_json

SYSTEM_PROMPT = (
    "You are Flowstate, a coding agent working in a sandboxed copy of a repository (the current "
    "directory). Use the tools to inspect files, edit code and run commands. Several independent tool "
    "calls may be requested in one turn; they run concurrently. When the task is done, reply without "
    "tool calls and describe what you changed."
)
SUMMARY_REQUEST = (
    "Your context is nearly full. Summarise your work so far for yourself: the task, what you found, "
    "what you changed (files and why), what remains to do and the exact next step. Reply with the "
    "summary only; do not call tools."
)
SUMMARY_RESUME = "Task:\n{prompt}\n\nYou already worked on this task. Your summary of the work so far:\n{summary}\n\nContinue."

StatusLiteral = str  # "succeeded" | "failed" | "cancelled"


class AgentStopped(Exception):
    """Raised by an ``on_event`` callback to abort the run (e.g. the task lost its claim)."""


@dataclass
class AgentResult:
    """Outcome of one run; token data is filled when the policy returns it (RL rollouts)."""

    status: StatusLiteral
    reason: str
    final_message: str
    diff: str
    turns: int
    prompt_tokens: int
    completion_tokens: int
    duration_s: float
    messages: list[dict]
    """The OpenAI message list of the last context (after any summaries), final answer included."""
    events: list[dict]
    infrastructure_error: bool = False
    """True when the run stopped because the sandbox or the policy server failed: not the agent's
    fault, so RL must not score it as a zero reward."""
    completions: list[dict] = field(default_factory=list)
    """Per model call: ``turn``, ``token_ids``, ``logprobs``, ``routed_experts``, ``prompt_tokens``."""
    summaries: int = 0


def _estimate_tokens(messages: list[dict]) -> int:
    # ~4 characters per token; only used when the policy reports no usage.
    return sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or "")) for m in messages) // 4


def run_agent(
    *,
    sandbox: Sandbox,
    policy: Policy,
    prompt: str,
    limits: AgentLimits,
    on_event: Callable[[dict], None] | None = None,
    should_stop: Callable[[], str | None] | None = None,
    system_prompt: str = SYSTEM_PROMPT,
    first_seq: int = 0,
    disabled_tools: Collection[str] = (),
) -> AgentResult:
    """Run the agent until it answers without tool calls, a limit is hit, or ``should_stop``
    returns a reason (checked before every model call and tool batch; status ``cancelled``).

    Events are numbered from ``first_seq``. ``on_event`` may raise ``AgentStopped`` to abort; the
    run then ends with status ``failed`` and the exception's message as reason.

    ``disabled_tools`` are still offered (the prompt stays the same) but every call to one is answered
    with an error instead of running: an ablation that measures what a tool's results add without
    changing what the model sees before it calls it.
    """
    if not prompt or not prompt.strip():
        raise ValueError("run_agent needs a non-empty prompt")
    started = time.monotonic()
    tools = openai_tool_schemas()
    events: list[dict] = []
    seq = first_seq
    turn = 0

    def emit(kind: str, payload: dict[str, Any]) -> None:
        nonlocal seq
        event = {"seq": seq, "kind": kind, "turn": turn, "ts": time.time(), "payload": payload}
        seq += 1
        events.append(event)
        if on_event is not None:
            on_event(event)

    messages: list[dict] = [{"role": "system", "content": system_prompt}, {"role": "user", "content": prompt}]
    totals = {"prompt": 0, "completion": 0}
    completions: list[dict] = []
    summaries = 0
    last_context_tokens = 0

    def finish(status: str, reason: str, final_message: str = "", infrastructure: bool = False) -> AgentResult:
        try:
            diff = sandbox.diff()
        except SandboxError as exc:
            diff = ""
            if status == "succeeded":
                status, reason, infrastructure = "failed", f"could not compute the final diff: {exc}", True
        emit("final", {
            "status": status, "reason": reason, "content": final_message, "diff": diff,
            "prompt_tokens": totals["prompt"], "completion_tokens": totals["completion"],
            "turns": turn, "summaries": summaries, "duration_s": round(time.monotonic() - started, 3),
            "infrastructure": infrastructure,
        })
        return AgentResult(
            status=status, reason=reason, final_message=final_message, diff=diff, turns=turn,
            prompt_tokens=totals["prompt"], completion_tokens=totals["completion"],
            duration_s=time.monotonic() - started, messages=messages, events=events,
            infrastructure_error=infrastructure, completions=completions, summaries=summaries,
        )

    def call_policy(call_messages: list[dict], call_tools: list[dict]) -> PolicyTurn:
        remaining = limits.wall_time_s - (time.monotonic() - started)
        budget = min(limits.max_tokens_per_turn, limits.max_tokens - totals["completion"])
        result = policy.complete(
            messages=call_messages, tools=call_tools, max_tokens=max(1, budget), temperature=limits.temperature,
            top_p=limits.top_p, timeout_s=max(1.0, remaining),
        )
        totals["prompt"] += result.prompt_tokens
        totals["completion"] += result.completion_tokens
        completions.append({
            "turn": turn, "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "token_ids": result.token_ids, "logprobs": result.logprobs, "routed_experts": result.routed_experts,
        })
        return result

    emit("start", {"prompt": prompt, "policy": policy.name, "limits": limits.to_dict(),
                   "tools": [tool["function"]["name"] for tool in tools]})
    try:
        while True:
            if should_stop is not None and (stop_reason := should_stop()):
                return finish("cancelled", stop_reason)
            if time.monotonic() - started > limits.wall_time_s:
                return finish("failed", f"wall time limit of {limits.wall_time_s:g}s reached after {turn} turns")
            if totals["completion"] >= limits.max_tokens:
                return finish("failed", f"token budget of {limits.max_tokens} completion tokens used up")
            if turn >= limits.max_turns:
                return finish("failed", f"turn limit of {limits.max_turns} reached without a final answer")

            if last_context_tokens >= limits.summarize_at * limits.context_tokens:
                if summaries >= limits.max_summaries:
                    return finish("failed", f"context full after {summaries} summaries (max_summaries)")
                summary_turn = call_policy([*messages, {"role": "user", "content": SUMMARY_REQUEST}], [])
                summaries += 1
                summary = summary_turn.content.strip() or "(the model returned an empty summary)"
                emit("summary", {
                    "summary": summary, "context_tokens": last_context_tokens, "index": summaries,
                    "prompt_tokens": summary_turn.prompt_tokens, "completion_tokens": summary_turn.completion_tokens,
                })
                messages = [messages[0], {"role": "user", "content": SUMMARY_RESUME.format(prompt=prompt, summary=summary)}]
                last_context_tokens = _estimate_tokens(messages)
                continue

            turn += 1
            emit("turn_start", {"context_tokens": last_context_tokens or _estimate_tokens(messages)})
            model_turn = call_policy(messages, tools)
            last_context_tokens = (model_turn.prompt_tokens + model_turn.completion_tokens) or _estimate_tokens(messages)
            assistant: dict[str, Any] = {"role": "assistant", "content": model_turn.content}
            if model_turn.tool_calls:
                assistant["tool_calls"] = [tool_call_json(call) for call in model_turn.tool_calls]
            messages.append(assistant)
            emit("model_output", {
                "content": model_turn.content, "tool_calls": len(model_turn.tool_calls),
                "prompt_tokens": model_turn.prompt_tokens, "completion_tokens": model_turn.completion_tokens,
                "tokens_estimated": model_turn.tokens_estimated, "finish_reason": model_turn.finish_reason,
                "duration_s": round(model_turn.duration_s, 4),
            })
            if not model_turn.tool_calls:
                return finish("succeeded", "the agent answered without further tool calls", model_turn.content)

            if should_stop is not None and (stop_reason := should_stop()):
                return finish("cancelled", stop_reason)
            runnable: list[ToolCall] = []
            refused: dict[str, str] = {}
            count = len(model_turn.tool_calls)
            for index, call in enumerate(model_turn.tool_calls):
                arguments, problem = parse_arguments(call)
                emit("tool_call", {"call_id": call.id, "name": call.name, "arguments": arguments
                                   if arguments is not None else call.arguments_json, "index": index, "count": count})
                if problem:
                    refused[call.id] = problem
                elif call.name in disabled_tools:
                    refused[call.id] = f"the tool {call.name} is disabled in this run"
                else:
                    runnable.append(ToolCall(id=call.id, name=call.name, arguments=arguments))
            results = {result.call_id: result for result in execute_tool_calls(sandbox=sandbox, calls=runnable)} if runnable else {}
            finished_at = time.time()
            for call in model_turn.tool_calls:
                result: ToolResult | None = results.get(call.id)
                if result is None:
                    output = f"error: {refused.get(call.id, 'the tool produced no result')}"
                    payload = {"call_id": call.id, "name": call.name, "ok": False, "output": output,
                               "display": output, "duration_s": 0.0, "meta": {}}
                else:
                    output = result.output
                    payload = {"call_id": call.id, "name": call.name, "ok": result.ok, "output": result.output,
                               "display": result.display, "duration_s": round(result.duration_s, 4),
                               "meta": dict(result.meta or {})}
                payload["finished_at"] = finished_at
                emit("tool_result", payload)
                if len(output) > limits.tool_output_chars:
                    output = output[: limits.tool_output_chars] + f"\n[... {len(output) - limits.tool_output_chars} more characters cut]"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    except PolicyError as exc:
        emit("error", {"message": str(exc), "infrastructure": exc.infrastructure})
        return finish("failed", f"policy error: {exc}", infrastructure=exc.infrastructure)
    except SandboxError as exc:
        emit("error", {"message": f"{type(exc).__name__}: {exc}", "infrastructure": True})
        return finish("failed", f"sandbox error: {type(exc).__name__}: {exc}", infrastructure=True)
    except AgentStopped as exc:
        # The callback refused further events: do not emit more (it would refuse those too).
        return AgentResult(
            status="failed", reason=str(exc), final_message="", diff="", turns=turn,
            prompt_tokens=totals["prompt"], completion_tokens=totals["completion"],
            duration_s=time.monotonic() - started, messages=messages, events=events,
            infrastructure_error=True, completions=completions, summaries=summaries,
        )
