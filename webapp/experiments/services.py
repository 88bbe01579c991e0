"""Writes of the experiments app: launch/pause/resume/cancel/clone, ingestion of the driver's logs, benchmarks.

The RL driver (training.rollout.driver) runs as its own process. Celery only launches and monitors
it (``webapp.experiments.monitor.experiment_monitor``; the process itself: ``driver_process``): it
restarts a driver that died (the driver resumes from its checkpoint), turns pause/cancel requests
into SIGTERM, and copies the driver's checkpointed logs into the database (``experiment_ingest``).
Only steps covered by a checkpoint are ingested, and rows are unique per (experiment, step) and
(experiment, rollout id), so a restart never records a rollout twice.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from webapp.core.validation import CONFLICT
from webapp.experiments.events import experiment_publish, experiment_status_message
from webapp.experiments.models import (
    BenchmarkRun,
    BenchmarkTaskResult,
    Experiment,
    ExperimentCheckpoint,
    ExperimentRollout,
    ExperimentStep,
    RepositoryRecipe,
)
from webapp.experiments.validation import experiment_config_check

logger = logging.getLogger(__name__)



def _experiments_root() -> Path:
    return Path(settings.STATE_DIR) / "experiments"


def _enqueue_monitor(experiment_id: int) -> None:
    from webapp.experiments.tasks import experiment_monitor_task

    transaction.on_commit(lambda: experiment_monitor_task.delay(experiment_id))


_publish = experiment_publish
_status_message = experiment_status_message


def __getattr__(name: str):
    # The monitor moved to webapp.experiments.monitor, which imports this module; its names stay
    # reachable here (services.experiment_monitor) without an import cycle.
    if name in ("experiment_monitor", "MONITOR_POLL_S", "MONITOR_SLICE_S", "MAX_LAUNCHES_WITHOUT_PROGRESS"):
        from webapp.experiments import monitor

        return getattr(monitor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    if values.get("task_set") is not None:
        from webapp.mining.services import task_set_pool_write

        task_set_pool_write(task_set_id=values["task_set"], run_dir=experiment.run_dir)
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


EXPERIMENT_ACTION_STATES = {
    "pause": (Experiment.Status.QUEUED, Experiment.Status.RUNNING),
    "resume": (Experiment.Status.PAUSED, Experiment.Status.FAILED),
    "cancel": (Experiment.Status.QUEUED, Experiment.Status.RUNNING, Experiment.Status.PAUSED, Experiment.Status.FAILED),
}
"""The statuses in which each control is accepted; the detail page offers a control only in these."""


@transaction.atomic
def experiment_pause(*, experiment: Experiment) -> Experiment:
    experiment = Experiment.objects.select_for_update().get(pk=experiment.pk)
    if experiment.status not in EXPERIMENT_ACTION_STATES["pause"]:
        raise ValidationError(
            f"only a queued or running experiment can be paused; this one is {experiment.status}", code=CONFLICT
        )
    if experiment.pause_requested and experiment.status == Experiment.Status.RUNNING:
        raise ValidationError("a pause is already requested; the driver stops at its next step", code=CONFLICT)
    experiment.pause_requested = True
    experiment.save(update_fields=["pause_requested"])
    _publish(experiment, {"kind": "notice", "text": "pause requested"})
    return experiment


@transaction.atomic
def experiment_resume(*, experiment: Experiment) -> Experiment:
    experiment = Experiment.objects.select_for_update().get(pk=experiment.pk)
    if experiment.status not in EXPERIMENT_ACTION_STATES["resume"]:
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
    if experiment.status not in EXPERIMENT_ACTION_STATES["cancel"]:
        raise ValidationError(f"the experiment is already {experiment.status}", code=CONFLICT)
    if experiment.cancel_requested and experiment.status == Experiment.Status.RUNNING:
        raise ValidationError("cancellation is already requested; the driver stops at its next step", code=CONFLICT)
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


RECORD_MAX_STEPS = 20_000
"""Most step rows one recorded run may bring (a 60-minute SFT recipe logs ~3,000)."""
RECORD_MAX_CONFIG_CHARS = 20_000
"""Longest JSON of a recorded run's config."""


