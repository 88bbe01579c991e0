"""Reads of the experiments app: visibility-checked lookups, dashboard series, groups, leaderboard."""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path
from typing import Any

from django.db.models import QuerySet

from webapp.core.selectors import owned_get_for_change, owned_get_visible, owned_visible_to
from webapp.experiments.models import (
    BenchmarkRun,
    Experiment,
    ExperimentCheckpoint,
    ExperimentRollout,
    ExperimentStep,
)
from webapp.experiments.validation import SERVER_CONTROLLED_FIELDS

DASHBOARD_SERIES = (
    ("mean_reward", "Reward"),
    ("pass_rate", "Pass rate"),
    ("sampled_pass_rate", "Pass rate of every group's first rollouts (abandoned groups included)"),
    ("abandoned_groups", "Groups abandoned after their probe"),
    ("guided_groups", "Groups given the expert's solution (expert_guidance)"),
    ("mean_completion_tokens", "Episode length (tokens)"),
    ("tool_calls_per_turn", "Tool calls per turn"),
    ("parallel_call_share", "Share of turns with parallel calls"),
    ("staleness_mean", "Staleness (mean policy lag)"),
    ("entropy", "Policy entropy (nats per trained token)"),
    ("kl_to_reference", "KL to the starting policy (nats per trained token; with kl_coef > 0)"),
    ("rollouts_per_s", "Rollouts / s"),
    ("worker_utilization", "Worker utilisation"),
    ("heldout_pass_at_1", "Held-out pass@1 (recorded recipe runs: benchmarks/bench_rl_vs_sft.py)"),
    ("loss", "Loss (GRPO policy loss; next-token cross-entropy of recorded SFT recipes)"),
)
COMPARE_MAX_EXPERIMENTS = 8
"""Most experiments one comparison plots (each brings every step row of its run)."""


def experiment_group_name(*, experiment_id: int) -> str:
    return f"experiment-{experiment_id}"


def experiment_list(*, user) -> QuerySet[Experiment]:
    """The user's experiments and those shared with one of their teams, newest first."""
    return owned_visible_to(queryset=Experiment.objects.select_related("owner", "team"), user=user)


def experiment_get(*, user, pk) -> Experiment:
    return owned_get_visible(queryset=Experiment.objects.all(), user=user, pk=pk)


def experiment_get_for_change(*, user, pk) -> Experiment:
    return owned_get_for_change(queryset=Experiment.objects.all(), user=user, pk=pk)


def experiment_steps(*, experiment: Experiment, after_step: int = 0) -> list[dict]:
    rows = ExperimentStep.objects.filter(experiment=experiment, step__gt=after_step).order_by("step")
    return [{"step": row.step, **row.metrics} for row in rows]


def experiment_dashboard_series(*, experiment: Experiment) -> dict:
    """Per-metric [step, value] series plus stage timings, the shape the dashboard plots."""
    steps = experiment_steps(experiment=experiment)
    series: dict[str, Any] = {key: [[row["step"], row.get(key)] for row in steps] for key, _ in DASHBOARD_SERIES}
    stages = sorted({stage for row in steps for stage in (row.get("stage_seconds") or {})})
    series["stage_seconds"] = {
        stage: [[row["step"], (row.get("stage_seconds") or {}).get(stage)] for row in steps]
        for stage in stages
    }
    return series


def experiment_groups(*, experiment: Experiment, limit: int = 50) -> list[dict]:
    """Newest groups: task, step, mean reward, how many of the group passed, and whether the group was
    abandoned after its probe (logged, not trained on)."""
    groups: dict[str, dict] = {}
    for rollout in ExperimentRollout.objects.filter(experiment=experiment).order_by("-step", "group_id"):
        entry = groups.setdefault(
            rollout.group_id,
            {
                "group_id": rollout.group_id,
                "task_id": rollout.task_id,
                "step": rollout.step,
                "rewards": [],
                "passed": 0,
                "abandoned": rollout.abandoned,
            },
        )
        if rollout.reward is not None:
            entry["rewards"].append(rollout.reward)
        entry["passed"] += int(rollout.passed)
        if len(groups) > limit:
            break
    result = []
    for entry in list(groups.values())[:limit]:
        rewards = entry.pop("rewards")
        entry["mean_reward"] = sum(rewards) / len(rewards) if rewards else None
        result.append(entry)
    return result


def experiment_group_rollouts(*, experiment: Experiment, group_id: str) -> list[ExperimentRollout]:
    return list(
        ExperimentRollout.objects.filter(experiment=experiment, group_id=group_id)
        .select_related("trace")
        .order_by("sample_index")
    )


def benchmark_run_get(*, user, pk) -> BenchmarkRun:
    return owned_get_visible(queryset=BenchmarkRun.objects.all(), user=user, pk=pk)


def benchmark_leaderboard(*, user, suite: str | None = None) -> list[BenchmarkRun]:
    """Finished runs visible to the user, best pass@1 first (per suite when one is given)."""
    runs = owned_visible_to(
        queryset=BenchmarkRun.objects.filter(status=BenchmarkRun.Status.FINISHED), user=user
    )
    if suite:
        runs = runs.filter(suite=suite)
    return sorted(
        runs.select_related("checkpoint__experiment"),
        key=lambda run: (run.suite, -(run.summary.get("pass_at_1") or 0.0), run.created_at),
    )


def benchmark_suites(*, user) -> list[str]:
    runs = owned_visible_to(queryset=BenchmarkRun.objects.all(), user=user)
    return sorted(set(runs.values_list("suite", flat=True)))


