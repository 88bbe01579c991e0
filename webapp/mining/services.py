"""Writes of the mining app: a repository's environment setup, task-set mining, cancellation.

The web process only stores requests and enqueues; the Celery jobs (webapp.mining.tasks, queue
"maintenance") run ``repository_setup_run`` and ``task_set_mine`` in a worker, where the sandboxes are.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from webapp.core.validation import CONFLICT
from webapp.experiments.models import RepositoryRecipe
from webapp.mining.models import MinedTask, TaskSet
from webapp.mining.presenters import rejected_text

if TYPE_CHECKING:
    from sandboxes.base import SandboxLimits

logger = logging.getLogger(__name__)
PROGRESS_EVERY_S = 1.0


def _source(repository):
    from sandboxes.base import RepoSource

    return RepoSource(kind=repository.kind, location=repository.location, ref=repository.ref or None)


def setup_budget():
    """The SetupBudget from the settings (REPO_SETUP_*)."""
    from training.tasks.autoinstall import SetupBudget

    return SetupBudget(network=settings.REPO_SETUP_NETWORK, setup_timeout_s=settings.REPO_SETUP_TIMEOUT_S,
                       setup_disk_mb=settings.REPO_SETUP_DISK_MB, test_timeout_s=settings.REPO_TEST_TIMEOUT_S)


_SNAPSHOT_ID = re.compile(r"^[a-z]+-[0-9a-f]{16}$")
_FINGERPRINTED = ("setup_commands", "test_command", "runner", "network")


def recipe_fingerprint(recipe: dict) -> str:
    """What makes two recipes build the same snapshot (setup commands, test command, runner, network)."""
    text = json.dumps({key: recipe.get(key) for key in _FINGERPRINTED}, sort_keys=True, default=list)
    return hashlib.sha256(text.encode()).hexdigest()


def _snapshot_stored(snapshot, recipe: dict) -> dict:
    return {"id": snapshot.id, "backend": snapshot.backend, "location": snapshot.location, "image": snapshot.image,
            "source": [snapshot.source.kind, snapshot.source.location, snapshot.source.ref],
            "setup_commands": list(snapshot.setup_commands), "created_at": snapshot.created_at,
            "recipe": recipe_fingerprint(recipe)}


def prepared_snapshot_get(*, repository_id: int | None, backend, source=None):
    """The kept snapshot of the repository's ready setup, when ``backend`` built it, it still exists, it was
    built from ``source`` (when given) and the recipe has not changed since; else None."""
    from sandboxes.base import RepoSource, Snapshot

    if repository_id is None:
        return None
    row = RepositoryRecipe.objects.filter(repository_id=repository_id, status=RepositoryRecipe.Status.READY).first()
    stored = row.snapshot if row else {}
    if not stored or stored.get("recipe") != recipe_fingerprint(row.recipe) or stored.get("backend") != backend.name:
        return None
    try:
        kind, location, ref = stored["source"]
        snapshot = Snapshot(id=str(stored["id"]), backend=backend.name, source=RepoSource(kind=kind, location=location,
                            ref=ref), image=stored.get("image"), setup_commands=tuple(stored["setup_commands"]),
                            location=str(stored["location"]), created_at=float(stored["created_at"]))
    except (KeyError, TypeError, ValueError):
        return None
    root = getattr(backend, "root", None)
    if not _SNAPSHOT_ID.match(snapshot.id) or (source is not None and snapshot.source != source):
        return None
    if root is not None and snapshot.location != str(root / "snapshots" / snapshot.id / "tree"):
        return None  # a snapshot lives in its backend's own store (local, docker), nowhere else
    if root is not None and not Path(snapshot.location).is_dir():
        return None  # collected (backend.gc) since
    return snapshot


def snapshot_is_kept(*, snapshot_id: str) -> bool:
    """Whether a repository's setup keeps this snapshot (product tasks must not delete it)."""
    return RepositoryRecipe.objects.filter(snapshot__id=snapshot_id).exists()


