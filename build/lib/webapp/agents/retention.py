"""Retention of what untrusted submissions leave on the host: snapshots, uploads, dead sandboxes."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.utils import timezone

from webapp.agents.models import AgentTask, Repository


def sandboxes_gc(*, max_age_s: float | None = None) -> dict[str, int]:
    """Retention: reap dead sandboxes, delete unused snapshots and unreferenced uploads past the age.

    An upload is kept while a registered repository or an unfinished task names it.
    """
    from sandboxes import get_backend

    max_age_s = settings.SANDBOX_RETENTION_S if max_age_s is None else max_age_s
    counts = get_backend(settings.SANDBOX_BACKEND).gc(max_age_s=max_age_s)
    uploads = Path(settings.STATE_DIR) / "uploads"
    cutoff = timezone.now().timestamp() - max_age_s
    old = [p for p in uploads.iterdir() if p.is_file() and p.stat().st_mtime < cutoff] if uploads.is_dir() else []
    locations = [str(p) for p in old]
    kept = set(Repository.objects.filter(location__in=locations).values_list("location", flat=True))
    kept |= set(AgentTask.objects.filter(repo_location__in=locations).exclude(status__in=AgentTask.FINISHED)
                .values_list("repo_location", flat=True))
    removed = 0
    for path in old:
        if str(path) not in kept:
            path.unlink(missing_ok=True)
            removed += 1
    return {**counts, "uploads": removed}
