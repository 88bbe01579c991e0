"""Abstract base for every user-owned object: ownership is the default, sharing is opt-in."""

from django.conf import settings
from django.db import models


class OwnedModel(models.Model):
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    team = models.ForeignKey(
        "accounts.Team",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        help_text="Members of this team may view (not change) the object.",
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        abstract = True


class WorkerProbe(models.Model):
    """A round trip through the broker: written by a Celery worker, read by /healthz and tests."""

    nonce = models.CharField(max_length=64, unique=True)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, null=True, blank=True, related_name="+")
    worker_hostname = models.CharField(max_length=200)
    worker_pid = models.IntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
