"""A deterministic expert for toy tasks: the exact tool calls that solve a CodingTask.

It knows the reference fix (task.solution), so it reads the buggy module, applies the fix and runs
the visible tests. The fix goes through edit_file (search/replace: the learner must copy the faulty
text exactly) or, with edit_tool="replace_lines", through the line range read_file numbered (the
learner must name the right line number instead). Its turns are replayed by training.agent.scripted's
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


EDIT_TOOLS = ("edit_file", "replace_lines")
"""Tools the expert can fix a file with."""


def _fix_call(task: CodingTask, edit_tool: str) -> tuple[str, dict]:
    fix = task.solution
    if edit_tool == "edit_file":
        return "edit_file", {"path": fix.path, "old_str": fix.old_text, "new_str": fix.new_text}
    if edit_tool == "replace_lines":
        lines = fix.as_line_range(task.files[fix.path])
        return "replace_lines", {"path": fix.path, "start_line": lines.start_line, "end_line": lines.end_line,
                                 "new_text": lines.new_text}
    raise ValueError(f"edit_tool must be one of {EDIT_TOOLS}, got {edit_tool!r}")


def toy_expert_policy(task: CodingTask, *, edit_tool: str = "edit_file") -> ScriptedExpertPolicy:
    """The scripted turns that solve `task`: read the module, fix it with `edit_tool`, run the tests, report."""
    fix = task.solution
    fix_call = _fix_call(task, edit_tool)
    return ScriptedExpertPolicy(
        turns=[
            ScriptedTurn(
                content=f"The bug report points at `{fix.path}`. Let me read it.",
                calls=(("read_file", {"path": fix.path}),),
            ),
            ScriptedTurn(
                content="I found the faulty line; fixing it.",
                calls=(fix_call,),
            ),
            ScriptedTurn(
                content="Now I run the test suite to confirm the fix.",
                calls=(("run_terminal", {"command": task.test_command}),),
            ),
        ],
        final_message=f"Fixed the bug in `{fix.path}`; the test suite passes.",
    )


def expert_trajectory_create(
    *, task: CodingTask, backend: SandboxBackend, limits: AgentLimits | None = None, edit_tool: str = "edit_file"
) -> ExpertTrajectory:
    """Run the expert on `task` in a fresh sandbox and return its trajectory if the hidden tests pass."""
    sandbox = task_sandboxes_create(backend=backend, task=task)[0]
    return expert_trajectory_run(task=task, sandbox=sandbox, limits=limits, edit_tool=edit_tool)


def expert_trajectory_run(
    *, task: CodingTask, sandbox, limits: AgentLimits | None = None, edit_tool: str = "edit_file"
) -> ExpertTrajectory:
    """Run the expert on `task` in `sandbox` (a fresh copy of the task's repository, destroyed after)."""
    policy = toy_expert_policy(task, edit_tool=edit_tool)
    try:
        result = run_agent(
            sandbox=sandbox, policy=policy, prompt=task.prompt, limits=limits or AgentLimits()
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
