"""A deterministic scripted expert: NOT a model.

It replays a fixed list of tool-call turns through the same loop, tools and event format as a real
policy, which makes demo data, the live-view browser test and the latency benchmark reproducible.
Token counts it reports are length-based estimates and are flagged as such (``tokens_estimated``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from training.agent.policy import PolicyToolCall, PolicyTurn

SCRIPTED_MODEL_NAME = "scripted-expert"


@dataclass(frozen=True)
class ScriptedTurn:
    """One scripted model turn: a message and the tool calls it requests (run concurrently)."""

    content: str
    """Assistant text of the turn."""
    calls: tuple[tuple[str, dict], ...] = ()
    """``(tool name, arguments)`` pairs; empty on the final turn."""


@dataclass
class ScriptedExpertPolicy:
    """Replays ``turns`` in order; after the last one it answers ``final_message``."""

    turns: list[ScriptedTurn]
    """The tool-calling turns, in order."""
    final_message: str
    """The answer given once every scripted turn was played."""
    step_delay_s: float = 0.0
    """Seconds to wait before each response, so a human (or a browser test) can watch it live."""
    name: str = SCRIPTED_MODEL_NAME
    _played: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.step_delay_s < 0 or self.step_delay_s > 60:
            raise ValueError(f"ScriptedExpertPolicy.step_delay_s must lie in [0, 60], got {self.step_delay_s}")
        if not self.final_message:
            raise ValueError("ScriptedExpertPolicy.final_message must not be empty")

    def complete(self, *, messages, tools, max_tokens, temperature, top_p, timeout_s) -> PolicyTurn:
        started = time.monotonic()
        if self.step_delay_s:
            time.sleep(min(self.step_delay_s, timeout_s))
        prompt_tokens = sum(len(json.dumps(m)) for m in messages) // 4
        if not tools:
            # A summary request: describe the scripted turns already played.
            done = "; ".join(turn.content for turn in self.turns[: self._played]) or "nothing yet"
            content = f"Scripted expert summary. Steps done: {done}. Next: scripted turn {self._played + 1}."
            return PolicyTurn(content=content, tool_calls=[], prompt_tokens=prompt_tokens,
                              completion_tokens=len(content) // 4, tokens_estimated=True,
                              duration_s=time.monotonic() - started)
        if self._played >= len(self.turns):
            content = self.final_message
            calls: list[PolicyToolCall] = []
        else:
            turn = self.turns[self._played]
            content = turn.content
            calls = [
                PolicyToolCall(id=f"call_{self._played + 1}_{index}", name=name, arguments_json=json.dumps(arguments))
                for index, (name, arguments) in enumerate(turn.calls)
            ]
            self._played += 1
        completion_tokens = (len(content) + sum(len(c.arguments_json) for c in calls)) // 4
        return PolicyTurn(content=content, tool_calls=calls, prompt_tokens=prompt_tokens,
                          completion_tokens=max(1, completion_tokens), tokens_estimated=True,
                          finish_reason="tool_calls" if calls else "stop", duration_s=time.monotonic() - started)
