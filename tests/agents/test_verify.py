"""Verified results: the repository's tests run in the workspace after the agent stops (real local
sandboxes, real database; only the scripted policy stands in for a model)."""

from __future__ import annotations

import subprocess

import pytest

from training.agent.scripted import ScriptedExpertPolicy
from webapp.agents import services, verify
from webapp.agents.models import AgentTask

pytestmark = pytest.mark.django_db


def _create(owner, repository) -> AgentTask:
    return services.task_create(owner=owner, prompt="Fix the failing median test", backend="scripted",
                                repository=repository, enqueue=False)


def _git_repo(path, files: dict[str, str]):
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid", "-C", str(path)]
    subprocess.run([*git, "init", "-q", "-b", "main"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True)
    return path


def test_a_real_fix_ends_finished_tests_pass(owner, demo_repository, api_client_for):
    task = _create(owner, demo_repository)
    services.task_run(task_id=task.pk)
    task.refresh_from_db()
    assert (task.status, task.outcome) == ("succeeded", "tests_pass"), (task.status_reason, task.test_summary, task.test_output)
    assert "unittest" in task.test_command and task.test_summary.startswith("3 passed")
    assert task.verdict == "finished, tests pass"
    last = task.events.order_by("-seq").first()
    assert last.kind == "tests" and last.payload["outcome"] == "tests_pass" and last.seq == task.last_seq
    body = api_client_for(owner).get(f"/api/tasks/{task.pk}/").json()
    assert (body["outcome"], body["verdict"]) == ("tests_pass", "finished, tests pass")


def test_an_agent_that_changes_nothing_ends_finished_tests_fail(owner, demo_repository, monkeypatch):
    # The case: the model answers nonsense at once; the loop "succeeds", the code does not.
    monkeypatch.setattr(services, "_policy_for", lambda task: ScriptedExpertPolicy(turns=[], final_message="Done!"))
    task = _create(owner, demo_repository)
    services.task_run(task_id=task.pk)
    task.refresh_from_db()
    assert task.status == "succeeded" and task.diff == ""
    assert task.outcome == "tests_fail", task.test_summary
    assert task.test_summary.startswith("1 of 3 failed") and "median" in task.test_output
    assert task.verdict == "finished, tests fail"


def test_a_repository_without_tests_is_finished_no_tests(owner, team, tmp_path, monkeypatch):
    from webapp.agents.services import repository_create

    path = _git_repo(tmp_path / "notes", {"README.md": "# notes\n", "notes.py": "X = 1\n"})
    repository = repository_create(owner=owner, team=team, name="notes", kind="path", location=str(path),
                                   allow_server_path=True)
    monkeypatch.setattr(services, "_policy_for", lambda task: ScriptedExpertPolicy(turns=[], final_message="ok"))
    task = _create(owner, repository)
    services.task_run(task_id=task.pk)
    task.refresh_from_db()
    assert (task.status, task.outcome) == ("succeeded", "no_tests")
    assert "no tests found" in task.test_summary and task.verdict == "finished, no tests"


def test_the_recipe_test_command_wins_over_detection(owner, demo_repository, local_sandbox):
    from webapp.experiments.models import RepositoryRecipe

    RepositoryRecipe.objects.create(repository=demo_repository, status="ready", recipe={
        "runner": "unittest", "setup_commands": ["mkdir -p .flowstate && touch .flowstate/setup-ran"],
        "test_command": "python3 -m unittest -v tests.test_summary",
    })
    task = _create(owner, demo_repository)
    result = verify.tests_run(task=task, sandbox=local_sandbox, diff="")
    assert result.command == "python3 -m unittest -v tests.test_summary" and "recipe command" in result.summary
    assert result.outcome == "tests_fail"  # the untouched demo repository has its failing median test
    assert local_sandbox.exec("test -f .flowstate/setup-ran").exit_code == 0


def test_a_broken_recipe_setup_is_an_error_not_a_pass(owner, demo_repository, local_sandbox):
    from webapp.experiments.models import RepositoryRecipe

    RepositoryRecipe.objects.create(repository=demo_repository, status="ready", recipe={
        "runner": "unittest", "setup_commands": ["exit 3"], "test_command": "python3 -m unittest"})
    result = verify.tests_run(task=_create(owner, demo_repository), sandbox=local_sandbox, diff="")
    assert result.outcome == "error" and "exit 3" in result.summary


def test_tests_the_agent_edited_are_named_in_the_summary(owner, demo_repository, local_sandbox):
    # An agent "fixing" the suite by deleting the failing assertion: it passes, and the summary says how.
    original = local_sandbox.read_bytes("tests/test_summary.py").decode()
    weakened = original.replace("self.assertEqual(median([4, 1, 3, 2]), 2.5)", "pass")
    assert weakened != original
    local_sandbox.write_bytes("tests/test_summary.py", weakened.encode())
    diff = local_sandbox.diff()
    result = verify.tests_run(task=_create(owner, demo_repository), sandbox=local_sandbox, diff=diff)
    assert "tests/test_summary.py" in verify.changed_test_files(diff)
    assert result.outcome == "tests_pass"
    assert "the agent changed test files: tests/test_summary.py" in result.summary


def test_lists_filter_by_outcome_and_refuse_unknown_outcomes(owner, demo_repository, client, api_client_for):
    passed, failed = _create(owner, demo_repository), _create(owner, demo_repository)
    AgentTask.objects.filter(pk=passed.pk).update(status="succeeded", outcome="tests_pass")
    AgentTask.objects.filter(pk=failed.pk).update(status="succeeded", outcome="tests_fail")
    api = api_client_for(owner)
    ids = [row["id"] for row in api.get("/api/tasks/?outcome=tests_fail").json()["results"]]
    assert ids == [failed.pk]
    refused = api.get("/api/tasks/?outcome=green")
    assert refused.status_code == 400 and "outcome must be one of" in str(refused.json())
    client.force_login(owner)
    page = client.get("/tasks/traces/?outcome=tests_pass").content.decode()
    assert f'data-task="{passed.pk}"' in page and f'data-task="{failed.pk}"' not in page
    assert "finished, tests pass" in page
    listing = client.get("/tasks/").content.decode()
    assert "finished, tests fail" in listing and "finished, tests pass" in listing
