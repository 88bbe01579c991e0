"""Celery application. Workers only drive background work; business logic lives in services."""

import ctypes
import os
import signal

from celery import Celery
from celery.signals import worker_init, worker_process_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

app = Celery("flowstate")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

PR_SET_PDEATHSIG = 1
_worker_main_pid = 0


@worker_init.connect
def _remember_the_worker_main_process(**_kwargs) -> None:
    global _worker_main_pid
    _worker_main_pid = os.getpid()


@worker_process_init.connect
def _die_with_the_worker(**_kwargs) -> None:
    """A pool child is killed when the worker's main process dies (even by SIGKILL), so no orphan
    keeps running an agent whose task the sweeper hands to another worker. The solo pool sends this
    signal in the main process itself: nothing to do there."""
    if os.getpid() == _worker_main_pid:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The main process may have died between the fork and the prctl: then no signal will come.
    if _worker_main_pid and os.getppid() != _worker_main_pid:
        os._exit(1)
