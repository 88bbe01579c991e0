"""RL experiments, their per-step metrics, rollouts and checkpoints, and benchmark runs."""

from __future__ import annotations

from django.db import models

from webapp.core.models import OwnedModel


class Experiment(OwnedModel):
    """One asynchronous GRPO run (training.rollout.driver), launched and monitored by Celery."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        PAUSED = "paused"
        CANCELLED = "cancelled"
        FINISHED = "finished"
        FAILED = "failed"

    ACTIVE = (Status.QUEUED, Status.RUNNING)

    name = models.CharField(max_length=200)
    config = models.JSONField(help_text="AsyncRLConfig fields (run_dir is derived from the id).")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED, db_index=True)
    status_reason = models.TextField(blank=True)
    pause_requested = models.BooleanField(default=False)
    cancel_requested = models.BooleanField(default=False)
    parent = models.ForeignKey(
        "self", on_delete=models.SET_NULL, null=True, blank=True, related_name="clones"
    )
    run_dir = models.CharField(max_length=500, blank=True)
    driver_pid = models.IntegerField(null=True, blank=True)
    launches = models.PositiveIntegerField(default=0, help_text="Driver starts (a restart resumes the run).")
    current_step = models.PositiveIntegerField(default=0)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("-created_at", "-id")

    def __str__(self) -> str:
        return f"experiment {self.pk} {self.name} ({self.status})"

    @property
    def total_steps(self) -> int:
        return int(self.config.get("steps", 0))


class ExperimentStep(models.Model):
    """Metrics of one policy update, as logged by the driver (one row per step, never two)."""

    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="steps")
    step = models.PositiveIntegerField()
    metrics = models.JSONField()
    recorded_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ("experiment", "step")
        constraints = (models.UniqueConstraint(fields=("experiment", "step"), name="experiment_step_unique"),)


class ExperimentRollout(models.Model):
    """One rollout of a trained or abandoned group: its group, reward, advantage, and its stored trace."""

    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="rollouts")
    step = models.PositiveIntegerField(db_index=True)
    rollout_id = models.CharField(max_length=100)
    group_id = models.CharField(max_length=100, db_index=True)
    task_id = models.CharField(max_length=100)
    sample_index = models.PositiveIntegerField()
    valid = models.BooleanField()
    reward = models.FloatField(null=True, blank=True, help_text="None when infrastructure failed (masked).")
    advantage = models.FloatField(default=0.0)
    passed = models.BooleanField(default=False)
    completion_tokens = models.PositiveIntegerField(default=0)
    turns = models.PositiveIntegerField(default=0)
    tool_calls = models.PositiveIntegerField(default=0)
    tools_used = models.JSONField(default=dict)
    policy_version = models.PositiveIntegerField(default=0)
    staleness = models.PositiveIntegerField(default=0)
    abandoned = models.BooleanField(
        default=False, help_text="Part of a group abandoned after its probe rollouts agreed: not trained on."
    )
    status = models.TextField(blank=True)
    trace = models.ForeignKey(
        "agents.AgentTask", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )

    class Meta:
        ordering = ("step", "group_id", "sample_index")
        constraints = (
            models.UniqueConstraint(fields=("experiment", "rollout_id"), name="experiment_rollout_unique"),
        )


class ExperimentCheckpoint(models.Model):
    """A policy checkpoint written by the driver after an update."""

    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="checkpoints")
    step = models.PositiveIntegerField()
    path = models.CharField(max_length=500)
    recorded_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ("experiment", "-step")
        constraints = (
            models.UniqueConstraint(fields=("experiment", "step"), name="experiment_checkpoint_unique"),
        )


class BenchmarkRun(OwnedModel):
    """One evaluation of a policy on a task suite: pass@1, pass@k, tokens, tool calls, wall time."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        FINISHED = "finished"
        FAILED = "failed"

    class PolicyKind(models.TextChoices):
        CHECKPOINT = "checkpoint", "Flowstate checkpoint"
        OPENAI = "openai", "OpenAI-compatible model"
        SCRIPTED = "scripted", "Scripted reference fix (upper bound)"

    suite = models.CharField(max_length=100, db_index=True)
    policy_kind = models.CharField(max_length=12, choices=PolicyKind.choices)
    policy_label = models.CharField(
        max_length=300, help_text="Checkpoint path or model name shown on the board."
    )
    base_url = models.CharField(max_length=500, blank=True)
    checkpoint = models.ForeignKey(
        ExperimentCheckpoint, on_delete=models.SET_NULL, null=True, blank=True, related_name="benchmark_runs"
    )
    attempts = models.PositiveIntegerField(default=1, help_text="k of pass@k.")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED, db_index=True)
    status_reason = models.TextField(blank=True)
    summary = models.JSONField(default=dict, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("-created_at", "-id")


class BenchmarkTaskResult(models.Model):
    """Per-task outcome of a benchmark run."""

    run = models.ForeignKey(BenchmarkRun, on_delete=models.CASCADE, related_name="task_results")
    task_id = models.CharField(max_length=100)
    attempts = models.PositiveIntegerField()
    passes = models.PositiveIntegerField()
    infrastructure_failures = models.PositiveIntegerField(default=0)
    mean_tokens = models.FloatField(default=0.0)
    mean_tool_calls = models.FloatField(default=0.0)
    wall_s = models.FloatField(default=0.0)

    class Meta:
        ordering = ("run", "task_id")
        constraints = (models.UniqueConstraint(fields=("run", "task_id"), name="benchmark_task_unique"),)


class RepositoryRecipe(models.Model):
    """How a registered repository is installed and tested (training.tasks.autoinstall), or why not."""

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        READY = "ready"
        FAILED = "failed"

    repository = models.OneToOneField("agents.Repository", on_delete=models.CASCADE, related_name="recipe")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    recipe = models.JSONField(
        default=dict, blank=True, help_text="Setup commands, test command, tests that ran."
    )
    failure = models.JSONField(
        default=dict, blank=True, help_text="Stage and reason when it cannot be set up."
    )
    log = models.TextField(blank=True, help_text="Each setup step and the baseline run, with their output.")
    step = models.CharField(max_length=200, blank=True, help_text="The setup step running now, in words.")
    budget = models.JSONField(default=dict, blank=True, help_text="SetupBudget fields of the last setup.")
    edited = models.BooleanField(default=False, help_text="The recipe was written by the user, not detected.")
    snapshot = models.JSONField(
        default=dict, blank=True,
        help_text="The prepared snapshot the last ready setup built (kept; product tasks and mining start from "
                  "it while the recipe is unchanged): backend, id, location, source, recipe fingerprint.",
    )
    updated_at = models.DateTimeField(auto_now=True)