def _kept_snapshot_release(*, backend, stored: dict, keep_id: str = "") -> None:
    """Delete a previously kept snapshot unless it is ``keep_id`` or a live sandbox still runs on it
    (then backend.gc takes it once unused)."""
    from sandboxes.base import RepoSource, Snapshot

    old = str(stored.get("id") or "")
    if not old or old == keep_id or stored.get("backend") != backend.name or not _SNAPSHOT_ID.match(old):
        return
    if old in backend.snapshots_in_use():
        return
    backend.snapshot_delete(snapshot=Snapshot(id=old, backend=backend.name, source=RepoSource(kind="path",
                            location="."), image=None, setup_commands=(), location=str(stored.get("location", ""))))


def recipe_snapshot_setup(*, repository_id: int | None) -> tuple[tuple[str, ...], SandboxLimits | None]:
    """(setup commands, setup limits) for a product task's snapshot: a ready recipe whose setup downloads is
    run when the snapshot is built, with the network on for that phase only; otherwise nothing (an offline
    recipe's commands run at verification, webapp.agents.verify)."""
    if repository_id is None:
        return (), None
    ready = RepositoryRecipe.objects.filter(repository_id=repository_id, status=RepositoryRecipe.Status.READY).first()
    recipe = ready.recipe if ready else {}
    if not recipe.get("network") or not recipe.get("setup_commands"):
        return (), None
    from training.tasks.environment import setup_limits

    return tuple(recipe["setup_commands"]), setup_limits(setup_budget())


def recipe_edited_parse(*, setup_commands: str, test_command: str, runner: str) -> dict:
    """A user-written recipe (setup commands one per line) checked by InstallRecipe's own rules."""
    from training.tasks.autoinstall import InstallError, InstallRecipe

    commands = tuple(line.strip() for line in (setup_commands or "").splitlines() if line.strip())
    if len(commands) > 20 or any(len(c) > 1000 for c in commands) or len(test_command or "") > 1000:
        raise ValidationError({"setup_commands": "at most 20 setup commands of at most 1000 characters"})
    try:
        recipe = InstallRecipe.from_dict({"setup_commands": commands, "test_command": (test_command or "").strip(),
                                          "runner": runner, "detected_from": ("edited",)})
    except InstallError as error:
        field = "runner" if "runner" in str(error) else "test_command"
        raise ValidationError({field: str(error)}) from None
    return recipe.as_dict()


def repository_setup_request(*, repository, edited_recipe: dict | None = None, enqueue: bool = True) -> RepositoryRecipe:
    """Queue the environment setup (detect unless ``edited_recipe``; install; baseline) of a repository."""
    with transaction.atomic():
        recipe, _ = RepositoryRecipe.objects.select_for_update().get_or_create(repository=repository)
        if recipe.status == RepositoryRecipe.Status.RUNNING:
            raise ValidationError("the repository's setup is already running", code=CONFLICT)
        recipe.status = RepositoryRecipe.Status.PENDING
        recipe.edited = edited_recipe is not None
        if edited_recipe is not None:
            recipe.recipe = edited_recipe
        recipe.failure = {}
        recipe.save()
    if enqueue:
        from webapp.mining.tasks import repository_setup_task

        transaction.on_commit(lambda: repository_setup_task.delay(repository.pk))
    return recipe


