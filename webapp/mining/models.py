"""Task sets mined from a registered repository (training.tasks.repo_mining) and their tasks."""

from __future__ import annotations

from django.db import models

from webapp.core.models import OwnedModel


class TaskSet(OwnedModel):
    """Validated tasks mined from one repository at one commit with one recipe and mining settings.

    Only a READY set is used for training or benchmarks: its tasks are stored in the same transaction
    that marks it ready, so a failed or cancelled run leaves no tasks behind.
    """

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        READY = "ready"
        FAILED = "failed"
        CANCELLED = "cancelled"

    ACTIVE = (Status.QUEUED, Status.RUNNING)

    name = models.CharField(max_length=200)
    repository = models.ForeignKey(
        "agents.Repository", on_delete=models.SET_NULL, null=True, blank=True, related_name="task_sets"
    )
    repo_label = models.CharField(max_length=200, help_text="The repository's name when mined (provenance).")
    repo_location = models.CharField(max_length=1000)
    commit = models.CharField(max_length=64, blank=True, help_text="HEAD of the mined snapshot, when it is git.")
    recipe = models.JSONField(default=dict, blank=True, help_text="The recipe (and baseline) the tasks use.")
    settings = models.JSONField(default=dict, blank=True, help_text="MiningConfig fields.")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED, db_index=True)
    status_reason = models.TextField(blank=True)
    progress = models.JSONField(default=dict, blank=True, help_text="Live counters of the mining job.")
    stats = models.JSONField(default=dict, blank=True, help_text="Figures of the finished run.")
    cancel_requested = models.BooleanField(default=False)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("-created_at", "-id")

    def __str__(self) -> str:
        return f"task set {self.pk} {self.name} ({self.status})"

    def suite(self, split: str) -> str:
        """The benchmark suite name of one split of this set."""
        return f"taskset-{self.pk}-{split}"


class MinedTask(models.Model):
    """One validated task of a set; ``task`` is the CodingTask JSON the trainer and benchmarks load."""

    task_set = models.ForeignKey(TaskSet, on_delete=models.CASCADE, related_name="tasks")
    task_id = models.CharField(max_length=200)
    split = models.CharField(max_length=10, db_index=True)
    source = models.CharField(max_length=10, help_text="mutation or history")
    path = models.CharField(max_length=500)
    kind = models.CharField(max_length=40)
    fail_to_pass = models.JSONField(default=list)
    prompt = models.TextField()
    diff = models.TextField(help_text="The injected bug as a unified diff (fixed -> buggy).")
    expert_solved = models.BooleanField(null=True, blank=True, help_text="Scripted expert solved it (difficulty).")
    task = models.JSONField()

    class Meta:
        ordering = ("task_set", "split", "path", "id")
        constraints = (models.UniqueConstraint(fields=("task_set", "task_id"), name="mined_task_unique"),)
