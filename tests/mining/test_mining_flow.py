"""The web flow on a small repository built in the test: register (archive with its git history) ->
set up -> mine -> train on the set (experiment launch) and benchmark it; persona checks on every new page
and endpoint. The Celery jobs run in-process (the services the worker calls), so this costs seconds."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from tests.mining.conftest import build_small_repository

pytestmark = pytest.mark.django_db


def _archive(root) -> SimpleUploadedFile:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(root.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(root)), recursive=False)
    return SimpleUploadedFile("calc.tar.gz", buffer.getvalue(), content_type="application/gzip")


@pytest.fixture
def mined(owner, team, tmp_path, client, settings, django_capture_on_commit_callbacks):
    """A ready task set mined through the pages (returns (repository, task_set))."""
    from webapp.agents.models import Repository
    from webapp.mining.models import TaskSet
    from webapp.mining.services import repository_setup_run, task_set_mine

    settings.REPO_SETUP_NETWORK = False
    client.force_login(owner)
    root = build_small_repository(tmp_path / "calc")
    response = client.post(reverse("agents:repository-list"), {
        "name": "calc", "kind": "archive", "archive": _archive(root), "share_with_team": team.pk})
    assert response.status_code == 302, response.content[:500]
    repository = Repository.objects.get(name="calc")
    with django_capture_on_commit_callbacks(execute=False) as queued:
        response = client.post(reverse("mining:repository-setup", args=[repository.pk]), {"action": "detect"})
    assert response.status_code == 302 and len(queued) == 1
    recipe = repository_setup_run(repository=repository)  # what the Celery job does
    assert recipe.status == "ready", (recipe.failure, recipe.log)
    page = client.get(reverse("mining:repository", args=[repository.pk])).content.decode()
    assert "8 passing, 0 failing, 0 erroring" in page and "Setup log" in page
    with django_capture_on_commit_callbacks(execute=False):
        response = client.post(reverse("mining:repository", args=[repository.pk]), {
            "name": "calc tasks", "max_candidates": 16, "max_tasks": 8, "history_commits": 10,
            "heldout_percent": 50, "seed": 1, "time_budget_s": 600, "share_with_team": team.pk})
    assert response.status_code == 302, response.content.decode()[-2000:]
    task_set = TaskSet.objects.get(name="calc tasks")
    assert task_set.status == "queued" and "queued" in client.get(
        reverse("mining:task-set-progress", args=[task_set.pk])).content.decode()
    task_set = task_set_mine(task_set_id=task_set.pk)
    assert task_set.status == "ready", task_set.status_reason
    return repository, task_set


def test_register_setup_mine_train_and_benchmark(mined, owner, client, django_capture_on_commit_callbacks,
                                                 policy_checkpoint, settings, tmp_path):
    from webapp.experiments.models import BenchmarkRun, Experiment
    from webapp.experiments.services import benchmark_run_create, benchmark_run_execute

    settings.STATE_DIR = tmp_path / "state"
    repository, task_set = mined
    assert len(task_set.commit) == 40 and task_set.stats["validated"] == task_set.tasks.count() >= 4
    assert task_set.tasks.filter(source="history").exists() and task_set.tasks.filter(split="heldout").exists()
    assert not task_set.tasks.exclude(expert_solved=True).exists()  # the difficulty estimate ran on every task
    page = client.get(reverse("mining:task-set-detail", args=[task_set.pk])).content.decode()
    assert "mined-tasks" in page and f"taskset-{task_set.pk}-heldout" in page
    task = task_set.tasks.filter(source="history").first()
    detail = client.get(reverse("mining:mined-task", args=[task_set.pk, task.pk])).content.decode()
    assert "test_clamp_high" in detail and "--- a/calc/ops.py" in detail
    lines = b"".join(client.get(reverse("mining:task-set-export", args=[task_set.pk])).streaming_content).splitlines()
    assert len(lines) == task_set.tasks.count()
    assert json.loads(lines[0])["metadata"]["task_set"]["commit"] == task_set.commit

    with django_capture_on_commit_callbacks(execute=False):
        response = client.post(reverse("experiments:experiment-list"), {
            "name": "on calc", "task_set": task_set.pk, "tasks": 4, "steps": 1, "init_checkpoint": policy_checkpoint})
    assert response.status_code == 302, response.content.decode()[-3000:]
    experiment = Experiment.objects.get(name="on calc")
    pool = (__import__("pathlib").Path(experiment.run_dir) / "tasks.jsonl").read_text().splitlines()
    assert len(pool) == task_set.tasks.filter(split="train").count()
    from training.rollout.actors import task_for_group
    from training.rollout.config import AsyncRLConfig

    config = AsyncRLConfig(**{**experiment.config, "run_dir": experiment.run_dir})
    assert task_for_group(config, 0).tier == "repo"

    run = benchmark_run_create(owner=owner, suite=task_set.suite("heldout"), policy="scripted", enqueue=False)
    run = benchmark_run_execute(run_id=run.pk)
    assert run.status == BenchmarkRun.Status.FINISHED and run.summary["pass_at_1"] == 1.0
    board = client.get(reverse("experiments:benchmarks")).content.decode()
    assert task_set.suite("heldout") in board
    assert "scripted: 1.00" in client.get(reverse("mining:task-set-detail", args=[task_set.pk])).content.decode()


def test_personas_on_task_set_pages_and_api(shared_set, owner, teammate, outsider, client, api_client_for):
    repository, task_set = shared_set
    task = task_set.tasks.first()
    pages = [reverse("mining:task-set-detail", args=[task_set.pk]), reverse("mining:task-set-progress", args=[task_set.pk]),
             reverse("mining:mined-task", args=[task_set.pk, task.pk]), reverse("mining:task-set-export", args=[task_set.pk]),
             reverse("mining:repository", args=[repository.pk])]
    apis = [f"/api/task-sets/{task_set.pk}/", f"/api/task-sets/{task_set.pk}/export/",
            f"/api/repositories/{repository.pk}/environment/"]
    for user, expected in ((teammate, 200), (outsider, 404)):
        client.force_login(user)
        for url in pages:
            assert client.get(url).status_code == expected, (user.username, url)
        api = api_client_for(user)
        for url in apis:
            assert api.get(url).status_code == expected, (user.username, url)
        listed = [row["id"] for row in api.get("/api/task-sets/").json()]
        assert (task_set.pk in listed) == (expected == 200)
        # Only the owner changes anything: cancel, set up, mine.
        assert api.post(f"/api/task-sets/{task_set.pk}/cancel/").status_code == 404
        assert api.post(f"/api/repositories/{repository.pk}/environment/", {}, format="json").status_code == 404
        assert api.post("/api/task-sets/", {"repository_id": repository.pk, "name": "x"}, format="json").status_code == 404
        assert client.post(reverse("mining:repository-setup", args=[repository.pk])).status_code == 404
        assert client.post(reverse("mining:task-set-cancel", args=[task_set.pk])).status_code == 404
    assert api_client_for(None).get("/api/task-sets/").status_code in (401, 403)
    owner_api = api_client_for(owner)
    assert owner_api.post(f"/api/task-sets/{task_set.pk}/cancel/").status_code == 409  # ready: nothing to cancel
    # The outsider cannot train or benchmark on a set they cannot see.
    from django.core.exceptions import ValidationError

    from webapp.experiments.services import benchmark_run_create
    from webapp.experiments.validation import task_set_check

    with pytest.raises(ValidationError, match="no ready task set"):
        benchmark_run_create(owner=outsider, suite=task_set.suite("heldout"), policy="scripted", enqueue=False)
    with pytest.raises(ValidationError, match="no ready task set"):
        task_set_check(task_set.pk, owner=outsider)


def test_edited_recipe_and_bad_input(owner, tmp_path, settings, api_client_for, django_capture_on_commit_callbacks):
    from webapp.agents.models import Repository
    from webapp.mining.models import TaskSet
    from webapp.mining.services import repository_setup_run, task_set_create, task_set_mine

    settings.REPO_SETUP_NETWORK = False
    root = build_small_repository(tmp_path / "calc")
    repository = Repository.objects.create(owner=owner, name="calc", kind="path", location=str(root))
    api = api_client_for(owner)
    # Mining before setup is refused; a recipe that never passes a test fails at the test step with its log.
    assert "set the repository's environment up first" in api.post(
        "/api/task-sets/", {"repository_id": repository.pk, "name": "early"}, format="json").content.decode()
    with django_capture_on_commit_callbacks(execute=False):
        response = api.post(f"/api/repositories/{repository.pk}/environment/", {
            "test_command": "python3 -m unittest -v tests.test_missing", "runner": "unittest"}, format="json")
    assert response.status_code == 202 and response.json()["edited"]
    recipe = repository_setup_run(repository=repository)
    assert recipe.status == "failed" and recipe.failure["stage"] == "test" and "test_missing" in recipe.log
    assert api.post(f"/api/repositories/{repository.pk}/environment/", {"runner": "nose"},
                    format="json").status_code == 400
    # A hanging suite makes a mined set fail cleanly, with no tasks kept.
    recipe.status, recipe.recipe = "ready", {"setup_commands": [], "test_command": "sleep 30", "runner": "unittest",
                                             "detected_from": ["edited"]}
    recipe.save()
    settings.REPO_TEST_TIMEOUT_S = 2
    task_set = task_set_create(owner=owner, repository=repository, name="hangs", enqueue=False)
    task_set = task_set_mine(task_set_id=task_set.pk)
    assert task_set.status == TaskSet.Status.FAILED and "setup failed at the test step" in task_set.status_reason
    assert task_set.tasks.count() == 0
    assert "unknown mining settings" in api.post("/api/task-sets/", {
        "repository_id": repository.pk, "name": "x", "settings": {"bogus": 1}}, format="json").content.decode()


def test_product_tasks_on_a_repository_reuse_its_network_recipe(owner, tmp_path):
    from webapp.agents import verify
    from webapp.agents.models import AgentTask, Repository
    from webapp.experiments.models import RepositoryRecipe
    from webapp.mining.services import recipe_snapshot_setup

    repository = Repository.objects.create(owner=owner, name="calc", kind="path", location=str(tmp_path))
    recipe = RepositoryRecipe.objects.create(repository=repository, status="ready", recipe={
        "runner": "pytest", "setup_commands": ["python3 -m pip install --target .flowstate/site pytest"],
        "test_command": "python3 -m pytest -rA", "network": True})
    commands, limits = recipe_snapshot_setup(repository_id=repository.pk)
    assert commands == ("python3 -m pip install --target .flowstate/site pytest",) and limits.network
    task = AgentTask(owner=owner, repository=repository, repo_kind="path", repo_location=str(tmp_path))
    plan = verify._plan(task=task, sandbox=None)
    assert plan.setup_commands == () and plan.source == "recipe"  # already in the task's snapshot
    recipe.recipe = {**recipe.recipe, "network": False}
    recipe.save()
    assert recipe_snapshot_setup(repository_id=repository.pk) == ((), None)
    assert verify._plan(task=task, sandbox=None).setup_commands == tuple(recipe.recipe["setup_commands"])