def repository_setup_run(*, repository) -> RepositoryRecipe:
    """Detect (or take the edited recipe), install and baseline the repository; store the outcome and log."""
    from sandboxes import get_backend
    from training.tasks.autoinstall import InstallRecipe
    from training.tasks.environment import PreparedEnvironment, environment_prepare

    recipe_row, _ = RepositoryRecipe.objects.get_or_create(repository=repository)
    given = None
    if recipe_row.edited and recipe_row.recipe:
        given = InstallRecipe.from_dict({k: v for k, v in recipe_row.recipe.items()
                                         if k in InstallRecipe.__dataclass_fields__})
    budget = setup_budget()
    # updated_at marks the start: the page counts the elapsed time from it and shows the log as it grows.
    RepositoryRecipe.objects.filter(pk=recipe_row.pk).update(status=RepositoryRecipe.Status.RUNNING, log="", step="",
                                                             budget=dataclasses.asdict(budget), updated_at=timezone.now())

    def on_log(text: str, step: str) -> None:
        RepositoryRecipe.objects.filter(pk=recipe_row.pk).update(log=text, step=step[:200])

    backend = get_backend(settings.SANDBOX_BACKEND)
    try:
        outcome = environment_prepare(backend=backend, source=_source(repository), budget=budget, recipe=given,
                                      on_log=on_log)
    except Exception as error:  # stored so the page says why; the worker log has the traceback
        logger.exception("setup of repository %s failed", repository.pk)
        outcome = None
        failure = {"stage": "install", "reason": f"{type(error).__name__}: {error}", "output_tail": "", "log": ""}
    if isinstance(outcome, PreparedEnvironment):
        # The prepared snapshot is kept: product tasks and mining on this repository start from it.
        recipe = outcome.recipe.as_dict()
        fields: dict[str, Any] = {"status": RepositoryRecipe.Status.READY, "recipe": recipe, "failure": {},
                                  "log": outcome.log, "snapshot": _snapshot_stored(outcome.snapshot, recipe)}
    else:
        if outcome is not None:
            failure = outcome.as_dict()
        fields = {"status": RepositoryRecipe.Status.FAILED, "failure": failure, "log": failure.pop("log", ""),
                  "snapshot": {}}
        if not recipe_row.edited:
            fields["recipe"] = {}
    RepositoryRecipe.objects.filter(pk=recipe_row.pk).update(**fields, step="", updated_at=timezone.now())
    _kept_snapshot_release(backend=backend, stored=recipe_row.snapshot, keep_id=fields["snapshot"].get("id", ""))
    recipe_row.refresh_from_db()
    return recipe_row


def mining_config_check(values: dict[str, Any]):
    """MiningConfig from user input: known fields only, its own rules, candidates within the setting."""
    from training.tasks.repo_mining import MiningConfig, MiningError

    known = {f.name for f in dataclasses.fields(MiningConfig)} - {"kinds"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValidationError({"settings": f"unknown mining settings {unknown}"})
    if int(values.get("max_candidates", 1)) > settings.MINING_MAX_CANDIDATES:
        raise ValidationError({"max_candidates": f"at most {settings.MINING_MAX_CANDIDATES} (MINING_MAX_CANDIDATES)"})
    try:
        return MiningConfig(**values)
    except (MiningError, TypeError) as error:
        raise ValidationError({"settings": str(error)}) from None


def task_set_create(*, owner, repository, name: str, settings_values: dict | None = None, team=None,
                    enqueue: bool = True) -> TaskSet:
    """Store a mining request for a repository whose setup is ready, and queue the job."""
    if team is not None and not owner.teams.filter(pk=team.pk).exists():
        raise ValidationError({"team": f"you are not a member of the team '{team.name}'"})
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "give the task set a name"})
    ready = RepositoryRecipe.objects.filter(repository=repository, status=RepositoryRecipe.Status.READY).first()
    if ready is None:
        raise ValidationError({"repository": "set the repository's environment up first (its setup is not ready)"})
    config = mining_config_check(dict(settings_values or {}))
    task_set = TaskSet.objects.create(
        owner=owner, team=team, name=name[:200], repository=repository, repo_label=repository.name,
        repo_location=repository.location, recipe=ready.recipe, settings=dataclasses.asdict(config),
    )
    if enqueue:
        from webapp.mining.tasks import task_set_mine_task

        transaction.on_commit(lambda: task_set_mine_task.delay(task_set.pk))
    return task_set


def task_set_cancel(*, task_set: TaskSet) -> TaskSet:
    """Ask a queued or running mining job to stop; nothing it found is kept."""
    if task_set.status not in TaskSet.ACTIVE:
        raise ValidationError(f"the task set is {task_set.status}; only a queued or running one can be cancelled",
                              code=CONFLICT)
    TaskSet.objects.filter(pk=task_set.pk).update(cancel_requested=True)
    TaskSet.objects.filter(pk=task_set.pk, status=TaskSet.Status.QUEUED).update(
        status=TaskSet.Status.CANCELLED, finished_at=timezone.now(), status_reason="cancelled before it started")
    task_set.refresh_from_db()
    return task_set


