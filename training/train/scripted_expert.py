"""A deterministic expert for toy tasks: the exact tool calls that solve a CodingTask.

It knows the reference fix (task.solution), so it reads the buggy module, rewrites the faulty lines
with replace_lines (addressed by the line numbers read_file showed, so the model that learns from it
writes the fixed line once instead of copying the faulty one exactly, as edit_file's old_str needs)
and runs the visible tests. Its turns are replayed by training.agent.scripted's
ScriptedExpertPolicy through the real agent loop in a real sandbox, so the recorded trajectory holds
genuine tool outputs in exactly the format the model sees in product and RL; a trajectory is kept
only when the hidden tests then pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandboxes.base import SandboxBackend
from training.agent.config import AgentLimits
from training.agent.loop import run_agent
from training.agent.scripted import ScriptedExpertPolicy, ScriptedTurn
from training.tasks.base import CodingTask
from training.tasks.reward import score_rollout
from training.tasks.sandboxing import task_sandboxes_create


class ExpertTrajectoryError(RuntimeError):
    """The scripted expert did not solve its task (the task or a tool changed); nothing is recorded."""


@dataclass
class ExpertTrajectory:
    """One verified expert solution."""

    task_id: str
    """The toy task it solves."""

    messages: list[dict]
    """OpenAI message list (system, user, assistant tool calls, tool results, final answer)."""

    reward: float
    """Hidden-test reward of the final workspace (1.0 for a verified solution)."""


def toy_expert_policy(task: CodingTask) -> ScriptedExpertPolicy:
    """The scripted turns that solve `task`: read the module, fix it, run the tests, report."""
    fix = task.solution
    lines = fix.as_line_range(task.files[fix.path])
    return ScriptedExpertPolicy(
        turns=[
            ScriptedTurn(
                content=f"The bug report points at `{fix.path}`. Let me read it.",
                calls=(("read_file", {"path": fix.path}),),
            ),
            ScriptedTurn(
                content="I found the faulty line; fixing it.",
                calls=(("replace_lines", {"path": fix.path, "start_line": lines.start_line,
                                          "end_line": lines.end_line, "new_text": lines.new_text}),),
            ),
            ScriptedTurn(
                content="Now I run the test suite to confirm the fix.",
                calls=(("run_terminal", {"command": task.test_command}),),
            ),
        ],
        final_message=f"Fixed the bug in `{fix.path}`; the test suite passes.",
    )


def expert_trajectory_create(
    *, task: CodingTask, backend: SandboxBackend, limits: AgentLimits | None = None
) -> ExpertTrajectory:
    """Run the expert on `task` in a fresh sandbox and return its trajectory if the hidden tests pass."""
    sandbox = task_sandboxes_create(backend=backend, task=task)[0]
    try:
        result = run_agent(
            sandbox=sandbox, policy=toy_expert_policy(task), prompt=task.prompt, limits=limits or AgentLimits()
        )
        if result.status != "succeeded":
            raise ExpertTrajectoryError(f"{task.task_id}: expert run ended {result.status}: {result.reason}")
        reward = score_rollout(sandbox=sandbox, task=task)
    finally:
        sandbox.destroy()
    if not reward.passed:
        raise ExpertTrajectoryError(
            f"{task.task_id}: the expert's fix did not pass the hidden tests:\n{reward.output_tail}"
        )
    return ExpertTrajectory(task_id=task.task_id, messages=result.messages, reward=reward.value)
