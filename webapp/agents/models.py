"""Cloud agent tasks and RL rollouts share one schema: an ``AgentTask`` and its ``TaskEvent`` rows.

A product task has ``source="product"``; an RL rollout is recorded with ``source="training"`` plus
``experiment_name``/``training_step``/``reward``/``advantage`` through
``webapp.agents.services.rollout_record`` (see its docstring), so both render in the same views.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models

from webapp.core.models import OwnedModel


class Repository(OwnedModel):
    """A registered repository that tasks can be submitted against."""

    class Kind(models.TextChoices):
        GIT = "git", "Git URL"
        PATH = "path", "Directory on the server"
        ARCHIVE = "archive", "Uploaded archive"

    name = models.CharField(max_length=120)
    kind = models.CharField(max_length=10, choices=Kind.choices)
    location = models.CharField(max_length=1000, help_text="Git URL, server directory, or stored archive path.")
    ref = models.CharField(max_length=200, blank=True, help_text="Git branch, tag or commit (git only).")
    description = models.TextField(blank=True)

    class Meta:
        ordering = ("name",)
        constraints = (models.UniqueConstraint(fields=("owner", "name"), name="agents_repository_owner_name"),)

    def __str__(self) -> str:
        return self.name


class AgentTask(OwnedModel):
    """One agent run: a cloud task submitted by a user, or a recorded RL rollout."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        # The agent stopped on its own: that alone says nothing about the code; ``outcome`` does.
        SUCCEEDED = "succeeded", "finished"
        FAILED = "failed"
        CANCELLED = "cancelled"

    class Outcome(models.TextChoices):
        """The repository's tests, run in the workspace after the agent stopped (webapp.agents.verify)."""

        NONE = "", "not verified"
        TESTS_PASS = "tests_pass", "tests pass"
        TESTS_FAIL = "tests_fail", "tests fail"
        NO_TESTS = "no_tests", "no tests"
        ERROR = "error", "tests could not run"

    class Source(models.TextChoices):
        PRODUCT = "product"
        TRAINING = "training"

    class Backend(models.TextChoices):
        BUILTIN = "builtin", "Built-in Flowstate model"
        OPENAI = "openai", "OpenAI-compatible server"
        SCRIPTED = "scripted", "Scripted expert (deterministic, not a model)"

    FINISHED = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    source = models.CharField(max_length=10, choices=Source.choices, default=Source.PRODUCT, db_index=True)
    repository = models.ForeignKey(Repository, on_delete=models.SET_NULL, null=True, blank=True, related_name="tasks")
    repo_kind = models.CharField(max_length=10, choices=Repository.Kind.choices)
    repo_location = models.CharField(max_length=1000)
    repo_ref = models.CharField(max_length=200, blank=True)
    repo_label = models.CharField(max_length=200, db_index=True, help_text="Shown and filtered on.")
    prompt = models.TextField()

    backend = models.CharField(max_length=10, choices=Backend.choices)
    model_name = models.CharField(max_length=200, db_index=True)
    base_url = models.CharField(max_length=500, blank=True)
    api_key = models.CharField(max_length=500, blank=True, help_text="Write-only: never rendered or returned.")
    policy_options = models.JSONField(default=dict, blank=True)
    limits = models.JSONField(default=dict, blank=True)

    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED, db_index=True)
    status_reason = models.TextField(blank=True)
    cancel_requested = models.BooleanField(default=False)
    attempt = models.PositiveIntegerField(default=0)
    claim_token = models.UUIDField(null=True, blank=True)
    last_seq = models.IntegerField(default=-1, help_text="Sequence number of the newest stored event.")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    snapshot_id = models.CharField(
        max_length=200, blank=True,
        help_text="Sandbox snapshot of the latest attempt: links the task to its semantic index build.")
    sandbox_runtime = models.CharField(
        max_length=64, blank=True, default="",
        help_text="OCI runtime (isolation tier) of the task's Docker sandbox; blank: SANDBOX_DOCKER_RUNTIME.")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    outcome = models.CharField(max_length=10, choices=Outcome.choices, blank=True, default="", db_index=True)
    test_command = models.CharField(max_length=1000, blank=True, help_text="What verified the result.")
    test_summary = models.CharField(max_length=500, blank=True, help_text="e.g. '12 passed, 1 failed' or why not.")
    test_output = models.TextField(blank=True, help_text="The end of the test run's output.")

    final_message = models.TextField(blank=True)
    diff = models.TextField(blank=True)
    messages = models.JSONField(default=list, blank=True, help_text="OpenAI message list of the final context.")
    turns = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)

    experiment_name = models.CharField(max_length=200, blank=True, db_index=True)
    training_step = models.IntegerField(null=True, blank=True)
    reward = models.FloatField(null=True, blank=True)
    advantage = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ("-created_at", "-id")

    def __str__(self) -> str:
        return f"task {self.pk} ({self.status})"

    @property
    def is_finished(self) -> bool:
        return self.status in self.FINISHED

    @property
    def verdict(self) -> str:
        """What a person reads: "finished, tests pass" / "... tests fail" / "... no tests" / "failed (why)"."""
        if self.status == self.Status.SUCCEEDED:
            return f"finished, {self.get_outcome_display()}"
        if self.status == self.Status.FAILED:
            return f"failed ({self.status_reason})" if self.status_reason else "failed"
        return self.get_status_display()


