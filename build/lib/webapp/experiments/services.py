"""Writes of the experiments app: launch/pause/resume/cancel/clone, the driver monitor, benchmarks.

The RL driver (training.rollout.driver) runs as its own process. Celery only launches and monitors
it (`experiment_monitor`): it restarts a driver that died (the driver resumes from its checkpoint),
turns pause/cancel requests into SIGTERM, and copies the driver's checkpointed logs into the
database. Only steps covered by a checkpoint are ingested, and rows are unique per (experiment,
step) and (experiment, rollout id), so a restart never records a rollout twice.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from webapp.core.validation import CONFLICT
from webapp.experiments.models import (
    BenchmarkRun,
    BenchmarkTaskResult,
    Experiment,
    ExperimentCheckpoint,
    ExperimentRollout,
    ExperimentStep,
    RepositoryRecipe,
)
from webapp.experiments.selectors import experiment_group_name
from webapp.experiments.validation import experiment_config_check

logger = logging.getLogger(__name__)

MONITOR_POLL_S = 1.0
MONITOR_SLICE_S = 600.0
"""A monitor task hands over to a fresh one after this long, staying far below Celery's time limit."""
MAX_LAUNCHES_WITHOUT_PROGRESS = 3
ROOT = Path(__file__).resolve().parents[2]


def _experiments_root() -> Path:
    return Path(settings.STATE_DIR) / "experiments"


def _enqueue_monitor(experiment_id: int) -> None:
    from webapp.experiments.tasks import experiment_monitor_task

    transaction.on_commit(lambda: experiment_monitor_task.delay(experiment_id))


def _publish(experiment: Experiment, message: dict) -> None:
    # The agents app's publisher owns one event loop thread for the live (pub/sub) layer; a viewer
    # that misses a message reloads from the snapshot the consumer sends on connect.
    from webapp.agents.services import _publisher

    group = experiment_group_name(experiment_id=experiment.pk)
    wait_s = (
        2.0 if message.get("kind") == "status" and message.get("status") not in Experiment.ACTIVE else 0.0
    )
    transaction.on_commit(
        lambda: _publisher.submit(group, {"type": "experiment.update", "message": message}, wait_s=wait_s)
    )


def _status_message(experiment: Experiment) -> dict:
    return {
        "kind": "status",
        "status": experiment.status,
        "reason": experiment.status_reason,
        "current_step": experiment.current_step,
        "total_steps": experiment.total_steps,
    }


@transaction.atomic
def experiment_create(
    *, owner, name: str, config: dict[str, Any], team=None, parent: Experiment | None = None
) -> Experiment:
    """Validate the typed config, store the experiment and enqueue its monitor (which starts the driver).

    With a `team` (one of the owner's), its members may view the experiment, its plots, rollouts and
    checkpoints; only the owner may pause, resume, cancel or evaluate it.
    """
    if team is not None and not owner.teams.filter(pk=team.pk).exists():
        raise ValidationError({"team": f"you are not a member of the team '{team.name}'"})
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "give the experiment a name"})
    placeholder_dir = str(_experiments_root() / "pending")
    values = experiment_config_check(config, run_dir=placeholder_dir, owner=owner)
    experiment = Experiment.objects.create(
        owner=owner, team=team, name=name[:200], config=values, parent=parent
    )
    # The random suffix keeps a re-created database from reusing an old run's checkpoints.
    experiment.run_dir = str(_experiments_root() / f"experiment-{experiment.pk}-{uuid.uuid4().hex[:8]}")
    experiment.save(update_fields=["run_dir"])
    _enqueue_monitor(experiment.pk)
    return experiment


def experiment_clone(
    *, experiment: Experiment, owner, name: str = "", changes: dict[str, Any] | None = None, team=None
) -> Experiment:
    """A new experiment with the source's config updated by `changes`; it starts from scratch.

    The clone belongs to `owner` and is shared with `team` (None: private), whoever owned the source.
    """
    config = {**experiment.config, **(changes or {})}
    return experiment_create(
        owner=owner,
        team=team,
        name=name or f"{experiment.name} (clone)",
        config=config,
        parent=experiment,
    )


@transaction.atomic
def experiment_pause(*, experiment: Experiment) -> Experiment:
    experiment = Experiment.objects.select_for_update().get(pk=experiment.pk)
    if experiment.status not in Experiment.ACTIVE:
        raise ValidationError(
            f"only a queued or running experiment can be paused; this one is {experiment.status}", code=CONFLICT
        )
    experiment.pause_requested = True
    experiment.save(update_fields=["pause_requested"])
    _publish(experiment, {"kind": "notice", "text": "pause requested"})
    return experiment


