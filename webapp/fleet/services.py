"""Write side of the fleet: heartbeats, lost-host detection, pruning. Events go out after commit."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta

from django.db import OperationalError, connection, transaction
from django.utils import timezone

from sandboxes.fleet.heartbeat import HostHeartbeat
from webapp.fleet.events import fleet_event_send_on_commit
from webapp.fleet.models import HostUtilisationSample, SandboxHost, SandboxRecord
from webapp.fleet.selectors import host_payload

logger = logging.getLogger(__name__)

FLEET_WRITE_ATTEMPTS = 6
"""Tries of a fleet write that finds its tables locked by a TRUNCATE or schema change (see _fleet_tables_lock)."""
LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for a NOWAIT lock that was taken


def _fleet_tables_lock() -> None:
    """Take the write locks of the fleet's three tables up front, in one statement, without waiting.

    A heartbeat writes hosts, sandbox records and utilisation samples. Locking them one statement at
    a time, it could hold one table while a TRUNCATE (a test database flush, whose table order is
    arbitrary) or a migration holds another and waits for the first: a deadlock PostgreSQL breaks by
    aborting either side, the flush included. Locked here first, with NOWAIT, a writer holds all
    three before such a statement takes any, or gives way at once (``_fleet_write`` tries again).
    ROW EXCLUSIVE is the mode the writes take anyway, so writers never block one another with it.
    """
    if connection.vendor != "postgresql":
        return
    tables = ", ".join(connection.ops.quote_name(model._meta.db_table)
                       for model in (HostUtilisationSample, SandboxHost, SandboxRecord))
    with connection.cursor() as cursor:
        cursor.execute(f"LOCK TABLE {tables} IN ROW EXCLUSIVE MODE NOWAIT")


def _fleet_write(write, *, what: str):
    """``write()`` in a transaction that holds the fleet tables' locks; tried again while they are taken."""
    for attempt in range(1, FLEET_WRITE_ATTEMPTS + 1):
        try:
            with transaction.atomic():
                _fleet_tables_lock()
                return write()
        except OperationalError as exc:
            if getattr(exc.__cause__, "sqlstate", None) != LOCK_NOT_AVAILABLE or attempt == FLEET_WRITE_ATTEMPTS:
                raise
            logger.info("%s: fleet tables locked by another statement (attempt %d); trying again", what, attempt)
            time.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")


def host_heartbeat_record(*, heartbeat: HostHeartbeat) -> SandboxHost:
    """Store a host's heartbeat: upsert the host, sync its sandbox records, keep a utilisation sample.

    Sandboxes the host no longer reports are marked destroyed. A heartbeat from a host that was
    marked lost brings it back (its lost sandboxes stay lost: their processes are gone). The fleet
    tables are locked first, all at once (``_fleet_tables_lock``).
    """
    return _fleet_write(lambda: _heartbeat_store(heartbeat=heartbeat), what=f"heartbeat of {heartbeat.host_name}")


