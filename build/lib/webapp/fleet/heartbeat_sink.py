"""Entry point sandbox hosts call with each heartbeat, from inside their Ray worker process.

The worker is not a Django process, so Django is set up on first use from the environment the fleet
passes to its actors (DJANGO_SETTINGS_MODULE, DATABASE_URL, REDIS_URL).
"""

from __future__ import annotations

import os
import threading

_setup_lock = threading.Lock()
_ready = False


def _django_ready() -> None:
    global _ready
    with _setup_lock:
        if _ready:
            return
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
        import django

        django.setup()
        _ready = True


def heartbeat_record(payload: dict) -> None:
    """Store one heartbeat through the fleet service (which publishes it after commit)."""
    _django_ready()
    from django.db import close_old_connections

    from sandboxes.fleet.heartbeat import HostHeartbeat
    from webapp.fleet.services import host_heartbeat_record

    close_old_connections()
    host_heartbeat_record(heartbeat=HostHeartbeat.from_dict(payload))
