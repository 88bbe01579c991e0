"""A running task's heartbeat: refreshed by a thread beside the agent, checked by the sweeper.

The heartbeat is the claim's proof of life: ``task_claim`` hands a task whose heartbeat is older
than ``AGENT_STALE_AFTER_S`` to a new attempt, and the refresh itself fails once another worker holds
the claim, which tells the agent to stop.
"""

from __future__ import annotations

import logging
import threading
import uuid

from django.conf import settings
from django.db import connection
from django.utils import timezone

from webapp.agents.models import AgentTask

logger = logging.getLogger(__name__)


def task_heartbeat(*, task_id: int, claim_token: uuid.UUID) -> bool:
    return bool(AgentTask.objects.filter(pk=task_id, claim_token=claim_token, status=AgentTask.Status.RUNNING)
                .update(heartbeat_at=timezone.now()))


def heartbeat_start(*, task_id: int, token: uuid.UUID, lost: threading.Event) -> threading.Event:
    """Refresh the heartbeat until the returned event is set; set ``lost`` when the claim is gone."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(settings.AGENT_HEARTBEAT_S):
            try:
                if not task_heartbeat(task_id=task_id, claim_token=token):
                    lost.set()  # another worker took over (or the task ended): the agent must stop
                    return
            except Exception:
                logger.exception("heartbeat of task %s failed", task_id)
            finally:
                connection.close()

    threading.Thread(target=beat, name=f"heartbeat-task-{task_id}", daemon=True).start()
    return stop
