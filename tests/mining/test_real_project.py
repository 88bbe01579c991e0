"""A real open-source project through the web flow, offline: the inflection 0.5.1 sdist (tests/data, MIT)
is registered as an archive, set up with the network off, mined, trained on (experiment launch from the
form's task-set menu) and benchmarked (the leaderboard's form). Sandboxes are Docker containers of the
sandbox image, which carries pytest (the project's suite needs it and no dependency else); the image has
no pip, so the detected offline install fails at its step and the user's edited recipe (no setup, the
suite from the root) is what runs - the flow a user follows on the repository page.

The Celery jobs run in-process (the services the worker calls). Candidates are bounded here; the slow
test mines 40 of them twice, running only the tests that call each mutated function and running the
whole suite, and checks both keep the same tasks for the same reasons."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

SDIST = Path(__file__).resolve().parent.parent / "data" / "inflection-0.5.1.tar.gz"
pytestmark = [pytest.mark.django_db, pytest.mark.docker]


def _docker_ready() -> None:
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env(timeout=5)
        client.ping()
        client.images.get("flowstate-sandbox:latest")
    except Exception as error:  # noqa: BLE001 - any failure to reach the engine or the image means "skip docker"
        pytest.skip(f"the Docker engine or the sandbox image is not available: {error}")


def _unpacked(tmp_path) -> Path:
    with tarfile.open(SDIST) as tar:
        tar.extractall(tmp_path / "sdist", filter="data")
    root = tmp_path / "sdist" / "inflection-0.5.1"
    assert (root / "LICENSE").read_text().startswith("Copyright (C) 2012-2020 Janne Vanhala")
    return root


def _archive(root: Path) -> SimpleUploadedFile:
    """The sdist's files at the archive's top level (an sdist nests them under name-version/)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(root.rglob("*")):
            if "__pycache__" not in path.parts:
                tar.add(path, arcname=str(path.relative_to(root)), recursive=False)
    return SimpleUploadedFile("inflection-0.5.1.tar.gz", buffer.getvalue(), content_type="application/gzip")


def _set_up(client, repository, data: dict, capture) -> object:
    from webapp.mining.services import repository_setup_run

    with capture(execute=False) as queued:
        response = client.post(reverse("mining:repository-setup", args=[repository.pk]), data)
    assert response.status_code == 302 and len(queued) == 1
    return repository_setup_run(repository=repository)  # what the Celery job does


