"""Celery entry points of the agents app: parse, call one service, return its note."""

from __future__ import annotations

import logging
import threading

from celery import shared_task
from celery.signals import worker_ready, worker_shutdown

logger = logging.getLogger(__name__)
_stop_sweeping = threading.Event()


@shared_task(name="agents.task_run", acks_late=True, reject_on_worker_lost=True)
def agent_task_run(task_id: int) -> str:
    from webapp.agents.services import task_run

    return task_run(task_id=int(task_id))


def _sweep_once() -> None:
    from django.db import connection

    from webapp.agents.services import tasks_recover_stale

    try:
        count = tasks_recover_stale()
        if count:
            logger.warning("re-enqueued %d agent task(s) left behind by a stopped worker or a lost message", count)
    except Exception:
        logger.exception("could not look for stale agent tasks")
    finally:
        connection.close()


def _gc_once() -> None:
    from django.db import connection

    from webapp.agents.retention import sandboxes_gc

    try:
        counts = sandboxes_gc()
        if any(counts.values()):
            logger.info("retention: %s", counts)
    except Exception:
        logger.exception("the sandbox retention pass failed")
    finally:
        connection.close()


def _sweep_forever(interval_s: float) -> None:
    import time

    from django.conf import settings

    last_gc = time.monotonic()
    while not _stop_sweeping.wait(interval_s):
        _sweep_once()
        if time.monotonic() - last_gc >= settings.SANDBOX_GC_INTERVAL_S:
            last_gc = time.monotonic()
            _gc_once()


@worker_ready.connect
def _recover_stale_tasks(**_kwargs) -> None:
    # The sweeper is a thread of each worker's main process (``make run`` has no beat): at start it
    # picks up what a dead worker left behind, then every AGENT_SWEEP_S it looks again, so a worker
    # that dies while others live, or a message lost in the broker, is noticed too. Duplicate
    # messages from several sweeping workers are harmless: the claim lets only one agent run.
    from django.conf import settings

    _sweep_once()
    threading.Thread(target=_sweep_forever, args=(settings.AGENT_SWEEP_S,), name="agent-task-sweeper",
                     daemon=True).start()


@worker_shutdown.connect
def _stop_sweeper(**_kwargs) -> None:
    _stop_sweeping.set()
