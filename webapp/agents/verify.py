"""Verified results: after the agent stops, run the repository's tests in its workspace.

That the agent loop stopped (the model answered without tool calls) says nothing about the code. So a
task that ends normally runs the repository's test command in the same sandbox, after the agent's
diff was taken, and records the outcome: tests pass, tests fail, no tests, or an error saying why the
tests could not run. The command comes from the repository's recipe when auto-install found a ready
one (webapp.experiments RepositoryRecipe: its setup commands run first), and is detected from the
workspace otherwise (training.tasks.autoinstall.detect_recipe: pytest configuration, else unittest).

The workspace is the agent's: it may have edited the tests too. The summary names the test files
the diff touches, so "tests pass" is never read without that caveat.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from webapp.agents.models import AgentTask

logger = logging.getLogger(__name__)

OUTPUT_TAIL_CHARS = 8000
_TEST_PATH = re.compile(r"(^|/)(tests?/|test_[^/]*\.py$|[^/]*_test\.py$|conftest\.py$)")


@dataclass(frozen=True)
class Verification:
    outcome: Any
    """An ``AgentTask.Outcome`` (Django's choices are untyped to mypy without django-stubs)."""
    command: str = ""
    summary: str = ""
    output: str = ""


@dataclass(frozen=True)
class _Plan:
    runner: str
    command: str
    setup_commands: tuple[str, ...] = ()
    source: str = "detected"


def changed_test_files(diff: str) -> list[str]:
    """Test files (tests/, test_*.py, *_test.py, conftest.py) that a unified diff touches."""
    paths = re.findall(r"^(?:\+\+\+ b/|--- a/)(\S+)", diff, flags=re.M)
    return sorted({path for path in paths if _TEST_PATH.search(path)})


def _plan(*, task: AgentTask, sandbox) -> _Plan | str:
    """How to test this workspace, or (a string) why there is nothing to run."""
    from training.tasks.autoinstall import InstallError, detect_recipe, repository_files
    from webapp.experiments.models import RepositoryRecipe

    if task.repository_id is not None:
        ready = RepositoryRecipe.objects.filter(repository_id=task.repository_id,
                                                status=RepositoryRecipe.Status.READY).first()
        recipe = ready.recipe if ready else {}
        if recipe.get("test_command") and recipe.get("runner") in ("pytest", "unittest"):
            # A recipe whose setup downloads ran when the task's snapshot was built (network on for that
            # phase only, webapp.mining.services.recipe_snapshot_setup); an offline one runs here.
            # The repository's prepared snapshot has every setup command done already.
            prepared = bool(task.snapshot_id) and task.snapshot_id == (ready.snapshot or {}).get("id")
            setup = () if recipe.get("network") or prepared else tuple(recipe.get("setup_commands") or ())
            return _Plan(runner=recipe["runner"], command=recipe["test_command"], setup_commands=setup,
                         source="recipe")
    files, paths = repository_files(sandbox)
    try:
        detected = detect_recipe(files, paths)
    except InstallError as error:
        return str(error)
    # Setup commands install offline into the workspace; detected ones are not verified yet, so only
    # the test command runs (the recipe's PYTHONPATH still finds src/ layouts).
    return _Plan(runner=detected.runner, command=detected.test_command)


def tests_run(*, task: AgentTask, sandbox, diff: str, timeout_s: float | None = None) -> Verification:
    """Run the workspace's tests in ``sandbox`` and classify the result."""
    from sandboxes.base import SandboxError
    from training.tasks.autoinstall import count_tests

    timeout_s = timeout_s or settings.AGENT_VERIFY_TIMEOUT_S
    try:
        plan = _plan(task=task, sandbox=sandbox)
        if isinstance(plan, str):
            return Verification(AgentTask.Outcome.NO_TESTS, summary=plan)
        for command in plan.setup_commands:
            setup = sandbox.exec(command, timeout_s=timeout_s)
            if setup.exit_code != 0:
                return Verification(AgentTask.Outcome.ERROR, plan.command,
                                    f"the recipe's setup command failed (exit {setup.exit_code}): {command}",
                                    (setup.stdout + "\n" + setup.stderr)[-OUTPUT_TAIL_CHARS:])
        result = sandbox.exec(plan.command, timeout_s=timeout_s)
    except SandboxError as error:
        return Verification(AgentTask.Outcome.ERROR, summary=f"the sandbox failed while testing: {error}")
    output = result.stdout + "\n" + result.stderr
    tail = output[-OUTPUT_TAIL_CHARS:]
    if result.timed_out:
        return Verification(AgentTask.Outcome.ERROR, plan.command, f"the tests ran past {timeout_s:.0f}s", tail)
    ran, passed = count_tests(plan.runner, output)
    edited = changed_test_files(diff)
    caveat = f"; the agent changed test files: {', '.join(edited[:5])}" if edited else ""
    if ran == 0:
        if result.exit_code in (0, 5):  # 5: pytest (and unittest on 3.12+) found no tests
            return Verification(AgentTask.Outcome.NO_TESTS, plan.command, f"the test command found no tests{caveat}", tail)
        return Verification(AgentTask.Outcome.ERROR, plan.command,
                            f"the test command failed before running tests (exit {result.exit_code}){caveat}", tail)
    if result.exit_code == 0 and passed == ran:
        return Verification(AgentTask.Outcome.TESTS_PASS, plan.command, f"{passed} passed ({plan.source} command){caveat}",
                            tail)
    return Verification(AgentTask.Outcome.TESTS_FAIL, plan.command,
                        f"{ran - passed} of {ran} failed, exit {result.exit_code} ({plan.source} command){caveat}", tail)


def task_outcome_record(*, task_id: int, claim_token, verification: Verification) -> bool:
    """Store the verification on the task while this worker still holds it; False if the claim is gone."""
    return bool(AgentTask.objects.filter(pk=task_id, claim_token=claim_token).update(
        outcome=verification.outcome, test_command=verification.command[:1000],
        test_summary=verification.summary[:500], test_output=verification.output,
    ))


def task_verify(*, task: AgentTask, claim_token, sandbox, diff: str, turn: int,
                on_event: Callable[[dict], object]) -> Verification:
    """Called by ``task_run`` when the agent stopped normally: test, show it in the trace, record it."""
    from training.agent.loop import AgentStopped

    verification = tests_run(task=task, sandbox=sandbox, diff=diff)
    try:
        on_event({"kind": "tests", "turn": turn, "payload": {
            "outcome": verification.outcome, "command": verification.command, "summary": verification.summary,
            "output": verification.output,
        }})
    except AgentStopped:
        return verification  # the claim is gone: another worker owns the task now
    task_outcome_record(task_id=task.pk, claim_token=claim_token, verification=verification)
    return verification
