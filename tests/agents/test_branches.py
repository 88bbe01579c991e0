"""Branches from finished tasks: commit, bundle, and push with encrypted credentials to a bare
repository served over smart HTTP on loopback (allow-listed for the SSRF guard, as an operator would)."""

from __future__ import annotations

import subprocess

import pytest

from tests.agents.git_http import GitHttpServer
from webapp.agents import services
from webapp.agents.models import AgentTask, RepositoryCredential, TaskBranch

pytestmark = pytest.mark.django_db
SECRET = "s3cret-push-token"
FIX = "return (ordered[middle - 1] + ordered[middle]) / 2"


@pytest.fixture
def served(tmp_path, demo_repo_path, monkeypatch):
    root = tmp_path / "served"
    root.mkdir()
    subprocess.run(["git", "clone", "-q", "--bare", str(demo_repo_path), str(root / "stats.git")], check=True)
    monkeypatch.setenv("FLOWSTATE_GIT_ALLOWED_HOSTS", "127.0.0.1")
    with GitHttpServer(root, username="pusher", secret=SECRET) as server:
        yield server


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def _finished(owner, repository) -> AgentTask:
    task = services.task_create(owner=owner, team=repository.team, prompt="Fix the failing median test",
                                backend="scripted", repository=repository, enqueue=False)
    services.task_run(task_id=task.pk)
    task.refresh_from_db()
    assert task.status == "succeeded" and FIX in task.diff, task.status_reason
    return task


def test_create_branch_commits_and_pushes_with_the_stored_credentials(owner, teammate, outsider, team, served,
                                                                      api_client_for, tmp_path):
    repository = services.repository_create(owner=owner, team=team, name="stats-remote", kind="git",
                                            location=served.url("stats.git"))
    task = _finished(owner, repository)
    api = api_client_for(owner)
    credentials_url = f"/api/repositories/{repository.pk}/credentials/"
    for user in (teammate, outsider):
        assert api_client_for(user).put(credentials_url, {"secret": "x"}, format="json").status_code == 404
    assert api.put(credentials_url, {"username": "pusher", "secret": SECRET}, format="json").status_code == 204
    stored = bytes(RepositoryCredential.objects.get(repository=repository).secret_encrypted)
    assert SECRET.encode() not in stored
    assert SECRET not in api.get("/api/repositories/").content.decode()

    branch_url = f"/api/tasks/{task.pk}/branch/"
    for user in (teammate, outsider):
        assert api_client_for(user).post(branch_url).status_code == 404
    response = api.post(branch_url)
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["name"] == f"flowstate/task-{task.pk}" and body["push_error"] == ""
    assert body["pushed_to"] == served.url("stats.git") and SECRET not in response.content.decode()

    bare = str(served.root / "stats.git")
    assert _git("--git-dir", bare, "rev-parse", f"refs/heads/flowstate/task-{task.pk}").strip() == body["commit"]
    assert FIX in _git("--git-dir", bare, "show", f"{body['commit']}:stats/summary.py")
    message = _git("--git-dir", bare, "log", "-1", "--format=%B", body["commit"])
    assert message.startswith(f"Flowstate task {task.pk}: Fix the failing median test")
    assert "Verification: finished, tests pass" in message and f"Flowstate-Task: {task.public_id}" in message
    assert _git("--git-dir", bare, "rev-parse", f"{body['commit']}^").strip() == body["base_commit"]
    assert any(authed for _, path, authed in served.requests if "receive-pack" in path)

    # Teammates read the branch and fetch the bundle; outsiders see nothing.
    assert api_client_for(teammate).get(branch_url).json()["commit"] == body["commit"]
    bundle = api_client_for(teammate).get(f"/api/tasks/{task.pk}/bundle/")
    assert bundle.status_code == 200
    (tmp_path / "task.bundle").write_bytes(b"".join(bundle.streaming_content))
    _git("clone", "-q", "-b", f"flowstate/task-{task.pk}", str(tmp_path / "task.bundle"), str(tmp_path / "clone"))
    assert FIX in (tmp_path / "clone" / "stats" / "summary.py").read_text()
    for path in (branch_url, f"/api/tasks/{task.pk}/bundle/"):
        assert api_client_for(outsider).get(path).status_code == 404


def test_a_refused_push_is_reported_and_the_bundle_still_made(owner, team, served, api_client_for):
    repository = services.repository_create(owner=owner, team=team, name="stats-remote", kind="git",
                                            location=served.url("stats.git"))
    task = _finished(owner, repository)
    api = api_client_for(owner)
    api.put(f"/api/repositories/{repository.pk}/credentials/", {"username": "pusher", "secret": "wrong"}, format="json")
    body = api.post(f"/api/tasks/{task.pk}/branch/").json()
    assert body["pushed_to"] == "" and body["push_error"].startswith("git push failed") and "wrong" not in body["push_error"]
    bare = str(served.root / "stats.git")
    assert f"flowstate/task-{task.pk}" not in _git("--git-dir", bare, "branch", "--list")
    assert TaskBranch.objects.get(task=task).commit == body["commit"]


def test_a_server_directory_task_gets_a_bundle_and_no_push(owner, demo_repository, api_client_for):
    task = _finished(owner, demo_repository)
    body = api_client_for(owner).post(f"/api/tasks/{task.pk}/branch/").json()
    assert body["pushed_to"] == "" and body["push_error"] == "" and len(body["commit"]) == 40


def test_branch_refusals(owner, demo_repository, api_client_for):
    queued = services.task_create(owner=owner, prompt="p", backend="scripted", repository=demo_repository,
                                  enqueue=False)
    assert api_client_for(owner).post(f"/api/tasks/{queued.pk}/branch/").status_code == 409
    AgentTask.objects.filter(pk=queued.pk).update(status="succeeded", diff="")
    response = api_client_for(owner).post(f"/api/tasks/{queued.pk}/branch/")
    assert response.status_code == 409 and "changed no files" in response.content.decode()
    assert api_client_for(owner).get(f"/api/tasks/{queued.pk}/bundle/").status_code == 404


def test_credentials_only_for_git_repositories_and_never_shown(owner, demo_repository, api_client_for):
    response = api_client_for(owner).put(f"/api/repositories/{demo_repository.pk}/credentials/", {"secret": "t"},
                                         format="json")
    assert response.status_code == 409