class TaskEvent(models.Model):
    """One step of a run. ``(task, seq)`` is unique, so a replayed or retried write cannot duplicate it.

    ``payload`` holds what a viewer needs (tool results truncated to ``display``); the full tool
    output lives in ``full_output`` and is served on demand.
    """

    task = models.ForeignKey(AgentTask, on_delete=models.CASCADE, related_name="events")
    seq = models.IntegerField()
    kind = models.CharField(max_length=20)
    turn = models.IntegerField(default=0)
    tool_name = models.CharField(max_length=50, blank=True, db_index=True)
    attempt = models.PositiveIntegerField(default=1)
    payload = models.JSONField(default=dict)
    full_output = models.TextField(blank=True)
    ts = models.FloatField(help_text="Unix time the step happened.")

    class Meta:
        ordering = ("task", "seq")
        constraints = (models.UniqueConstraint(fields=("task", "seq"), name="agents_taskevent_task_seq"),)

    def __str__(self) -> str:
        return f"{self.task_id}#{self.seq} {self.kind}"


class TaskFollowUp(models.Model):
    """A further user message to a task: the agent continues the same conversation and workspace.

    ``pending`` until the agent takes it (webapp.agents.followups): when a running agent stops, or in
    a continuation run of a finished task (in the warm sandbox, else rebuilt from snapshot + patch).
    """

    class Status(models.TextChoices):
        PENDING = "pending"
        DELIVERED = "delivered"
        DROPPED = "dropped"

    task = models.ForeignKey(AgentTask, on_delete=models.CASCADE, related_name="followups")
    author = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    message = models.TextField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING, db_index=True)
    status_reason = models.CharField(max_length=500, blank=True)
    workspace = models.CharField(max_length=10, blank=True, help_text="'warm' or 'rebuilt': where it ran.")
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("task", "created_at", "id")

    def __str__(self) -> str:
        return f"follow-up {self.pk} of task {self.task_id} ({self.status})"


class TaskBranch(models.Model):
    """The git branch ``flowstate/task-<id>`` holding a finished task's changes (webapp.agents.branches)."""

    task = models.OneToOneField(AgentTask, on_delete=models.CASCADE, related_name="branch")
    name = models.CharField(max_length=200)
    base_commit = models.CharField(max_length=64)
    commit = models.CharField(max_length=64)
    message = models.TextField()
    bundle_path = models.CharField(max_length=1000, help_text="git bundle of the branch, under STATE_DIR.")
    diff_digest = models.CharField(max_length=64, help_text="sha256 of the diff the commit holds.")
    pushed_to = models.CharField(max_length=1000, blank=True, help_text="Remote URL without credentials.")
    push_error = models.CharField(max_length=1000, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.name} @ {self.commit[:12]}"


class RepositoryCredential(models.Model):
    """Push credentials of a git repository: the secret is Fernet-encrypted (FLOWSTATE_CREDENTIALS_KEY),
    write-only (never rendered or returned) and used only by the host's ``git push``, never in a sandbox."""

    repository = models.OneToOneField(Repository, on_delete=models.CASCADE, related_name="credential")
    username = models.CharField(max_length=200)
    secret_encrypted = models.BinaryField()
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"push credentials of {self.repository}"