def _heartbeat_store(*, heartbeat: HostHeartbeat) -> SandboxHost:
    now = timezone.now()
    sent_at = datetime.fromtimestamp(heartbeat.sent_at, tz=UTC)
    queue = heartbeat.queue
    host, _ = SandboxHost.objects.update_or_create(
        name=heartbeat.host_name,
        defaults={
            "backend": heartbeat.backend,
            "runtime": heartbeat.runtime[:64],
            "state": SandboxHost.State.STOPPED if heartbeat.stopping else SandboxHost.State.ALIVE,
            "slots_total": heartbeat.slots_total,
            "slots_used": heartbeat.slots_used,
            "sandboxes_starting": heartbeat.starting,
            "cpu_percent": heartbeat.cpu_percent,
            "memory_percent": heartbeat.memory_percent,
            "memory_used_mb": heartbeat.memory_used_mb,
            "queue_product": queue.product_waiting,
            "queue_training": queue.training_waiting,
            "queue_wait_p95_s": queue.wait_p95_s,
            "admitted_total": queue.admitted_total,
            "last_heartbeat_at": now,
        },
    )
    reported = {status.sandbox_id: status for status in heartbeat.sandboxes}
    known = {r.sandbox_id: r for r in SandboxRecord.objects.select_for_update().filter(sandbox_id__in=reported)}
    changed: list[SandboxRecord] = []
    created: list[SandboxRecord] = []
    for sandbox_id, status in reported.items():
        record = known.get(sandbox_id)
        if record is None:
            created.append(SandboxRecord(
                sandbox_id=sandbox_id, host=host, state=status.state, purpose=status.purpose,
                cpu_percent=status.cpu_percent, memory_mb=status.memory_mb,
            ))
            continue
        if record.state == SandboxRecord.State.LOST:
            continue
        before = (record.state, record.purpose, record.host_id, record.cpu_percent, record.memory_mb)
        after = (status.state, status.purpose, host.pk, status.cpu_percent, status.memory_mb)
        if before != after:
            record.state, record.purpose, record.host = status.state, status.purpose, host
            record.cpu_percent, record.memory_mb = status.cpu_percent, status.memory_mb
            record.ended_at = now if status.state in ("destroyed", "failed") else None
            record.updated_at = now  # bulk_update skips auto_now
            changed.append(record)
    SandboxRecord.objects.bulk_create(created)
    SandboxRecord.objects.bulk_update(
        changed, ["state", "purpose", "host", "cpu_percent", "memory_mb", "ended_at", "updated_at"]
    )
    SandboxRecord.objects.filter(host=host, state__in=SandboxRecord.LIVE_STATES).exclude(
        sandbox_id__in=reported
    ).update(state=SandboxRecord.State.DESTROYED, ended_at=now, updated_at=now)
    live = [s for s in heartbeat.sandboxes if s.state in SandboxRecord.LIVE_STATES]
    HostUtilisationSample.objects.create(
        host=host,
        at=sent_at,
        cpu_percent=heartbeat.cpu_percent,
        memory_percent=heartbeat.memory_percent,
        sandboxes_live=len(live),
        queue_length=queue.waiting,
    )
    fleet_event_send_on_commit(event={"kind": "host", "host": host_payload(host=host)})
    return host


def hosts_mark_lost(*, stale_after_s: float) -> list[str]:
    """Mark hosts silent for ``stale_after_s`` as lost, and their live sandboxes with them."""
    if stale_after_s <= 0:
        raise ValueError(f"stale_after_s={stale_after_s} must be positive (a few heartbeat intervals)")
    return _fleet_write(lambda: _hosts_mark_lost(stale_after_s=stale_after_s), what="marking silent hosts lost")


def _hosts_mark_lost(*, stale_after_s: float) -> list[str]:
    now = timezone.now()
    stale = list(
        SandboxHost.objects.select_for_update()
        .filter(state=SandboxHost.State.ALIVE, last_heartbeat_at__lt=now - timedelta(seconds=stale_after_s))
        .order_by("name")
    )
    for host in stale:
        host.state = SandboxHost.State.LOST
        host.slots_used = host.sandboxes_starting = 0
        host.save(update_fields=["state", "slots_used", "sandboxes_starting"])
        SandboxRecord.objects.filter(host=host, state__in=SandboxRecord.LIVE_STATES).update(
            state=SandboxRecord.State.LOST, ended_at=now, updated_at=now
        )
        fleet_event_send_on_commit(event={"kind": "host", "host": host_payload(host=host, sandboxes=[])})
    return [host.name for host in stale]


def fleet_history_prune(*, keep_samples_s: float = 3600.0, keep_ended_sandboxes_s: float = 3600.0) -> int:
    """Delete old utilisation samples and long-ended sandbox records; return how many rows went."""
    now = timezone.now()
    samples, _ = HostUtilisationSample.objects.filter(at__lt=now - timedelta(seconds=keep_samples_s)).delete()
    ended, _ = SandboxRecord.objects.filter(
        ended_at__lt=now - timedelta(seconds=keep_ended_sandboxes_s)
    ).delete()
    return samples + ended