def _bug_diff(task) -> str:
    path = task.solution.path
    fixed = task.solved_files()[path]
    return "".join(difflib.unified_diff(fixed.splitlines(keepends=True), task.files[path].splitlines(keepends=True),
                                        fromfile=f"a/{path}", tofile=f"b/{path}"))


def _finish(task_set_id: int, **fields) -> None:
    TaskSet.objects.filter(pk=task_set_id).update(finished_at=timezone.now(), **fields)


def _head_commit(backend, snapshot) -> str:
    from training.tasks.environment import baseline_limits

    sandbox = backend.sandbox_create(snapshot=snapshot, limits=baseline_limits(60))
    try:
        result = sandbox.exec("git -c safe.directory='*' rev-parse HEAD", timeout_s=30)
    finally:
        sandbox.destroy()
    head = result.stdout.strip()
    return head if result.exit_code == 0 and len(head) == 40 else ""


def _progress_writer(task_set_id: int):
    last = [0.0]

    def write(progress: dict) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S or progress.get("phase") != "validating":
            last[0] = now
            TaskSet.objects.filter(pk=task_set_id).update(progress=progress)

    return write


def _prepared_kept(*, backend, task_set: TaskSet, recipe):
    """The repository's kept prepared snapshot as a PreparedEnvironment, when the set's recipe built it."""
    from dataclasses import replace

    from training.tasks.autoinstall import repository_files
    from training.tasks.environment import PreparedEnvironment, baseline_limits

    snapshot = prepared_snapshot_get(repository_id=task_set.repository_id, backend=backend,
                                     source=_source(task_set.repository))
    stored = RepositoryRecipe.objects.filter(repository_id=task_set.repository_id).values_list("snapshot", flat=True)
    if snapshot is None or recipe_fingerprint(task_set.recipe) != (stored.first() or {}).get("recipe"):
        return None
    sandbox = backend.sandbox_create(snapshot=snapshot, limits=baseline_limits(60))
    try:
        paths = repository_files(sandbox)[1]
    finally:
        sandbox.destroy()
    recipe = replace(recipe, verified=True, baseline=dict(task_set.recipe.get("baseline") or {}))
    return PreparedEnvironment(recipe=recipe, snapshot=snapshot, paths=paths,
                               log=f"the repository's prepared snapshot {snapshot.id} (setup not repeated)")


def task_set_mine(*, task_set_id: int) -> TaskSet:
    """The mining job: prepare the environment with the stored recipe, mine, store the tasks atomically."""
    from sandboxes import get_backend
    from training.tasks.autoinstall import InstallRecipe
    from training.tasks.environment import PreparedEnvironment, environment_prepare
    from training.tasks.repo_mining import MiningConfig, MiningError, mine_repository_tasks

    claimed = TaskSet.objects.filter(pk=task_set_id, status=TaskSet.Status.QUEUED).update(
        status=TaskSet.Status.RUNNING, started_at=timezone.now(), progress={"phase": "setup"})
    task_set = TaskSet.objects.select_related("repository").get(pk=task_set_id)
    if not claimed:
        return task_set
    if task_set.repository is None:
        _finish(task_set_id, status=TaskSet.Status.FAILED, status_reason="the repository was deleted")
        return TaskSet.objects.get(pk=task_set_id)
    backend = get_backend(settings.SANDBOX_BACKEND)
    recipe = InstallRecipe.from_dict({k: v for k, v in task_set.recipe.items() if k in InstallRecipe.__dataclass_fields__})
    started = time.monotonic()
    prepared = _prepared_kept(backend=backend, task_set=task_set, recipe=recipe)
    kept = prepared is not None
    if prepared is None:
        prepared = environment_prepare(backend=backend, source=_source(task_set.repository), budget=setup_budget(),
                                       recipe=recipe)
    if not isinstance(prepared, PreparedEnvironment):
        _finish(task_set_id, status=TaskSet.Status.FAILED,
                status_reason=f"setup failed at the {prepared.stage} step: {prepared.reason}")
        return TaskSet.objects.get(pk=task_set_id)
    setup_s = time.monotonic() - started
    stop = lambda: TaskSet.objects.filter(pk=task_set_id, cancel_requested=True).exists()  # noqa: E731
    try:
        commit = _head_commit(backend, prepared.snapshot)
        result = mine_repository_tasks(backend=backend, prepared=prepared, config=MiningConfig(**task_set.settings),
                                       repo_label=f"{task_set.repo_label}-{task_set.pk}",
                                       on_progress=_progress_writer(task_set_id), should_stop=stop)
    except MiningError as error:
        _finish(task_set_id, status=TaskSet.Status.FAILED, status_reason=str(error))
        return TaskSet.objects.get(pk=task_set_id)
    finally:
        if not kept:
            backend.snapshot_delete(snapshot=prepared.snapshot)
    return _task_set_store(task_set_id=task_set_id, result=result, recipe=prepared.recipe, commit=commit,
                           setup_s=setup_s, cancelled=stop())