def _recorded_value_check(where: str, value: Any) -> None:
    """JSON scalars (finite numbers, short strings), lists and dicts of them; anything else is refused."""
    import math

    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or len(key) > 200:
                raise ValidationError({"steps": f"{where}: keys are strings of at most 200 characters"})
            _recorded_value_check(f"{where}.{key}", item)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _recorded_value_check(f"{where}[{index}]", item)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValidationError({"steps": f"{where} is {value}: recorded metrics must be finite numbers"})
    elif isinstance(value, str) and len(value) > 2000:
        raise ValidationError({"steps": f"{where}: strings of at most 2000 characters"})
    elif value is not None and not isinstance(value, bool | int | float | str | dict | list):
        raise ValidationError({"steps": f"{where}: {type(value).__name__} is not a JSON value"})


@transaction.atomic
def experiment_record(
    *, owner, name: str, config: dict[str, Any], steps: list[dict[str, Any]], team=None, run_dir: str = "",
    checkpoints: Sequence[tuple[int, str]] = (), status_reason: str = "",
) -> Experiment:
    """Store a run that already happened outside the driver (a benchmark recipe, e.g. SFT at equal compute in
    benchmarks/bench_rl_vs_sft.py) as a finished experiment with its step rows, so the dashboard and the
    comparison view plot it beside launched ones. No monitor is enqueued and nothing is launched; the config
    is stored as given (it need not be an AsyncRLConfig), so such an experiment is compared, not cloned."""
    if team is not None and not owner.teams.filter(pk=team.pk).exists():
        raise ValidationError({"team": f"you are not a member of the team '{team.name}'"})
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "give the experiment a name"})
    if not isinstance(config, dict) or len(json.dumps(config, default=str)) > RECORD_MAX_CONFIG_CHARS:
        raise ValidationError({"config": f"a JSON object of at most {RECORD_MAX_CONFIG_CHARS} characters"})
    _recorded_value_check("config", config)
    if not isinstance(steps, list) or len(steps) > RECORD_MAX_STEPS:
        raise ValidationError({"steps": f"a list of at most {RECORD_MAX_STEPS} step rows"})
    numbers = set()
    for row in steps:
        step = row.get("step") if isinstance(row, dict) else None
        if type(step) is not int or step < 1 or step in numbers:
            raise ValidationError({"steps": f"every row needs a distinct integer step >= 1, got {step!r}"})
        numbers.add(step)
        _recorded_value_check(f"step {step}", row)
    now = timezone.now()
    experiment = Experiment.objects.create(
        owner=owner, team=team, name=name[:200], config=config, status=Experiment.Status.FINISHED,
        status_reason=status_reason[:2000], run_dir=run_dir[:500], current_step=max(numbers, default=0),
        started_at=now, finished_at=now,
    )
    ExperimentStep.objects.bulk_create(
        ExperimentStep(experiment=experiment, step=row["step"], metrics=row) for row in steps
    )
    for step, path in checkpoints:
        ExperimentCheckpoint.objects.create(experiment=experiment, step=int(step), path=str(path)[:500])
    return experiment


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


def _suite_task_set(*, suite: str, user, load: bool = False):
    """For a mined task set's suite: check the user may see the ready set, and (``load``) its tasks of that
    split; None for the toy suites."""
    from training.bench.runner import TASKSET_SUITE
    from webapp.mining.selectors import task_set_ready_get
    from webapp.mining.services import task_set_tasks

    match = TASKSET_SUITE.match(suite)
    if match is None:
        return None
    task_set = task_set_ready_get(user=user, pk=int(match.group("id")))
    if task_set is None:
        raise ValidationError({"suite": f"no ready task set {match.group('id')} is visible to you"})
    if not load:
        return None
    tasks = task_set_tasks(task_set=task_set, split=match.group("split"))
    if not tasks:
        raise ValidationError({"suite": f"task set {task_set.pk} has no {match.group('split')} tasks"})
    return tasks


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
    _suite_task_set(suite=suite, user=owner)
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
        summary = run_benchmark(config=config, tasks=_suite_task_set(suite=run.suite, user=run.owner, load=True))
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
    """Detect, install and verify a registered repository in a sandbox, and store the outcome (and its
    log and baseline): the mining app's environment setup, run here and now."""
    from webapp.mining.services import repository_setup_run

    return repository_setup_run(repository=repository)