@transaction.atomic
def experiment_resume(*, experiment: Experiment) -> Experiment:
    experiment = Experiment.objects.select_for_update().get(pk=experiment.pk)
    if experiment.status not in (Experiment.Status.PAUSED, Experiment.Status.FAILED):
        raise ValidationError(
            f"only a paused or failed experiment can be resumed; this one is {experiment.status}", code=CONFLICT
        )
    experiment.status = Experiment.Status.QUEUED
    experiment.status_reason = "resume requested"
    experiment.pause_requested = False
    experiment.save(update_fields=["status", "status_reason", "pause_requested"])
    _publish(experiment, _status_message(experiment))
    _enqueue_monitor(experiment.pk)
    return experiment


@transaction.atomic
def experiment_cancel(*, experiment: Experiment) -> Experiment:
    experiment = Experiment.objects.select_for_update().get(pk=experiment.pk)
    if experiment.status in (Experiment.Status.CANCELLED, Experiment.Status.FINISHED):
        raise ValidationError(f"the experiment is already {experiment.status}", code=CONFLICT)
    experiment.cancel_requested = True
    fields = ["cancel_requested"]
    if experiment.status != Experiment.Status.RUNNING:
        # No driver to stop; a monitor that starts later sees the status and does nothing.
        experiment.status = Experiment.Status.CANCELLED
        experiment.status_reason = "cancelled"
        experiment.finished_at = timezone.now()
        fields += ["status", "status_reason", "finished_at"]
    experiment.save(update_fields=fields)
    _publish(experiment, _status_message(experiment))
    return experiment


# --- ingestion of the driver's checkpointed logs ---------------------------------------------------


def _rollout_trace_create(*, experiment: Experiment, row: dict, trace: dict):
    from webapp.agents.services import rollout_record

    if "status" not in trace:
        return None
    result = SimpleNamespace(
        status=trace["status"],
        reason=trace.get("reason", ""),
        final_message=trace.get("final_message", ""),
        diff=trace.get("diff", ""),
        messages=trace.get("messages", []),
        turns=trace.get("turns", 0),
        prompt_tokens=trace.get("prompt_tokens", 0),
        completion_tokens=trace.get("completion_tokens", 0),
        duration_s=trace.get("duration_s", 0.0),
        events=trace.get("events", []),
    )
    return rollout_record(
        owner=experiment.owner,
        team=experiment.team,
        result=result,
        prompt=trace.get("prompt", ""),
        experiment_name=experiment.name,
        repo_label=row["task_id"],
        model_name=f"experiment-{experiment.pk}",
        training_step=row["step"],
        reward=row["reward"] if row["valid"] else None,
        advantage=row["advantage"],
    )


def _ingest_read(run_dir: Path, *, recorded: set[int]) -> tuple[list[dict], list[tuple[dict, dict]], list[Path]]:
    """What the run directory holds beyond ``recorded`` steps: (new step rows, their rollout rows
    with traces, checkpoint paths). Files only: no database, no transaction."""
    from training.rollout.run_dir import (
        METRICS_FILE,
        ROLLOUTS_FILE,
        checkpointed_version,
        read_jsonl,
        trace_path,
    )
    from training.train.state import list_checkpoints

    version = checkpointed_version(run_dir)
    new_steps = [row for row in read_jsonl(run_dir / METRICS_FILE) if row["step"] <= version and row["step"] not in recorded]
    numbers = {row["step"] for row in new_steps}
    rollouts = []
    for row in read_jsonl(run_dir / ROLLOUTS_FILE) if new_steps else []:
        if row["step"] in numbers:
            path = trace_path(run_dir, row["rollout_id"])
            rollouts.append((row, json.loads(path.read_text()) if path.exists() else {}))
    return new_steps, rollouts, list_checkpoints(run_dir)