def _task_set_store(*, task_set_id: int, result, recipe, commit: str, setup_s: float, cancelled: bool) -> TaskSet:
    stats = {
        "setup_s": round(setup_s, 2), "baseline_s": recipe.baseline.get("duration_s"), "tried": result.tried,
        "validated": len(result.tasks), "yield": round(len(result.tasks) / result.tried, 3) if result.tried else 0.0,
        "proposed": result.proposed, "rejected": dict(result.rejected), "mining_s": round(result.wall_s, 2),
        "validation_s": round(result.validation_s, 2), "expert_s": round(result.expert_s, 2),
        "stopped": result.stopped, "test_runs": dict(result.runs), "selection": result.selection_note,
        "splits": {split: sum(1 for t in result.tasks if t.split == split) for split in ("train", "heldout")},
    }
    if cancelled:
        _finish(task_set_id, status=TaskSet.Status.CANCELLED, status_reason="cancelled; no tasks kept", stats=stats)
        return TaskSet.objects.get(pk=task_set_id)
    if not result.tasks:
        _finish(task_set_id, status=TaskSet.Status.FAILED, stats=stats,
                status_reason=f"no candidate validated ({result.tried} tried; "
                              f"rejected: {rejected_text(result.rejected) or 'none'})")
        return TaskSet.objects.get(pk=task_set_id)
    with transaction.atomic():
        task_set = TaskSet.objects.select_for_update().get(pk=task_set_id)
        MinedTask.objects.bulk_create([
            MinedTask(task_set=task_set, task_id=task.task_id, split=task.split, source=task.metadata["source"],
                      path=task.solution.path, kind=task.mutation_kind, fail_to_pass=list(task.fail_to_pass),
                      prompt=task.prompt, diff=_bug_diff(task), expert_solved=task.metadata.get("expert_solved"),
                      task=dataclasses.asdict(task))
            for task in result.tasks
        ])
        task_set.status = TaskSet.Status.READY
        task_set.commit = commit
        task_set.recipe = recipe.as_dict()
        task_set.stats = stats
        task_set.finished_at = timezone.now()
        task_set.save(update_fields=["status", "commit", "recipe", "stats", "finished_at"])
    return task_set


def task_set_tasks(*, task_set: TaskSet, split: str | None = None) -> list:
    """The CodingTasks of a ready set (one split, or all), for training and benchmarks."""
    import json

    from training.tasks.base import CodingTask

    if task_set.status != TaskSet.Status.READY:
        raise ValidationError({"task_set": f"task set {task_set.pk} is {task_set.status}, not ready"})
    rows = task_set.tasks.all() if split is None else task_set.tasks.filter(split=split)
    return [CodingTask.from_json(json.dumps(row.task)) for row in rows.order_by("id")]


def task_set_pool_write(*, task_set_id: int, run_dir: str) -> int:
    """Write a ready set's train-split tasks into an experiment's run directory (the driver's pool)."""
    from pathlib import Path

    from training.rollout.run_dir import TASKS_FILE

    task_set = TaskSet.objects.get(pk=task_set_id)
    tasks = task_set_tasks(task_set=task_set, split="train")
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / TASKS_FILE).write_text("".join(task.to_json() + "\n" for task in tasks))
    return len(tasks)