def test_inflection_sdist_register_setup_mine_train_benchmark(owner, team, tmp_path, client, settings,
                                                              django_capture_on_commit_callbacks, policy_checkpoint):
    _docker_ready()
    from webapp.agents.models import Repository
    from webapp.experiments.models import BenchmarkRun, Experiment
    from webapp.experiments.services import benchmark_run_execute
    from webapp.mining.models import TaskSet
    from webapp.mining.services import task_set_mine

    settings.REPO_SETUP_NETWORK = False
    settings.SANDBOX_BACKEND = "docker"
    settings.STATE_DIR = tmp_path / "state"
    client.force_login(owner)
    response = client.post(reverse("agents:repository-list"), {
        "name": "inflection", "kind": "archive", "archive": _archive(_unpacked(tmp_path)), "share_with_team": team.pk})
    assert response.status_code == 302, response.content[:500]
    repository = Repository.objects.get(name="inflection")
    # Detection finds setup.py and a pytest suite (test_inflection.py imports pytest); offline, its install
    # step needs pip, which the sandbox image lacks: the failure names the step and keeps the log.
    recipe = _set_up(client, repository, {"action": "detect"}, django_capture_on_commit_callbacks)
    assert recipe.status == "failed" and recipe.failure["stage"] == "install", recipe.failure
    assert "offline" in recipe.failure["reason"] and "pip install --no-index" in recipe.log
    assert "test_inflection.py" in recipe.log  # detection saw the pytest suite
    # The user's recipe: nothing to install (pure Python, no dependencies), pytest from the root.
    recipe = _set_up(client, repository, {"action": "save", "setup_commands": "", "runner": "pytest",
                                          "test_command": "python3 -m pytest -rA -q -p no:cacheprovider"},
                     django_capture_on_commit_callbacks)
    assert recipe.status == "ready", (recipe.failure, recipe.log[-3000:])
    assert len(recipe.recipe["baseline"]["passed"]) == 449 and recipe.snapshot["backend"] == "docker"
    page = client.get(reverse("mining:repository", args=[repository.pk])).content.decode()
    assert "449 passing, 0 failing, 0 erroring" in page

    with django_capture_on_commit_callbacks(execute=False):
        response = client.post(reverse("mining:repository", args=[repository.pk]), {
            "name": "inflection tasks", "max_candidates": 14, "max_tasks": 5, "history_commits": 0,
            "heldout_percent": 50, "seed": 3, "time_budget_s": 900, "selection": "calls",
            "share_with_team": team.pk})
    assert response.status_code == 302, response.content.decode()[-2000:]
    task_set = task_set_mine(task_set_id=TaskSet.objects.get(name="inflection tasks").pk)
    assert task_set.status == "ready", (task_set.status_reason, task_set.stats)
    stats = task_set.stats
    assert stats["validated"] == task_set.tasks.count() >= 3 and stats["tried"] <= 14, stats
    assert stats["test_runs"].get("selected", 0) >= 1 and "call map of 449 tests" in stats["selection"], stats
    assert set(stats["splits"]) == {"train", "heldout"} and min(stats["splits"].values()) >= 1, stats
    assert not task_set.tasks.exclude(expert_solved=True).exists()
    task = task_set.tasks.first()
    assert task.path == "inflection/__init__.py" and task.fail_to_pass[0].startswith("test_inflection.py::")
    assert "--- a/inflection/__init__.py" in client.get(reverse("mining:mined-task", args=[task_set.pk, task.pk])
                                                        ).content.decode()

    # Train on it: the experiment form's task-set menu offers it; the run's pool is its train split.
    page = client.get(reverse("experiments:experiment-list")).content.decode()
    assert f'<option value="{task_set.pk}">inflection tasks (#{task_set.pk}' in page
    with django_capture_on_commit_callbacks(execute=False):
        response = client.post(reverse("experiments:experiment-list"), {
            "name": "on inflection", "task_set": task_set.pk, "tasks": 4, "steps": 1,
            "init_checkpoint": policy_checkpoint})
    assert response.status_code == 302, response.content.decode()[-3000:]
    pool = (Path(Experiment.objects.get(name="on inflection").run_dir) / "tasks.jsonl").read_text().splitlines()
    assert len(pool) == stats["splits"]["train"]

    # Benchmark it from the leaderboard: the scripted expert solves every held-out task in the sandbox.
    with django_capture_on_commit_callbacks(execute=False):
        client.post(reverse("experiments:benchmark-run"), {"suite": task_set.suite("heldout"), "policy": "scripted",
                                                           "attempts": 1})
    run = benchmark_run_execute(run_id=BenchmarkRun.objects.get(suite=task_set.suite("heldout")).pk)
    assert run.status == BenchmarkRun.Status.FINISHED and run.summary["pass_at_1"] == 1.0, run.summary
    assert task_set.suite("heldout") in client.get(reverse("experiments:benchmarks")).content.decode()
    from sandboxes import get_backend
    from webapp.mining.services import prepared_snapshot_get

    backend = get_backend("docker")  # the kept snapshot (an image) outlives the test's database otherwise
    backend.snapshot_delete(snapshot=prepared_snapshot_get(repository_id=repository.pk, backend=backend))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_selected_tests_keep_the_same_tasks_as_whole_suite_runs(tmp_path):
    """Exhaustive check of test selection on the real project: 40 candidates, both ways."""
    _docker_ready()
    from sandboxes import get_backend
    from sandboxes.base import RepoSource
    from training.tasks.autoinstall import InstallRecipe, SetupBudget
    from training.tasks.environment import environment_prepare
    from training.tasks.repo_mining import MiningConfig, mine_repository_tasks

    backend = get_backend("docker")
    recipe = InstallRecipe(setup_commands=(), test_command="python3 -m pytest -rA -q -p no:cacheprovider",
                           runner="pytest", detected_from=("edited",))
    prepared = environment_prepare(backend=backend, source=RepoSource(kind="path", location=str(_unpacked(tmp_path))),
                                   budget=SetupBudget(network=False, test_timeout_s=300), recipe=recipe)
    assert hasattr(prepared, "snapshot"), prepared
    try:
        results = {}
        for selection in ("calls", "full"):
            # A generous candidate timeout: on a loaded machine a whole-suite run must not pass for a hang.
            config = MiningConfig(max_candidates=40, max_tasks=40, seed=0, expert_check=False, selection=selection,
                                  test_timeout_s=180)
            results[selection] = mine_repository_tasks(backend=backend, prepared=prepared, config=config,
                                                       repo_label="inflection")
    finally:
        backend.snapshot_delete(snapshot=prepared.snapshot)
    calls, full = results["calls"], results["full"]
    assert calls.runs["selected"] > 0 and full.runs == {"full": 40}
    kept = {selection: {(t.task_id, t.fail_to_pass) for t in result.tasks} for selection, result in results.items()}
    assert kept["calls"] == kept["full"], (kept["calls"] ^ kept["full"], calls.rejected, full.rejected)
    # A function no test calls is rejected without a run; the whole suite finds no failing test for it.
    uncalled = "no test calls the mutated function (not fail-to-pass)"
    rejected = calls.rejected.copy()
    rejected["no test fails with the bug (not fail-to-pass)"] += rejected.pop(uncalled, 0)
    assert +rejected == +full.rejected and len(calls.tasks) >= 15