def experiment_ingest(*, experiment: Experiment) -> int:
    """Copy checkpointed steps, rollouts and checkpoints from the run directory; returns new steps.

    The files are read outside any transaction (on SQLite a write transaction holds the one write
    lock, and the monitor calls this every second); the short write transaction then re-checks
    which steps are recorded under the row lock, so two monitors never record a step twice.
    """
    run_dir = Path(experiment.run_dir)
    recorded = set(ExperimentStep.objects.filter(experiment_id=experiment.pk).values_list("step", flat=True))
    new_steps, rollouts, checkpoints = _ingest_read(run_dir, recorded=recorded)
    known = set(ExperimentCheckpoint.objects.filter(experiment_id=experiment.pk).values_list("step", flat=True))
    if not new_steps and all(int(path.name.rsplit("-", 1)[-1]) in known for path in checkpoints):
        return 0
    with transaction.atomic():
        experiment = Experiment.objects.select_for_update().get(pk=experiment.pk)
        recorded = set(ExperimentStep.objects.filter(experiment=experiment).values_list("step", flat=True))
        new_steps = [row for row in new_steps if row["step"] not in recorded]
        new_step_numbers = {row["step"] for row in new_steps}
        for row in new_steps:
            ExperimentStep.objects.create(experiment=experiment, step=row["step"], metrics=row)
        for row, trace in rollouts:
            if row["step"] in new_step_numbers:
                _rollout_row_create(experiment=experiment, row=row, trace=trace)
        for path in checkpoints:
            step = int(path.name.rsplit("-", 1)[-1])
            ExperimentCheckpoint.objects.get_or_create(experiment=experiment, step=step, defaults={"path": str(path)})
        if new_steps:
            experiment.current_step = max(experiment.current_step, max(new_step_numbers))
            experiment.heartbeat_at = timezone.now()
            experiment.save(update_fields=["current_step", "heartbeat_at"])
            _publish(experiment, {"kind": "steps", "steps": sorted(new_steps, key=lambda row: row["step"])})
            _publish(experiment, _status_message(experiment))
    return len(new_steps)


def _rollout_row_create(*, experiment: Experiment, row: dict, trace: dict) -> ExperimentRollout:
    return ExperimentRollout.objects.create(
        experiment=experiment,
        step=row["step"],
        rollout_id=row["rollout_id"],
        group_id=row["group_id"],
        task_id=row["task_id"],
        sample_index=row["sample_index"],
        valid=row["valid"],
        reward=row["reward"],
        advantage=row["advantage"],
        passed=row["passed"],
        completion_tokens=row["completion_tokens"],
        turns=row["turns"],
        tool_calls=row["tool_calls"],
        tools_used=row["tools_used"],
        policy_version=row["policy_version"],
        staleness=row["staleness"],
        abandoned=row.get("abandoned", False),
        status=row["status"][:2000],
        trace=_rollout_trace_create(experiment=experiment, row=row, trace=trace),
    )


# --- the driver process ------------------------------------------------------------------------


