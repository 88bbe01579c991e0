"""Typed limits of one agent run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class AgentConfigError(ValueError):
    """AgentLimits whose fields contradict each other; the message says how to fix it."""


@dataclass(frozen=True)
class AgentLimits:
    """Budgets of one agent run. The run stops (status ``failed``, reason says which) past any."""

    max_turns: int = 30
    """Model calls that may request tools; summary calls do not count."""

    max_tokens: int = 100_000
    """Completion tokens the agent may generate over the whole run, summaries included."""

    max_tokens_per_turn: int = 1024
    """``max_tokens`` passed to the policy for one model call."""

    wall_time_s: float = 1800.0
    """Wall-clock seconds for the whole run, model calls and tools included."""

    context_tokens: int = 8192
    """Context window of the policy in tokens (prompt plus completion of one call)."""

    summarize_at: float = 0.75
    """Fraction of ``context_tokens`` at which the agent summarises its work and restarts its
    context from the summary (self-summarisation)."""

    max_summaries: int = 3
    """How many times the context may be summarised before the run fails for lack of context."""

    temperature: float = 0.0
    """Sampling temperature passed to the policy."""

    top_p: float = 1.0
    """Nucleus sampling mass passed to the policy."""

    tool_output_chars: int = 16_000
    """Characters of one tool result fed back to the model (the full result is still recorded)."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens", "max_tokens_per_turn", "context_tokens", "tool_output_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise AgentConfigError(f"AgentLimits.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.max_summaries, int) or self.max_summaries < 0:
            raise AgentConfigError(f"AgentLimits.max_summaries must be >= 0, got {self.max_summaries!r}")
        if not isinstance(self.wall_time_s, int | float) or self.wall_time_s <= 0:
            raise AgentConfigError(f"AgentLimits.wall_time_s must be a positive number, got {self.wall_time_s!r}")
        if not 0.1 <= self.summarize_at < 1.0:
            raise AgentConfigError(
                f"AgentLimits.summarize_at={self.summarize_at} must lie in [0.1, 1.0): it is the fraction "
                "of context_tokens at which the agent summarises"
            )
        if self.max_tokens_per_turn >= self.context_tokens:
            raise AgentConfigError(
                f"AgentLimits.max_tokens_per_turn={self.max_tokens_per_turn} leaves no room for a prompt in "
                f"context_tokens={self.context_tokens}; lower max_tokens_per_turn or raise context_tokens"
            )
        if self.max_tokens_per_turn > self.max_tokens:
            raise AgentConfigError(
                f"AgentLimits.max_tokens_per_turn={self.max_tokens_per_turn} exceeds the whole-run budget "
                f"max_tokens={self.max_tokens}; raise max_tokens"
            )
        if not 0.0 <= self.temperature <= 2.0:
            raise AgentConfigError(f"AgentLimits.temperature must lie in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise AgentConfigError(f"AgentLimits.top_p must lie in (0, 1], got {self.top_p}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> AgentLimits:
        """Build from user input; unknown keys are refused by name instead of silently ignored."""
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise AgentConfigError(f"unknown agent limit(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)