@cache
def dataclass_field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (what the launch form shows as help); the
    driver's CLI reads the same through ``training.rollout.config.dataclass_field_docs``."""
    from training.rollout.config import dataclass_field_docs as field_docs

    return field_docs(cls)


def experiment_form_fields() -> list[dict]:
    """name, type, default and help of every AsyncRLConfig field a user may set."""
    from training.rollout.config import AsyncRLConfig

    docs = dataclass_field_docs(AsyncRLConfig)
    fields = []
    for item in dataclasses.fields(AsyncRLConfig):
        if item.name in SERVER_CONTROLLED_FIELDS:
            continue
        default = None if item.default is dataclasses.MISSING else item.default
        fields.append(
            {"name": item.name, "type": str(item.type), "default": default, "help": docs.get(item.name, "")}
        )
    return fields


def checkpoint_choices(*, user) -> dict[str, str]:
    """Checkpoints a launch may start from, {name: directory}: the configured model, the checkpoint
    directories shipped under ``models/``, and checkpoints of experiments the user can see
    (``experiment-<id>-step-<step>``). A launch names one of these; it never types a server path."""
    from django.conf import settings

    choices: dict[str, str] = {}
    if settings.MODEL_CHECKPOINT:
        choices["default"] = str(settings.MODEL_CHECKPOINT)
    models_dir = Path(settings.BASE_DIR) / "models"
    if models_dir.is_dir():
        for entry in sorted(models_dir.iterdir()):
            if entry.is_dir() and not entry.is_symlink() and (entry / "config.json").is_file():
                choices[f"models/{entry.name}"] = str(entry)
    visible = experiment_list(user=user).values_list("pk", flat=True) if user is not None else []
    for experiment_id, step, path in ExperimentCheckpoint.objects.filter(experiment_id__in=list(visible)).values_list(
            "experiment_id", "step", "path")[:500]:
        choices[f"experiment-{experiment_id}-step-{step}"] = path
    return choices


def compare_ids_check(raw: list[str]) -> list[int]:
    """The experiment ids of a comparison request: 2 to COMPARE_MAX_EXPERIMENTS distinct positive integers."""
    from django.core.exceptions import ValidationError

    ids: list[int] = []
    for text in raw:
        if not text.isdigit() or len(text) > 12 or int(text) < 1:
            raise ValidationError(f"experiment ids are positive integers, got {text[:20]!r}")
        if int(text) not in ids:
            ids.append(int(text))
    if not 2 <= len(ids) <= COMPARE_MAX_EXPERIMENTS:
        raise ValidationError(
            f"select 2 to {COMPARE_MAX_EXPERIMENTS} experiments to compare (got {len(ids)} distinct ids)"
        )
    return ids


def _flat_config(config: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _config_differences(experiments: list[Experiment]) -> list[dict]:
    """Config fields whose values are not the same in every experiment (a missing field differs)."""
    flats = [_flat_config(experiment.config if isinstance(experiment.config, dict) else {}) for experiment in experiments]
    missing = object()
    rows = []
    for key in sorted(set().union(*flats)):
        values = [flat.get(key, missing) for flat in flats]
        if any(value != values[0] for value in values[1:]):
            rows.append({"field": key, "values": ["—" if value is missing else value for value in values]})
    return rows


def _step_minutes(experiment: Experiment, rows: list[ExperimentStep]) -> list[float | None]:
    """Minutes of the run at each step: the run's own clock when its rows carry one (``minutes``, or the
    driver's ``training_seconds``), else when the step was recorded, from the experiment's start."""
    start = experiment.started_at or (rows[0].recorded_at if rows else None)
    minutes: list[float | None] = []
    for row in rows:
        metrics = row.metrics
        if isinstance(metrics.get("minutes"), int | float):
            minutes.append(float(metrics["minutes"]))
        elif isinstance(metrics.get("training_seconds"), int | float):
            minutes.append(float(metrics["training_seconds"]) / 60)
        else:
            minutes.append((row.recorded_at - start).total_seconds() / 60 if start else None)
    return minutes


def experiment_comparison(*, user, ids: list[int]) -> dict:
    """Two or more visible experiments on one plot: per experiment its [step, minutes, value] series of
    every dashboard metric it logged, and the config fields that differ, in id order. Any id the user may not see
    (someone else's, unshared, or absent) is a 404 for the whole comparison: which ids exist is not told."""
    from django.http import Http404

    found = {experiment.pk: experiment for experiment in experiment_list(user=user).filter(pk__in=ids)}
    if len(found) != len(ids):
        raise Http404
    experiments = [found[pk] for pk in sorted(ids)]  # oldest first, however the form ordered them
    runs, plotted = [], set()
    for experiment in experiments:
        rows = list(ExperimentStep.objects.filter(experiment=experiment).order_by("step"))
        minutes = _step_minutes(experiment, rows)
        series = {}
        for key, _ in DASHBOARD_SERIES:
            points = [
                [row.step, minute, row.metrics[key]]
                for row, minute in zip(rows, minutes, strict=True)
                if isinstance(row.metrics.get(key), int | float) and not isinstance(row.metrics.get(key), bool)
            ]
            if points:
                series[key] = points
                plotted.add(key)
        runs.append({"id": experiment.pk, "name": experiment.name, "owner": experiment.owner.username,
                     "status": experiment.status, "series": series})
    return {
        "runs": runs,
        "metrics": [(key, label) for key, label in DASHBOARD_SERIES if key in plotted],
        "config_differences": _config_differences(experiments),
    }
