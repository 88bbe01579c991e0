"""Read side of the fleet: the compact shapes the dashboard and its websocket send to browsers."""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Count, Q
from django.utils import timezone

from webapp.fleet.models import HostUtilisationSample, SandboxHost, SandboxRecord

# Order matters: the dashboard encodes a sandbox's state as its index in this tuple.
SANDBOX_STATE_CODES = ("starting", "idle", "busy", "destroyed", "failed", "lost")
SANDBOX_PURPOSE_CODES = ("product", "training", "warm")


def host_payload(*, host: SandboxHost, sandboxes: list[SandboxRecord] | None = None) -> dict:
    """One host and its live sandboxes as ``[id, state code, purpose code, cpu %, memory MiB]`` rows."""
    if sandboxes is None:
        sandboxes = list(host.sandboxes.filter(state__in=SandboxRecord.LIVE_STATES).order_by("sandbox_id"))
    return {
        "name": host.name,
        "backend": host.backend,
        "runtime": host.runtime,
        "state": host.state,
        "slots_total": host.slots_total,
        "slots_used": host.slots_used,
        "starting": host.sandboxes_starting,
        "cpu_percent": round(host.cpu_percent, 1),
        "memory_percent": round(host.memory_percent, 1),
        "memory_used_mb": round(host.memory_used_mb, 1),
        "queue_product": host.queue_product,
        "queue_training": host.queue_training,
        "queue_wait_p95_s": round(host.queue_wait_p95_s, 3),
        "admitted_total": host.admitted_total,
        "last_heartbeat_at": host.last_heartbeat_at.timestamp(),
        "sandboxes": [
            [r.sandbox_id, SANDBOX_STATE_CODES.index(r.state), SANDBOX_PURPOSE_CODES.index(r.purpose),
             round(r.cpu_percent, 1), round(r.memory_mb, 1)]
            for r in sandboxes
        ],
    }


def fleet_overview(*, include_stopped: bool = False) -> dict:
    """Every host with its live sandboxes and fleet-wide totals, in one query per table."""
    hosts = list(SandboxHost.objects.all() if include_stopped else SandboxHost.objects.exclude(state="stopped"))
    live = SandboxRecord.objects.filter(host__in=hosts, state__in=SandboxRecord.LIVE_STATES).order_by("sandbox_id")
    by_host: dict[int, list[SandboxRecord]] = {host.pk: [] for host in hosts}
    for record in live:
        by_host[record.host_id].append(record)
    counts = SandboxRecord.objects.filter(host__in=hosts).aggregate(
        **{state: Count("pk", filter=Q(state=state)) for state in SANDBOX_STATE_CODES}
    )
    return {
        "hosts": [host_payload(host=host, sandboxes=by_host[host.pk]) for host in hosts],
        "totals": {
            "hosts_alive": sum(1 for h in hosts if h.state == SandboxHost.State.ALIVE),
            "hosts_lost": sum(1 for h in hosts if h.state == SandboxHost.State.LOST),
            "slots_total": sum(h.slots_total for h in hosts if h.state == SandboxHost.State.ALIVE),
            "queue_length": sum(h.queue_product + h.queue_training for h in hosts if h.state == "alive"),
            "sandboxes_by_state": counts,
        },
        "state_codes": SANDBOX_STATE_CODES,
        "purpose_codes": SANDBOX_PURPOSE_CODES,
        "generated_at": timezone.now().timestamp(),
    }


def fleet_utilisation_series(*, window_s: float = 600.0) -> dict[str, list[list[float]]]:
    """Per host, ``[unix time, cpu %, memory %, live sandboxes, queue length]`` rows over the window."""
    since = timezone.now() - timedelta(seconds=window_s)
    series: dict[str, list[list[float]]] = {}
    rows = (
        HostUtilisationSample.objects.filter(at__gte=since)
        .order_by("at")
        .values_list("host__name", "at", "cpu_percent", "memory_percent", "sandboxes_live", "queue_length")
    )
    for name, at, cpu, memory, live, queue in rows:
        series.setdefault(name, []).append([round(at.timestamp(), 3), round(cpu, 1), round(memory, 1), live, queue])
    return series
