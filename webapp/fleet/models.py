"""Sandbox hosts and the sandboxes they run, as last reported by host heartbeats.

The fleet holds no user data: a record names a sandbox, its state and whether it serves a product
task or a training rollout, never what runs inside it.
"""

from django.db import models


class SandboxHost(models.Model):
    class State(models.TextChoices):
        ALIVE = "alive"
        LOST = "lost"
        STOPPED = "stopped"

    name = models.CharField(max_length=200, unique=True, help_text="Stable host name (Ray node id or host name).")
    backend = models.CharField(max_length=20, default="local")
    runtime = models.CharField(max_length=64, blank=True, default="",
                               help_text="OCI runtime of a docker host's sandboxes (runc, runsc); empty for local.")
    state = models.CharField(max_length=10, choices=State.choices, default=State.ALIVE, db_index=True)
    slots_total = models.PositiveIntegerField(default=0)
    slots_used = models.PositiveIntegerField(default=0)
    sandboxes_starting = models.PositiveIntegerField(default=0, help_text="Admitted, still starting (no id yet).")
    cpu_percent = models.FloatField(default=0.0)
    memory_percent = models.FloatField(default=0.0)
    memory_used_mb = models.FloatField(default=0.0)
    queue_product = models.PositiveIntegerField(default=0)
    queue_training = models.PositiveIntegerField(default=0)
    queue_wait_p95_s = models.FloatField(default=0.0)
    admitted_total = models.PositiveBigIntegerField(default=0)
    first_seen_at = models.DateTimeField(auto_now_add=True)
    last_heartbeat_at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ("name",)

    def __str__(self) -> str:
        return f"{self.name} ({self.state})"


class SandboxRecord(models.Model):
    class State(models.TextChoices):
        STARTING = "starting"
        IDLE = "idle"
        BUSY = "busy"
        DESTROYED = "destroyed"
        FAILED = "failed"
        LOST = "lost"

    LIVE_STATES = (State.STARTING, State.IDLE, State.BUSY)

    class Purpose(models.TextChoices):
        PRODUCT = "product"
        TRAINING = "training"
        WARM = "warm"

    sandbox_id = models.CharField(max_length=100, unique=True)
    host = models.ForeignKey(SandboxHost, on_delete=models.CASCADE, related_name="sandboxes")
    state = models.CharField(max_length=10, choices=State.choices, db_index=True)
    purpose = models.CharField(max_length=10, choices=Purpose.choices, default=Purpose.TRAINING)
    cpu_percent = models.FloatField(default=0.0)
    memory_mb = models.FloatField(default=0.0)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("host_id", "sandbox_id")
        indexes = (models.Index(fields=["host", "state"]),)

    def __str__(self) -> str:
        return f"{self.sandbox_id} on {self.host_id} ({self.state})"


class HostUtilisationSample(models.Model):
    """One heartbeat's utilisation, kept for the dashboard's time series (pruned by age)."""

    host = models.ForeignKey(SandboxHost, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField(db_index=True)
    cpu_percent = models.FloatField()
    memory_percent = models.FloatField()
    sandboxes_live = models.PositiveIntegerField()
    queue_length = models.PositiveIntegerField()

    class Meta:
        ordering = ("at",)