def _driver_alive(pid: int | None, run_dir: str) -> bool:
    """True if `pid` is a live driver process of this run directory (pids get reused)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            command = handle.read().split(b"\0")
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return (
        state != "Z"
        and b"training.rollout.driver" in command
        and any(
            part.decode(errors="replace") == str(Path(run_dir) / "driver_config.json") for part in command
        )
    )


def _driver_launch(experiment: Experiment) -> subprocess.Popen:
    run_dir = Path(experiment.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "driver_config.json"
    config = {
        **experiment.config,
        "run_dir": str(run_dir),
        "sandbox_backend": settings.SANDBOX_BACKEND,
        "ray_address": settings.RAY_ADDRESS,
    }
    config_path.write_text(json.dumps(config))
    log = open(run_dir / "driver.log", "ab")  # noqa: SIM115  (handed to the child, closed below)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "training.rollout.driver", "--config", str(config_path)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        )
    finally:
        log.close()


def _log_tail(run_dir: str, lines: int = 15) -> str:
    path = Path(run_dir) / "driver.log"
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _set_status(experiment_id: int, **fields) -> Experiment:
    with transaction.atomic():
        experiment = Experiment.objects.select_for_update().get(pk=experiment_id)
        for key, value in fields.items():
            setattr(experiment, key, value)
        experiment.save(update_fields=list(fields))
        _publish(experiment, _status_message(experiment))
    return experiment


def _driver_launch_claim(experiment: Experiment, *, watched_pid: int | None) -> bool:
    """Count the next driver start if no other monitor counted one since ``experiment`` was read and
    the driver this monitor saw die (``watched_pid``) is still the recorded one: one conditional
    UPDATE, so of two monitors that saw the driver die only one starts a new one."""
    from django.db.models import F

    return bool(Experiment.objects.filter(
        pk=experiment.pk, launches=experiment.launches, status__in=Experiment.ACTIVE,
        driver_pid=watched_pid or experiment.driver_pid,
        cancel_requested=False, pause_requested=False,
    ).update(launches=F("launches") + 1, driver_pid=None))


def _wait_for_exit(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            finished, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            finished = pid if not Path(f"/proc/{pid}").exists() else 0
        if finished == pid or not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.2)
    return False


def experiment_monitor(*, experiment_id: int, slice_s: float = MONITOR_SLICE_S) -> str:
    """Start (or re-attach to) the experiment's driver and watch it until it ends or the slice is over."""
    from training.rollout.run_dir import checkpointed_version, run_finished

    experiment = Experiment.objects.get(pk=experiment_id)
    if experiment.status not in Experiment.ACTIVE:
        return f"experiment {experiment_id} is {experiment.status}; nothing to do"
    started = time.monotonic()
    launches_without_progress = 0
    progress_at_launch = checkpointed_version(experiment.run_dir)
    process: subprocess.Popen | None = None
    pid = experiment.driver_pid if _driver_alive(experiment.driver_pid, experiment.run_dir) else None
    watched_pid = pid
    while True:
        experiment.refresh_from_db()
        if pid is None:
            if experiment.cancel_requested or experiment.pause_requested:
                state = (
                    Experiment.Status.CANCELLED if experiment.cancel_requested else Experiment.Status.PAUSED
                )
                _set_status(
                    experiment_id,
                    status=state,
                    status_reason=f"{state} before the driver started",
                    driver_pid=None,
                )
                return state
            all_steps_done = checkpointed_version(experiment.run_dir) >= experiment.total_steps
            # A driver with a time budget finishes short of its steps; relaunching it would train nothing.
            if all_steps_done or run_finished(experiment.run_dir):
                experiment_ingest(experiment=experiment)
                _set_status(
                    experiment_id,
                    status=Experiment.Status.FINISHED,
                    status_reason="all steps done" if all_steps_done else "time budget spent",
                    finished_at=timezone.now(),
                    driver_pid=None,
                )
                return "finished"
            if launches_without_progress >= MAX_LAUNCHES_WITHOUT_PROGRESS:
                reason = f"the driver stopped {launches_without_progress} times without progress:\n{_log_tail(experiment.run_dir)}"
                _set_status(
                    experiment_id, status=Experiment.Status.FAILED, status_reason=reason, driver_pid=None
                )
                return "failed"
            if not _driver_launch_claim(experiment, watched_pid=watched_pid):
                # Another monitor (a redelivered or re-sent message) saw the same dead driver first
                # and starts its successor; this one leaves, so a killed driver is resumed once.
                return "another monitor restarts the driver"
            process = _driver_launch(experiment)
            pid = watched_pid = process.pid
            launches_without_progress += 1
            progress_at_launch = checkpointed_version(experiment.run_dir)
            _set_status(
                experiment_id,
                status=Experiment.Status.RUNNING,
                status_reason="driver running",
                driver_pid=pid,
                started_at=experiment.started_at or timezone.now(),
            )
        experiment_ingest(experiment=experiment)
        if checkpointed_version(experiment.run_dir) > progress_at_launch:
            launches_without_progress = 0
        if experiment.cancel_requested or experiment.pause_requested:
            os.kill(pid, signal.SIGTERM)
            if not _wait_for_exit(pid, timeout_s=120):
                os.killpg(pid, signal.SIGKILL)
                _wait_for_exit(pid, timeout_s=10)
            experiment_ingest(experiment=experiment)
            state = Experiment.Status.CANCELLED if experiment.cancel_requested else Experiment.Status.PAUSED
            _set_status(
                experiment_id,
                status=state,
                status_reason=f"{state} by request",
                driver_pid=None,
                pause_requested=False,
            )
            return state
        exited = (
            process.poll() is not None if process is not None else not _driver_alive(pid, experiment.run_dir)
        )
        if exited:
            # A driver that died (killed, crashed) is started again: it resumes from its checkpoint.
            pid, process = None, None
            continue
        if time.monotonic() - started > slice_s:
            # Hand over to a fresh monitor task; the driver keeps running and is re-attached by pid.
            _enqueue_monitor_now(experiment_id)
            return "handed over"
        time.sleep(MONITOR_POLL_S)


def _enqueue_monitor_now(experiment_id: int) -> None:
    from webapp.experiments.tasks import experiment_monitor_task

    experiment_monitor_task.delay(experiment_id)


# --- benchmarks ------------------------------------------------------------------------------------


def _bench_config(*, suite: str, policy: str, attempts: int, options: dict | None = None):
    from training.bench.runner import BenchConfig, BenchConfigError

    options = dict(options or {})
    options["exclude_tools"] = tuple(options.get("exclude_tools") or ())
    options["disable_tools"] = tuple(options.get("disable_tools") or ())
    try:
        config = BenchConfig(
            suite=suite,
            policy=policy,
            attempts=attempts,
            sandbox_backend=settings.SANDBOX_BACKEND,
            **options,
        )
        config.check_tools()
        return config
    except (BenchConfigError, TypeError) as error:
        raise ValidationError(str(error)) from error


