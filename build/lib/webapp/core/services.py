from __future__ import annotations

import os
import socket

from django.db import transaction

from webapp.core.models import WorkerProbe
from webapp.core.notifications import notification_send_on_commit


@transaction.atomic
def worker_probe_record(*, nonce: str, user_id: int | None) -> WorkerProbe:
    probe = WorkerProbe.objects.create(
        nonce=nonce, requested_by_id=user_id, worker_hostname=socket.gethostname(), worker_pid=os.getpid()
    )
    if user_id is not None:
        notification_send_on_commit(
            user_id=user_id,
            event={"kind": "worker_probe", "nonce": nonce, "worker_pid": probe.worker_pid},
        )
    return probe
