"""A deterministic expert for toy tasks: the exact tool calls that solve a CodingTask.

It knows the reference fix (task.solution), so it reads the buggy module, applies the fix and runs
the visible tests. With verify=True it instead checks the fix the way the bug report states the bug: it
runs the report's call (`report_check_command`) first to reproduce the bug, and again after each edit,
comparing what it prints with the value the report says it should return. The visible tests never
cover the buggy function (its tests stay hidden), so only this check can tell a wrong fix from a right
one inside an episode. Given a wrong first fix
(`wrong_fix_sources`: another change of the same line that the report's call still exposes), the
expert makes that edit, sees the check print the wrong value, and fixes the line again: the recovery
a policy needs to turn a failed first attempt into a pass within one episode.

The fix goes through edit_file (search/replace: the learner must copy the faulty text exactly) or,
with edit_tool="replace_lines", through the line range read_file numbered (the learner must name the
right line number instead). Its turns are replayed by training.agent.scripted's
ScriptedExpertPolicy through the real agent loop in a real sandbox, so the recorded trajectory holds
genuine tool outputs in exactly the format the model sees in product and RL; a trajectory is kept
only when the hidden tests then pass.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sandboxes.base import SandboxBackend
from training.agent.config import AgentLimits
from training.agent.loop import run_agent
from training.agent.scripted import ScriptedExpertPolicy, ScriptedTurn
from training.tasks.base import CodingTask, FileEdit, changed_line_span, minimal_fix_edit
from training.tasks.mutations import enumerate_mutations
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
        return _edit_call(fix)
    if edit_tool == "replace_lines":
        lines = fix.as_line_range(task.files[fix.path])
        return "replace_lines", {"path": fix.path, "start_line": lines.start_line, "end_line": lines.end_line,
                                 "new_text": lines.new_text}
    raise ValueError(f"edit_tool must be one of {EDIT_TOOLS}, got {edit_tool!r}")


_SHELL_UNSAFE = frozenset('"$`\\!')


def report_check_command(task: CodingTask) -> str | None:
    """A shell command printing the repr of what the bug report's call returns in the workspace now.

    The call is spelled as the report spells it, `pkg.module.function(args)`, so that a policy writes
    the command by copying one span of the prompt (and its import is that span's prefix) rather than
    by composing names it has to pick out of several places.

    None for a task without a recorded report call (tasks generated before the call was kept in
    metadata, or other tiers), or whose call would need shell escaping inside double quotes.
    """
    call, module = task.metadata.get("report_call"), task.metadata.get("module")
    if not call or not module or _SHELL_UNSAFE & set(call):
        return None
    import_path = module[: -len(".py")].replace("/", ".")
    return f'python3 -c "import {import_path}; print(repr({import_path}.{call}))"'


def _report_value(source: str, task: CodingTask) -> str:
    """repr of the report's call on `source` (the buggy function's module), or the exception it raised."""
    namespace: dict = {}
    try:
        exec(compile(source, "<expert>", "exec"), namespace)  # the task's own generated code
        return repr(eval(task.metadata["report_call"], namespace))  # a call the task generator wrote
    except Exception as exc:  # noqa: BLE001  (a raising wrong fix is a wrong fix; the message is data)
        return f"raises {type(exc).__name__}"


def wrong_fix_sources(task: CodingTask) -> list[str]:
    """Plausible wrong fixes: other single mutations of the buggy line that the report's call still exposes.

    Each is the whole buggy module with the faulty line changed in another way than the reference fix
    (the other comparison, the other neighbour of a constant, a negation), in a stable order. Empty when
    the task has no report call, or when no other change of that line keeps the call wrong (a removed
    statement's fix inserts a line, which no mutation of the buggy file touches).
    """
    fix = task.solution
    if fix is None or "report_call" not in task.metadata or "function" not in task.metadata:
        return []
    buggy = task.files[fix.path]
    fixed = fix.apply(buggy)
    buggy_lines = buggy.splitlines(keepends=True)
    fix_span = changed_line_span(buggy_lines, fixed.splitlines(keepends=True))
    wrong = []
    for mutation in enumerate_mutations(buggy, path=fix.path, functions={task.metadata["function"]}):
        source = mutation.mutated_source
        if source == fixed:
            continue
        source_lines = source.splitlines(keepends=True)
        span = changed_line_span(buggy_lines, source_lines)
        # the same lines rewritten in place, as an edit of the faulty line would (no deleted statement)
        if span is None or span[:2] != fix_span[:2] or len(source_lines) != len(buggy_lines):
            continue
        if _report_value(source, task) != task.metadata["report_expected"]:
            wrong.append(source)
    return wrong


def toy_expert_policy(
    task: CodingTask, *, edit_tool: str = "edit_file", verify: bool = False, wrong_first: str | None = None
) -> ScriptedExpertPolicy:
    """The scripted turns that solve `task`: read the module, fix it with `edit_tool`, run the tests, report.

    verify: reproduce the bug with the report's call (report_check_command) while reading the module, and
    check the fix with the same call instead of the visible tests.
    wrong_first: a source from wrong_fix_sources(task); the expert first edits the module into it, sees the
    check print a wrong value, then fixes the line for real (edit_file only, and only with verify).
    """
    fix = task.solution
    if not verify:
        if wrong_first is not None:
            raise ValueError("wrong_first needs verify=True: without the check nothing shows the first fix is wrong")
        return ScriptedExpertPolicy(
            turns=[
                ScriptedTurn(
                    content=f"The bug report points at `{fix.path}`. Let me read it.",
                    calls=(("read_file", {"path": fix.path}),),
                ),
                ScriptedTurn(content="I found the faulty line; fixing it.", calls=(_fix_call(task, edit_tool),)),
                ScriptedTurn(
                    content="Now I run the test suite to confirm the fix.",
                    calls=(("run_terminal", {"command": task.test_command}),),
                ),
            ],
            final_message=f"Fixed the bug in `{fix.path}`; the test suite passes.",
        )
    command = report_check_command(task)
    if command is None:
        raise ValueError(f"{task.task_id}: no report call to check the fix with (report_check_command is None)")
    call, expected = task.metadata["report_call"], task.metadata["report_expected"]
    # Reproduce first, in the same turn as the read: the bug is confirmed before any edit, the command is
    # written while the report is a few hundred tokens back, and each later check repeats that first command.
    reproduce_and_read = ScriptedTurn(
        content=f"Let me reproduce the bug with the call from the report and read `{fix.path}`.",
        calls=(("run_terminal", {"command": command}), ("read_file", {"path": fix.path})),
    )
    check = ScriptedTurn(
        content="Let me run the call from the bug report again.", calls=(("run_terminal", {"command": command}),)
    )
    turns = [reproduce_and_read]
    if wrong_first is not None:
        if edit_tool != "edit_file":
            raise ValueError(f"wrong_first supports edit_tool='edit_file' only, got {edit_tool!r}")
        buggy = task.files[fix.path]
        first = minimal_fix_edit(path=fix.path, buggy=buggy, fixed=wrong_first)
        second = minimal_fix_edit(path=fix.path, buggy=wrong_first, fixed=fix.apply(buggy))
        turns += [
            ScriptedTurn(content="I found the faulty line; fixing it.", calls=(_edit_call(first),)),
            check,
            ScriptedTurn(
                content=f"It should return `{expected}` and does not, so that change was wrong. Fixing the line again.",
                calls=(_edit_call(second),),
            ),
        ]
    else:
        turns.append(ScriptedTurn(content="I found the faulty line; fixing it.", calls=(_fix_call(task, edit_tool),)))
    turns.append(check)
    return ScriptedExpertPolicy(
        turns=turns,
        final_message=f"Fixed the bug in `{fix.path}`: `{call}` now returns `{expected}`, as the report says.",
    )


def _edit_call(edit: FileEdit) -> tuple[str, dict]:
    return "edit_file", {"path": edit.path, "old_str": edit.old_text, "new_str": edit.new_text}


def expert_trajectory_create(
    *,
    task: CodingTask,
    backend: SandboxBackend,
    limits: AgentLimits | None = None,
    edit_tool: str = "edit_file",
    verify: bool = False,
    wrong_first: str | None = None,
) -> ExpertTrajectory:
    """Run the expert on `task` in a fresh sandbox and return its trajectory if the hidden tests pass."""
    sandbox = task_sandboxes_create(backend=backend, task=task)[0]
    return expert_trajectory_run(
        task=task, sandbox=sandbox, limits=limits, edit_tool=edit_tool, verify=verify, wrong_first=wrong_first
    )


def expert_trajectory_run(
    *,
    task: CodingTask,
    sandbox,
    limits: AgentLimits | None = None,
    edit_tool: str = "edit_file",
    verify: bool = False,
    wrong_first: str | None = None,
) -> ExpertTrajectory:
    """Run the expert on `task` in `sandbox` (a fresh copy of the task's repository, destroyed after)."""
    policy = toy_expert_policy(task, edit_tool=edit_tool, verify=verify, wrong_first=wrong_first)
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
    if verify:
        # What the model learns to read: each check's output shows the value the report asks for exactly
        # when the fix before it was right.
        echo = f"$ {report_check_command(task)}\n"
        checks = [m["content"] for m in result.messages if m["role"] == "tool" and str(m["content"]).startswith(echo)]
        expected = task.metadata["report_expected"]
        shows = [f"\n{expected}\n" in str(output) for output in checks]  # the printed line, not the echo
        if shows != [False] * (len(shows) - 1) + [True]:
            raise ExpertTrajectoryError(f"{task.task_id}: the checks' outputs do not tell the fixes apart: {checks}")
    messages = result.messages
    if wrong_first is not None:
        # The wrong edit is the setting of the lesson, not part of it: SFT keeps it out of the loss.
        wrong_edit = [index for index, message in enumerate(messages) if message["role"] == "assistant"][1]
        messages = [*messages[:wrong_edit], {**messages[wrong_edit], "train": False}, *messages[wrong_edit + 1 :]]
    return ExpertTrajectory(task_id=task.task_id, messages=messages, reward=reward.value)


def expert_variant(task: CodingTask, *, retry_share: float) -> str | None:
    """The wrong first fix the expert makes on `task` for a retry trajectory, or None for a direct one.

    A share `retry_share` of the tasks that have a wrong fix (wrong_fix_sources) get one, drawn from the
    task's seed so that a resumed or repeated data run makes the same choice.
    """
    if not 0.0 <= retry_share <= 1.0:
        raise ValueError(f"retry_share must lie in [0, 1], got {retry_share}")
    rng = random.Random(f"{task.task_id}:retry")
    if rng.random() >= retry_share:
        return None
    candidates = wrong_fix_sources(task)
    return rng.choice(candidates) if candidates else None
