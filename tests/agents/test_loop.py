"""The agent loop against a real local sandbox: events, parallel calls, limits, summaries, errors."""

from __future__ import annotations

import socket

import pytest

from training.agent.config import AgentConfigError, AgentLimits
from training.agent.demo_repo import DEMO_PROMPT, demo_expert_policy
from training.agent.loop import AgentStopped, run_agent
from training.agent.policy import OpenAIChatPolicy
from training.agent.scripted import ScriptedExpertPolicy, ScriptedTurn


def test_scripted_expert_fixes_the_demo_repository(local_sandbox):
    seen = []
    result = run_agent(sandbox=local_sandbox, policy=demo_expert_policy(), prompt=DEMO_PROMPT,
                       limits=AgentLimits(), on_event=seen.append)
    assert result.status == "succeeded", result.reason
    assert [e["seq"] for e in seen] == list(range(len(seen)))
    assert seen[0]["kind"] == "start" and seen[-1]["kind"] == "final"
    assert "+        return (ordered[middle - 1] + ordered[middle]) / 2" in result.diff
    assert seen[-1]["payload"]["diff"] == result.diff
    # Turn 1 requested three calls at once: three tool_call events then three results, in call order.
    turn1 = [e for e in seen if e["turn"] == 1 and e["kind"] in ("tool_call", "tool_result")]
    assert [e["kind"] for e in turn1] == ["tool_call"] * 3 + ["tool_result"] * 3
    assert [e["payload"]["name"] for e in turn1[3:]] == ["todo_write", "list_dir", "read_file"]
    assert all(e["payload"]["count"] == 3 for e in turn1[:3])
    # The tests fail before the fix and pass after it.
    terminal = [e["payload"] for e in seen if e["kind"] == "tool_result" and e["payload"]["name"] == "run_terminal"]
    assert terminal[0]["meta"]["exit_code"] != 0 and terminal[-1]["meta"]["exit_code"] == 0
    assert all(p["duration_s"] >= 0 and p["finished_at"] > 0 for p in terminal)
    outputs = [e for e in seen if e["kind"] == "model_output"]
    assert result.prompt_tokens == sum(e["payload"]["prompt_tokens"] for e in outputs)
    assert result.completion_tokens == sum(e["payload"]["completion_tokens"] for e in outputs)
    assert result.messages[-1] == {"role": "assistant", "content": result.final_message}
    tool_messages = [m for m in result.messages if m["role"] == "tool"]
    assert len(tool_messages) == sum(1 for e in seen if e["kind"] == "tool_result")


def test_turn_limit_fails_with_the_reason(local_sandbox):
    result = run_agent(sandbox=local_sandbox, policy=demo_expert_policy(), prompt=DEMO_PROMPT,
                       limits=AgentLimits(max_turns=2))
    assert result.status == "failed"
    assert "turn limit of 2" in result.reason
    assert result.turns == 2 and not result.infrastructure_error


def test_context_is_summarised_and_the_run_continues(local_sandbox):
    limits = AgentLimits(context_tokens=1200, max_tokens_per_turn=100, summarize_at=0.5, max_summaries=5)
    result = run_agent(sandbox=local_sandbox, policy=demo_expert_policy(), prompt=DEMO_PROMPT, limits=limits)
    summaries = [e for e in result.events if e["kind"] == "summary"]
    assert summaries, "a small context window must trigger self-summarisation"
    assert summaries[0]["payload"]["context_tokens"] >= 600
    assert result.status == "succeeded", result.reason
    # After a summary the context restarts from the system prompt and the summary.
    assert result.summaries == len(summaries)
    assert "summary of the work so far" in result.messages[1]["content"]


def test_malformed_arguments_are_reported_to_the_model_not_run(local_sandbox):
    class BadJsonPolicy(ScriptedExpertPolicy):
        def complete(self, **kwargs):
            turn = super().complete(**kwargs)
            for call in turn.tool_calls:
                call.arguments_json = "{not json"
            return turn

    policy = BadJsonPolicy(turns=[ScriptedTurn("try", (("read_file", {"path": "README.md"}),))], final_message="done")
    result = run_agent(sandbox=local_sandbox, policy=policy, prompt="read it", limits=AgentLimits())
    tool_result = next(e for e in result.events if e["kind"] == "tool_result")
    assert tool_result["payload"]["ok"] is False
    assert "not valid JSON" in tool_result["payload"]["output"]
    assert result.status == "succeeded"


def test_a_disabled_tool_is_offered_but_refused_when_called(local_sandbox):
    offered = []

    class RecordingPolicy(ScriptedExpertPolicy):
        def complete(self, *, tools, **kwargs):
            offered.append({tool["function"]["name"] for tool in tools})
            return super().complete(tools=tools, **kwargs)

    policy = RecordingPolicy(
        turns=[ScriptedTurn("look", (("semantic_search", {"query": "main"}), ("read_file", {"path": "README.md"})))],
        final_message="done",
    )
    result = run_agent(
        sandbox=local_sandbox, policy=policy, prompt="look around", limits=AgentLimits(),
        disabled_tools=("semantic_search",),
    )
    results = {e["payload"]["name"]: e["payload"] for e in result.events if e["kind"] == "tool_result"}
    assert all("semantic_search" in names for names in offered)  # the prompt keeps the tool
    assert results["semantic_search"]["ok"] is False
    assert "disabled in this run" in results["semantic_search"]["output"]
    assert results["read_file"]["ok"] is True  # the other call of the same turn still runs
    assert result.status == "succeeded"


def test_should_stop_cancels_between_steps(local_sandbox):
    calls = {"n": 0}

    def stop_after_two_checks():
        calls["n"] += 1
        return "cancelled by the user" if calls["n"] > 2 else None

    result = run_agent(sandbox=local_sandbox, policy=demo_expert_policy(), prompt=DEMO_PROMPT,
                       limits=AgentLimits(), should_stop=stop_after_two_checks)
    assert result.status == "cancelled" and result.reason == "cancelled by the user"
    assert result.events[-1]["kind"] == "final"


def test_unreachable_policy_server_is_an_infrastructure_failure(local_sandbox):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    policy = OpenAIChatPolicy(f"http://127.0.0.1:{port}/v1", "flowstate", "key", max_retries=0)
    result = run_agent(sandbox=local_sandbox, policy=policy, prompt="anything", limits=AgentLimits())
    assert result.status == "failed" and result.infrastructure_error
    assert [e["kind"] for e in result.events][-2:] == ["error", "final"]


def test_on_event_can_abort_the_run(local_sandbox):
    def refuse(event):
        if event["kind"] == "tool_call":
            raise AgentStopped("claim lost")

    result = run_agent(sandbox=local_sandbox, policy=demo_expert_policy(), prompt=DEMO_PROMPT,
                       limits=AgentLimits(), on_event=refuse)
    assert result.status == "failed" and result.reason == "claim lost"
    assert not any(e["kind"] == "tool_result" for e in result.events)


@pytest.mark.parametrize("bad, message", [
    ({"max_turns": 0}, "max_turns must be a positive integer"),
    ({"max_tokens_per_turn": 9000, "context_tokens": 8192}, "leaves no room for a prompt"),
    ({"summarize_at": 1.5}, "summarize_at"),
    ({"turns": 3}, "unknown agent limit(s): turns"),
])
def test_limits_refuse_bad_values_with_a_fix(bad, message):
    with pytest.raises(AgentConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AgentLimits.from_dict(bad)
