"""Celery named queues: agent tasks, experiment control and maintenance are routed apart, so a burst of
agent tasks does not delay a maintenance task served by a second worker (real workers, real Redis)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from django.conf import settings

ROOT = Path(__file__).resolve().parents[2]
BURST = 300


def _queue_of(task_name: str) -> str:
    from webapp.celery import app

    return app.amqp.router.route({}, task_name)["queue"].name


def test_every_task_has_a_named_queue_and_run_consumes_them_all():
    from webapp.celery import app

    app.loader.import_default_modules()
    names = [name for name in app.tasks if not name.startswith("celery.")]
    assert {"agents.task_run", "experiments.monitor", "core.worker_probe"} <= set(names)
    assert _queue_of("agents.task_run") == "agents"
    assert _queue_of("experiments.monitor") == _queue_of("experiments.benchmark_run") == "experiments"
    assert _queue_of("core.worker_probe") == "maintenance"
    assert _queue_of("fleet.some_future_task") == "maintenance"  # unrouted work still has a consumer
    assert {_queue_of(name) for name in names} <= set(settings.FLOWSTATE_CELERY_QUEUES)
    # make run's single worker must consume every queue, or routed tasks would wait forever.
    run = (ROOT / "scripts" / "run.py").read_text()
    [queues] = re.findall(r'"-Q", "([a-z,]+)"', run)
    assert tuple(queues.split(",")) == settings.FLOWSTATE_CELERY_QUEUES


def test_a_routed_message_lands_in_its_queue_only():
    """Each queue has its own exchange and key: a message sent to one named queue is not copied into the
    others (bound to one shared exchange and key, every queue would receive every message)."""
    from webapp.celery import app

    client = redis.Redis.from_url(settings.REDIS_URL)
    with app.connection_for_write() as connection:  # bind every queue, as a worker consuming all does
        for queue in app.amqp.queues.values():
            queue(connection.default_channel).declare()
    app.control.purge()
    try:
        for task_name, expected in (("agents.never_registered_probe", "agents"),
                                    ("experiments.never_registered_probe", "experiments"),
                                    ("core.never_registered_probe", "maintenance")):
            app.send_task(task_name)
            depths = {queue: client.llen(queue) for queue in settings.FLOWSTATE_CELERY_QUEUES}
            assert depths[expected] == 1 and sum(depths.values()) == 1, (task_name, depths)
            client.delete(expected)
    finally:
        app.control.purge()


def _start_worker(name: str, queues: str) -> subprocess.Popen:
    from tests.conftest import _test_database_env

    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "webapp", "worker", "--pool", "solo", "--loglevel", "warning",
         "--without-gossip", "--without-mingle", "-n", f"{name}-{os.getpid()}@%h", "-Q", queues],
        cwd=ROOT, env=_test_database_env(),
    )


def _wait_ready(app, proc: subprocess.Popen, name: str) -> None:
    destination = [f"{name}-{os.getpid()}@{os.uname().nodename}"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker {name} exited early with code {proc.returncode}")
        if app.control.ping(destination=destination, timeout=0.5):
            return
    raise TimeoutError(f"worker {name} did not answer ping within 60 s")


@pytest.mark.django_db(transaction=True)
def test_agent_burst_does_not_delay_maintenance_on_its_own_worker():
    from webapp.agents.tasks import agent_task_run
    from webapp.celery import app
    from webapp.core.models import WorkerProbe
    from webapp.core.tasks import worker_probe

    broker = redis.Redis.from_url(settings.REDIS_URL)
    for queue in settings.FLOWSTATE_CELERY_QUEUES:
        broker.delete(queue)
    agents = _start_worker("agents", "agents")
    maintenance = _start_worker("maintenance", "experiments,maintenance")
    try:
        _wait_ready(app, agents, "agents")
        _wait_ready(app, maintenance, "maintenance")
        # A burst of real agent-task deliveries for tasks that are not there (the path a duplicate delivery
        # takes): each is claimed, skipped and its result stored, one at a time on the agents worker.
        for index in range(BURST):
            agent_task_run.delay(10**9 + index)
        assert broker.llen("agents") > BURST // 4

        sent = time.monotonic()
        routed = worker_probe.delay("routed-probe")
        probe_pk = routed.get(timeout=60)
        routed_s = time.monotonic() - sent
        backlog = broker.llen("agents")
        assert backlog > 0, "the burst drained before the probe ran: make BURST larger"
        assert WorkerProbe.objects.get(pk=probe_pk).worker_pid == maintenance.pid

        # Baseline in the same run: the same maintenance task sent to the agent queue waits behind the burst.
        sent = time.monotonic()
        behind = worker_probe.apply_async(args=("queued-behind-burst",), queue="agents")
        behind_pk = behind.get(timeout=600)
        behind_s = time.monotonic() - sent
        assert WorkerProbe.objects.get(pk=behind_pk).worker_pid == agents.pid
        assert broker.llen("agents") == 0  # it ran only once the burst ahead of it had been taken
        assert routed_s < behind_s
        print(f"\nmaintenance probe during a {BURST}-task agent burst: own queue {routed_s:.2f} s "
              f"(agents backlog {backlog} left), behind the burst {behind_s:.2f} s")
    finally:
        for proc in (agents, maintenance):
            proc.terminate()
        for proc in (agents, maintenance):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
