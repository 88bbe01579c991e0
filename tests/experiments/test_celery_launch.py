"""Celery launches and monitors: a real worker runs the monitor, pause stops the driver, resume continues."""

from __future__ import annotations

import time

import pytest

from training.checkpoint import create_random_checkpoint
from training.rollout.driver import checkpointed_version
from webapp.experiments import services
from webapp.experiments.models import BenchmarkRun, Experiment, ExperimentRollout

pytestmark = pytest.mark.django_db(transaction=True)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_pause_and_resume_through_a_real_celery_worker(owner, celery_worker_process, settings, tmp_path):
    settings.STATE_DIR = tmp_path
    checkpoint = str(create_random_checkpoint(tmp_path / "policy", "tiny", seed=0, max_seq_len=4096))
    settings.MODEL_CHECKPOINT = checkpoint  # a launch names a registered checkpoint, never a typed path
    config = {
        "init_checkpoint": checkpoint,
        # Enough steps that the pause, sent after the first checkpoint, lands before the end even when
        # rollouts are quick (8-token turns on a random model take well under a second).
        "steps": 12,
        "tasks": 2,
        "group_size": 2,
        "groups_per_step": 1,
        "max_staleness": 1,
        "rollout_workers": 2,
        "max_turns": 1,
        "max_tokens_per_turn": 8,
        "ray_num_cpus": 1,
    }
    experiment = services.experiment_create(owner=owner, name="celery", config=config)
    _wait(lambda: checkpointed_version(experiment.run_dir) >= 1, 240, "the first checkpoint")
    services.experiment_pause(experiment=Experiment.objects.get(pk=experiment.pk))
    _wait(lambda: Experiment.objects.get(pk=experiment.pk).status == "paused", 180, "the pause")
    paused_at = checkpointed_version(experiment.run_dir)
    assert paused_at < 12, "the run finished before the pause landed"

    services.experiment_resume(experiment=Experiment.objects.get(pk=experiment.pk))
    _wait(lambda: Experiment.objects.get(pk=experiment.pk).status == "finished", 300, "the resumed run")
    experiment.refresh_from_db()
    assert experiment.launches == 2 and experiment.current_step == 12
    ids = list(ExperimentRollout.objects.filter(experiment=experiment).values_list("rollout_id", flat=True))
    assert len(ids) == len(set(ids)) == 24


def test_benchmark_run_through_a_real_celery_worker(owner, celery_worker_process):
    run = services.benchmark_run_create(owner=owner, suite="toy-heldout-1", policy="scripted")
    _wait(lambda: BenchmarkRun.objects.get(pk=run.pk).status == "finished", 120, "the benchmark run")
    assert BenchmarkRun.objects.get(pk=run.pk).summary["pass_at_1"] == 1.0
