"""The Celery side of an RL experiment: start its driver, watch it, restart it, stop it on request.

Celery only launches and monitors the driver (``training.rollout.driver``, its own process:
``webapp.experiments.driver_process``). ``experiment_monitor`` restarts a driver that died (the
driver resumes from its checkpoint), turns pause/cancel requests into SIGTERM, and copies the
driver's checkpointed logs into the database (``experiment_ingest``). A monitor task hands over to a
fresh one after ``MONITOR_SLICE_S``, which re-attaches to the running driver by pid.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from webapp.experiments.driver_process import driver_alive, driver_log_tail, driver_start, driver_stop
from webapp.experiments.events import experiment_publish, experiment_status_message
from webapp.experiments.models import Experiment
from webapp.experiments.services import experiment_ingest

MONITOR_POLL_S = 1.0
MONITOR_SLICE_S = 600.0
"""A monitor task hands over to a fresh one after this long, staying far below Celery's time limit."""
MAX_LAUNCHES_WITHOUT_PROGRESS = 3


@dataclass
class _Watch:
    """What one monitor task knows about the driver it watches."""

    started: float
    """When this monitor task began (monotonic clock), for the hand-over after its slice."""
    progress_at_launch: int
    """Checkpointed version when the current driver was started."""
    pid: int | None = None
    """The live driver's pid; None while none runs."""
    watched_pid: int | None = None
    """The driver this monitor saw last, whose death entitles it to start the next one."""
    process: subprocess.Popen | None = None
    """The driver, when this monitor started it (a re-attached one is watched by pid)."""
    launches_without_progress: int = 0
    """Drivers started since the last new checkpoint."""


def _driver_launch(experiment: Experiment) -> subprocess.Popen:
    config = {
        **experiment.config,
        "run_dir": str(Path(experiment.run_dir)),
        "sandbox_backend": settings.SANDBOX_BACKEND,
        "ray_address": settings.RAY_ADDRESS,
    }
    return driver_start(run_dir=Path(experiment.run_dir), config=config)


def _set_status(experiment_id: int, **fields) -> Experiment:
    with transaction.atomic():
        experiment = Experiment.objects.select_for_update().get(pk=experiment_id)
        for key, value in fields.items():
            setattr(experiment, key, value)
        experiment.save(update_fields=list(fields))
        experiment_publish(experiment, experiment_status_message(experiment))
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


def _enqueue_monitor_now(experiment_id: int) -> None:
    from webapp.experiments.tasks import experiment_monitor_task

    experiment_monitor_task.delay(experiment_id)


def _no_driver(experiment: Experiment, watch: _Watch) -> str | None:
    """No driver runs: end the experiment (requested, done, hopeless) and say how, or start one (None)."""
    from training.rollout.run_dir import checkpointed_version, run_finished

    experiment_id = experiment.pk
    if experiment.cancel_requested or experiment.pause_requested:
        state = Experiment.Status.CANCELLED if experiment.cancel_requested else Experiment.Status.PAUSED
        _set_status(experiment_id, status=state, status_reason=f"{state} before the driver started", driver_pid=None)
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
    if watch.launches_without_progress >= MAX_LAUNCHES_WITHOUT_PROGRESS:
        reason = (f"the driver stopped {watch.launches_without_progress} times without progress:\n"
                  f"{driver_log_tail(experiment.run_dir)}")
        _set_status(experiment_id, status=Experiment.Status.FAILED, status_reason=reason, driver_pid=None)
        return "failed"
    if not _driver_launch_claim(experiment, watched_pid=watch.watched_pid):
        # Another monitor (a redelivered or re-sent message) saw the same dead driver first
        # and starts its successor; this one leaves, so a killed driver is resumed once.
        return "another monitor restarts the driver"
    watch.process = _driver_launch(experiment)
    watch.pid = watch.watched_pid = watch.process.pid
    watch.launches_without_progress += 1
    watch.progress_at_launch = checkpointed_version(experiment.run_dir)
    _set_status(
        experiment_id,
        status=Experiment.Status.RUNNING,
        status_reason="driver running",
        driver_pid=watch.pid,
        started_at=experiment.started_at or timezone.now(),
    )
    return None


def _driver_running(experiment: Experiment, watch: _Watch, *, slice_s: float) -> str | None:
    """A driver runs: ingest, stop it on request, notice its death; the outcome, or None to go on."""
    from training.rollout.run_dir import checkpointed_version

    assert watch.pid is not None  # the loop calls this only while a driver runs (found alive or just launched)
    experiment_ingest(experiment=experiment)
    if checkpointed_version(experiment.run_dir) > watch.progress_at_launch:
        watch.launches_without_progress = 0
    if experiment.cancel_requested or experiment.pause_requested:
        driver_stop(watch.pid)
        experiment_ingest(experiment=experiment)
        state = Experiment.Status.CANCELLED if experiment.cancel_requested else Experiment.Status.PAUSED
        _set_status(experiment.pk, status=state, status_reason=f"{state} by request", driver_pid=None,
                    pause_requested=False)
        return state
    if watch.process is not None:
        exited = watch.process.poll() is not None
    else:
        exited = not driver_alive(watch.pid, experiment.run_dir)
    if exited:
        # A driver that died (killed, crashed) is started again: it resumes from its checkpoint.
        watch.pid, watch.process = None, None
        return None
    if time.monotonic() - watch.started > slice_s:
        # Hand over to a fresh monitor task; the driver keeps running and is re-attached by pid.
        _enqueue_monitor_now(experiment.pk)
        return "handed over"
    time.sleep(MONITOR_POLL_S)
    return None


def experiment_monitor(*, experiment_id: int, slice_s: float = MONITOR_SLICE_S) -> str:
    """Start (or re-attach to) the experiment's driver and watch it until it ends or the slice is over."""
    from training.rollout.run_dir import checkpointed_version

    experiment = Experiment.objects.get(pk=experiment_id)
    if experiment.status not in Experiment.ACTIVE:
        return f"experiment {experiment_id} is {experiment.status}; nothing to do"
    watch = _Watch(started=time.monotonic(), progress_at_launch=checkpointed_version(experiment.run_dir))
    watch.pid = experiment.driver_pid if driver_alive(experiment.driver_pid, experiment.run_dir) else None
    watch.watched_pid = watch.pid
    while True:
        experiment.refresh_from_db()
        if watch.pid is None and (outcome := _no_driver(experiment, watch)) is not None:
            return outcome
        if (outcome := _driver_running(experiment, watch, slice_s=slice_s)) is not None:
            return outcome
