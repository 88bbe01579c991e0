"""/healthz answers within 2 s when Redis or the database stalls, and names what stalled (issue 43).

Redis: a redis-server of the test's own on a free port, frozen with SIGSTOP (it accepts connections
in the kernel's backlog but never answers), never the shared one. Database: another connection holds
an exclusive lock on the table the probe reads, as a long migration or a stuck transaction would.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest
from django.db import connection

pytestmark = pytest.mark.django_db(transaction=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def own_redis(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("own redis-server did not start") from None
                time.sleep(0.05)
        yield proc, f"redis://127.0.0.1:{port}/0"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=10)


def _wait_until_ok(client, check: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    report = {}
    while time.monotonic() < deadline:
        report = client.get("/healthz").json()
        if report["checks"][check]["ok"]:
            return
        time.sleep(0.3)
    raise AssertionError(f"{check} never reported ok: {report['checks'][check]}")


def _timed_get(client):
    started = time.monotonic()
    response = client.get("/healthz")
    return response, time.monotonic() - started


def test_a_stopped_redis_is_named_within_two_seconds(client, settings, own_redis, record_property):
    proc, url = own_redis
    settings.REDIS_URL = url
    settings.CELERY_BROKER_URL = url
    _wait_until_ok(client, "redis")  # the probe really talks to this server (the first call also imports)
    os.kill(proc.pid, signal.SIGSTOP)
    for attempt in range(2):  # the second request may find the first one's probes still waiting, and says so
        response, elapsed = _timed_get(client)
        record_property(f"healthz_s_redis_stopped_{attempt}", round(elapsed, 3))
        report = response.json()
        assert elapsed < 2.0, elapsed
        assert response.status_code == 200  # pages can still be served: only the database is fatal
        assert {"redis", "celery"} <= set(report["down"]) and report["checks"]["database"]["ok"] is True
        assert report["checks"]["redis"]["ok"] is False
    os.kill(proc.pid, signal.SIGCONT)
    _wait_until_ok(client, "redis")  # recovers once the server answers again


def test_a_locked_database_is_named_within_two_seconds(admin_client, settings, record_property):
    client = admin_client  # what stalled is a detail: staff see it
    if connection.vendor != "postgresql":
        pytest.skip("the lock used here is PostgreSQL's (SQLite readers are not blocked by a writer in WAL mode)")
    locked, release = threading.Event(), threading.Event()

    def hold_lock():
        from django.db import connection as own
        from django.db import transaction

        try:
            with transaction.atomic(), own.cursor() as cursor:
                cursor.execute("LOCK TABLE django_migrations IN ACCESS EXCLUSIVE MODE")
                locked.set()
                release.wait(30)
        finally:
            own.close()

    holder = threading.Thread(target=hold_lock, daemon=True)
    holder.start()
    assert locked.wait(10)
    try:
        response, elapsed = _timed_get(client)
        record_property("healthz_s_database_locked", round(elapsed, 3))
        report = response.json()
        assert elapsed < 2.0, elapsed
        assert response.status_code == 503 and "database" in report["down"]
        assert "no answer within" in report["checks"]["database"]["detail"]
    finally:
        release.set()
        holder.join(10)
    _wait_until_ok(client, "database")