@transaction.atomic
def benchmark_run_create(
    *,
    owner,
    suite: str,
    policy: str,
    attempts: int = 1,
    checkpoint: ExperimentCheckpoint | None = None,
    team=None,
    options: dict | None = None,
    enqueue: bool = True,
) -> BenchmarkRun:
    """Store a queued benchmark run (validated) and, by default, enqueue its Celery task.

    `options` are further BenchConfig fields (turn limits, temperature, exclude_tools, disable_tools); they are
    stored with the run so the Celery task evaluates exactly what was asked.
    """
    options = dict(options or {})
    config = _bench_config(suite=suite, policy=policy, attempts=attempts, options=options)
    label = policy
    if checkpoint is not None:
        label = f"{checkpoint.experiment.name} @ step {checkpoint.step}"
    elif config.policy_kind == "openai":
        label = policy.split(":", 1)[1]
    if config.exclude_tools:
        label += f" (without {', '.join(config.exclude_tools)})"
    if config.disable_tools:
        label += f" ({', '.join(config.disable_tools)} disabled)"
    run = BenchmarkRun.objects.create(
        owner=owner,
        team=team,
        suite=suite,
        policy_kind=config.policy_kind,
        policy_label=label[:300],
        base_url=policy.rsplit("@", 1)[1] if config.policy_kind == "openai" else "",
        checkpoint=checkpoint,
        attempts=attempts,
    )
    run.summary = {
        "policy": policy,
        "options": {
            **options,
            "exclude_tools": list(config.exclude_tools),
            "disable_tools": list(config.disable_tools),
        },
    }
    run.save(update_fields=["summary"])
    if enqueue:
        from webapp.experiments.tasks import benchmark_run_task

        transaction.on_commit(lambda: benchmark_run_task.delay(run.pk))
    return run


def benchmark_run_execute(*, run_id: int, options: dict | None = None) -> BenchmarkRun:
    """Run the benchmark of a stored run and store per-task rows and the summary."""
    from training.bench.runner import run_benchmark

    run = BenchmarkRun.objects.get(pk=run_id)
    if run.status == BenchmarkRun.Status.FINISHED:
        return run
    stored = dict(run.summary.get("options") or {})
    config = _bench_config(
        suite=run.suite,
        policy=run.summary["policy"],
        attempts=run.attempts,
        options={**stored, **(options or {})},
    )
    BenchmarkRun.objects.filter(pk=run.pk).update(status=BenchmarkRun.Status.RUNNING)
    try:
        summary = run_benchmark(config=config)
    except Exception as error:
        BenchmarkRun.objects.filter(pk=run.pk).update(
            status=BenchmarkRun.Status.FAILED,
            status_reason=f"{type(error).__name__}: {error}",
            finished_at=timezone.now(),
        )
        raise
    with transaction.atomic():
        run = BenchmarkRun.objects.select_for_update().get(pk=run.pk)
        BenchmarkTaskResult.objects.filter(run=run).delete()
        BenchmarkTaskResult.objects.bulk_create(
            [BenchmarkTaskResult(run=run, **row) for row in summary.pop("per_task")]
        )
        run.summary = {**summary, "policy": run.summary["policy"], "options": run.summary.get("options", {})}
        run.status = BenchmarkRun.Status.FINISHED
        run.finished_at = timezone.now()
        run.save(update_fields=["summary", "status", "finished_at"])
    return run


# --- repository recipes ------------------------------------------------------------------------------


def repository_recipe_detect(*, repository) -> RepositoryRecipe:
    """Detect, install and verify a registered repository in a sandbox, and store the outcome."""
    from sandboxes import get_backend
    from sandboxes.base import RepoSource
    from training.tasks.autoinstall import InstallRecipe, repository_auto_install

    source = RepoSource(kind=repository.kind, location=repository.location, ref=repository.ref or None)
    outcome = repository_auto_install(backend=get_backend(settings.SANDBOX_BACKEND), source=source)
    ready = isinstance(outcome, InstallRecipe)
    recipe, _ = RepositoryRecipe.objects.update_or_create(
        repository=repository,
        defaults={
            "status": RepositoryRecipe.Status.READY if ready else RepositoryRecipe.Status.FAILED,
            "recipe": outcome.as_dict() if ready else {},
            "failure": {} if ready else outcome.as_dict(),
        },
    )
    return recipe
