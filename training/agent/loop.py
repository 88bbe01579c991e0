"""The agent loop: model turn -> concurrent tool calls -> results -> next turn.

Every step is reported through ``on_event`` as a dict ``{"seq", "kind", "turn", "ts", "payload"}``
with kinds:

- ``start``: prompt, policy name, limits.
- ``user_message``: a further user turn of the same conversation (``content`` plus the caller's
  ``user_meta``): a follow-up continuing a finished run (``history``) or one delivered when the
  agent stopped (``next_message``).
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
    history: list[dict] | None = None,
    first_turn: int = 0,
    next_message: Callable[[], tuple[str, dict] | None] | None = None,
    user_meta: dict[str, Any] | None = None,
) -> AgentResult:
    """Run the agent until it answers without tool calls, a limit is hit, or ``should_stop``
    returns a reason (checked before every model call and tool batch; status ``cancelled``).

    Events are numbered from ``first_seq``. ``on_event`` may raise ``AgentStopped`` to abort; the
    run then ends with status ``failed`` and the exception's message as reason.

    ``disabled_tools`` are still offered (the prompt stays the same) but every call to one is answered
    with an error instead of running: an ablation that measures what a tool's results add without
    changing what the model sees before it calls it.

    Conversations: with ``history`` (an earlier run's ``AgentResult.messages``) the run continues
    that context with ``prompt`` as the next user message (a ``user_message`` event instead of
    ``start``), numbering turns after ``first_turn``. ``next_message`` is asked whenever the model
    answers without tool calls: a ``(content, meta)`` it returns becomes the next user message and
    the run goes on instead of finishing.
    """
    if not prompt or not prompt.strip():
        raise ValueError("run_agent needs a non-empty prompt")
    run = _AgentRun(
        sandbox=sandbox, policy=policy, prompt=prompt, limits=limits, on_event=on_event,
        system_prompt=system_prompt, first_seq=first_seq, history=history, first_turn=first_turn,
    )
    if history:
        run.emit("user_message", {"content": prompt, "policy": policy.name, **(user_meta or {})})
    else:
        # The OCI runtime of a container sandbox (runc, runsc): which isolation tier the run had.
        runtime = getattr(sandbox, "runtime", None)
        run.emit("start", {"prompt": prompt, "policy": policy.name, "limits": limits.to_dict(),
                           "tools": [tool["function"]["name"] for tool in run.tools],
                           **({"sandbox_runtime": runtime} if isinstance(runtime, str) else {})})
    try:
        while True:
            if should_stop is not None and (stop_reason := should_stop()):
                return run.finish("cancelled", stop_reason)
            if (limit_reason := run.limit_reason()) is not None:
                return run.finish("failed", limit_reason)
            if run.last_context_tokens >= limits.summarize_at * limits.context_tokens:
                if run.summaries >= limits.max_summaries:
                    return run.finish("failed", f"context full after {run.summaries} summaries (max_summaries)")
                run.summarize()
                continue
            model_turn = run.model_turn()
            if not model_turn.tool_calls:
                following = next_message() if next_message is not None else None
                if following is None:
                    return run.finish("succeeded", "the agent answered without further tool calls", model_turn.content)
                content, meta = following
                run.emit("user_message", {"content": content, "policy": policy.name, **meta})
                run.messages.append({"role": "user", "content": content})
                continue
            if should_stop is not None and (stop_reason := should_stop()):
                return run.finish("cancelled", stop_reason)
            run.tool_calls(model_turn.tool_calls, disabled_tools=disabled_tools)
    except PolicyError as exc:
        run.emit("error", {"message": str(exc), "infrastructure": exc.infrastructure})
        return run.finish("failed", f"policy error: {exc}", infrastructure=exc.infrastructure)
    except SandboxError as exc:
        run.emit("error", {"message": f"{type(exc).__name__}: {exc}", "infrastructure": True})
        return run.finish("failed", f"sandbox error: {type(exc).__name__}: {exc}", infrastructure=True)
    except AgentStopped as exc:
        # The callback refused further events: do not emit more (it would refuse those too).
        return run.result("failed", str(exc), final_message="", diff="", infrastructure=True)


class _AgentRun:
    """The state of one run_agent call (conversation, token totals, events) and the steps it takes."""

    def __init__(
        self,
        *,
        sandbox: Sandbox,
        policy: Policy,
        prompt: str,
        limits: AgentLimits,
        on_event: Callable[[dict], None] | None,
        system_prompt: str,
        first_seq: int,
        history: list[dict] | None = None,
        first_turn: int = 0,
    ) -> None:
        self.started = time.monotonic()
        self.sandbox, self.policy, self.prompt, self.limits, self.on_event = sandbox, policy, prompt, limits, on_event
        self.tools = openai_tool_schemas()
        self.events: list[dict] = []
        self.seq = first_seq
        self.first_turn = self.turn = first_turn
        self.messages: list[dict] = [*(history or [{"role": "system", "content": system_prompt}]),
                                     {"role": "user", "content": prompt}]
        self.totals = {"prompt": 0, "completion": 0}
        self.completions: list[dict] = []
        self.summaries = 0
        self.last_context_tokens = 0

    def emit(self, kind: str, payload: dict[str, Any]) -> None:
        event = {"seq": self.seq, "kind": kind, "turn": self.turn, "ts": time.time(), "payload": payload}
        self.seq += 1
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def result(self, status: str, reason: str, *, final_message: str, diff: str, infrastructure: bool) -> AgentResult:
        return AgentResult(
            status=status, reason=reason, final_message=final_message, diff=diff, turns=self.turn,
            prompt_tokens=self.totals["prompt"], completion_tokens=self.totals["completion"],
            duration_s=time.monotonic() - self.started, messages=self.messages, events=self.events,
            infrastructure_error=infrastructure, completions=self.completions, summaries=self.summaries,
        )

    def finish(self, status: str, reason: str, final_message: str = "", infrastructure: bool = False) -> AgentResult:
        try:
            diff = self.sandbox.diff()
        except SandboxError as exc:
            diff = ""
            if status == "succeeded":
                status, reason, infrastructure = "failed", f"could not compute the final diff: {exc}", True
        self.emit("final", {
            "status": status, "reason": reason, "content": final_message, "diff": diff,
            "prompt_tokens": self.totals["prompt"], "completion_tokens": self.totals["completion"],
            "turns": self.turn, "summaries": self.summaries, "duration_s": round(time.monotonic() - self.started, 3),
            "infrastructure": infrastructure,
        })
        return self.result(status, reason, final_message=final_message, diff=diff, infrastructure=infrastructure)

    def limit_reason(self) -> str | None:
        """Why the run must stop before another model call (a limit reached), or None."""
        limits = self.limits
        if time.monotonic() - self.started > limits.wall_time_s:
            return f"wall time limit of {limits.wall_time_s:g}s reached after {self.turn} turns"
        if self.totals["completion"] >= limits.max_tokens:
            return f"token budget of {limits.max_tokens} completion tokens used up"
        if self.turn - self.first_turn >= limits.max_turns:  # limits apply to each run of a conversation
            return f"turn limit of {limits.max_turns} reached without a final answer"
        return None

    def call_policy(self, call_messages: list[dict], call_tools: list[dict]) -> PolicyTurn:
        limits = self.limits
        remaining = limits.wall_time_s - (time.monotonic() - self.started)
        budget = min(limits.max_tokens_per_turn, limits.max_tokens - self.totals["completion"])
        result = self.policy.complete(
            messages=call_messages, tools=call_tools, max_tokens=max(1, budget), temperature=limits.temperature,
            top_p=limits.top_p, timeout_s=max(1.0, remaining),
        )
        self.totals["prompt"] += result.prompt_tokens
        self.totals["completion"] += result.completion_tokens
        self.completions.append({
            "turn": self.turn, "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "token_ids": result.token_ids, "logprobs": result.logprobs, "routed_experts": result.routed_experts,
        })
        return result

    def summarize(self) -> None:
        """Replace the conversation with the model's summary of it (the context is nearly full)."""
        summary_turn = self.call_policy([*self.messages, {"role": "user", "content": SUMMARY_REQUEST}], [])
        self.summaries += 1
        summary = summary_turn.content.strip() or "(the model returned an empty summary)"
        self.emit("summary", {
            "summary": summary, "context_tokens": self.last_context_tokens, "index": self.summaries,
            "prompt_tokens": summary_turn.prompt_tokens, "completion_tokens": summary_turn.completion_tokens,
        })
        self.messages = [
            self.messages[0], {"role": "user", "content": SUMMARY_RESUME.format(prompt=self.prompt, summary=summary)}
        ]
        self.last_context_tokens = _estimate_tokens(self.messages)

    def model_turn(self) -> PolicyTurn:
        """The next turn's model call, its answer appended to the conversation."""
        self.turn += 1
        self.emit("turn_start", {"context_tokens": self.last_context_tokens or _estimate_tokens(self.messages)})
        model_turn = self.call_policy(self.messages, self.tools)
        self.last_context_tokens = (
            (model_turn.prompt_tokens + model_turn.completion_tokens) or _estimate_tokens(self.messages)
        )
        assistant: dict[str, Any] = {"role": "assistant", "content": model_turn.content}
        if model_turn.tool_calls:
            assistant["tool_calls"] = [tool_call_json(call) for call in model_turn.tool_calls]
        self.messages.append(assistant)
        self.emit("model_output", {
            "content": model_turn.content, "tool_calls": len(model_turn.tool_calls),
            "prompt_tokens": model_turn.prompt_tokens, "completion_tokens": model_turn.completion_tokens,
            "tokens_estimated": model_turn.tokens_estimated, "finish_reason": model_turn.finish_reason,
            "duration_s": round(model_turn.duration_s, 4),
        })
        return model_turn

    def tool_calls(self, calls: list, *, disabled_tools: Collection[str]) -> None:
        """Run a turn's tool calls (in parallel where they may be), their results appended to the conversation;
        an unparseable call or one to a disabled tool is answered with an error."""
        runnable: list[ToolCall] = []
        refused: dict[str, str] = {}
        for index, call in enumerate(calls):
            arguments, problem = parse_arguments(call)
            self.emit("tool_call", {"call_id": call.id, "name": call.name, "arguments": arguments
                                    if arguments is not None else call.arguments_json, "index": index,
                                    "count": len(calls)})
            if problem:
                refused[call.id] = problem
            elif call.name in disabled_tools:
                refused[call.id] = f"the tool {call.name} is disabled in this run"
            else:
                runnable.append(ToolCall(id=call.id, name=call.name, arguments=arguments))
        results = (
            {result.call_id: result for result in execute_tool_calls(sandbox=self.sandbox, calls=runnable)}
            if runnable else {}
        )
        finished_at = time.time()
        limit = self.limits.tool_output_chars
        for call in calls:
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
            self.emit("tool_result", payload)
            if len(output) > limit:
                output = output[:limit] + f"\n[... {len(output) - limit} more characters cut]"
            self.messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
