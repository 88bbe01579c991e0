"""Many tasks at once on real processes: each runs its agent exactly once, on SQLite and PostgreSQL.

A fresh database, a private redis-server, the ASGI server and a prefork Celery worker at its default
concurrency (as ``make run`` starts them); tasks are POSTed over HTTP and the outcome is read from
the database: every task succeeded with ``attempt == 1``, one ``start`` and one ``final`` event, and
contiguous event sequence numbers (``benchmarks/task_load.py``).
"""

from __future__ import annotations

import os
import uuid

import pytest

from benchmarks.task_load import (
    Stack,
    load_run,
    postgres_database_create,
    postgres_database_drop,
    redis_server_start,
)


@pytest.fixture
def private_redis(tmp_path):
    proc, url = redis_server_start(tmp_path)
    yield url
    proc.kill()
    proc.wait(timeout=10)


def _run(stack: Stack, *, count: int, concurrency: int) -> dict:
    try:
        stack.prepare()
        stack.start_worker("load")
        _, address = stack.start_asgi()
        return load_run(stack, address, count=count, concurrency=concurrency, timeout=600)
    finally:
        stack.stop()


def test_twenty_tasks_at_once_on_sqlite_run_exactly_once(tmp_path, private_redis):
    stack = Stack(database_url=f"sqlite:///{tmp_path / 'flowstate.sqlite3'}", redis_url=private_redis,
                  state_dir=tmp_path / "state")
    report = _run(stack, count=20, concurrency=20)
    assert report["rejected"] == [], report
    assert report["problems"] == [], report
    assert report["lost"] == 0 and report["duplicated"] == 0


def test_fifty_tasks_at_concurrency_ten_on_postgresql_run_exactly_once(tmp_path, private_redis):
    server = os.environ.get("DATABASE_URL", "")
    if not server.startswith("postgres"):
        pytest.skip("DATABASE_URL names no PostgreSQL server")
    url = postgres_database_create(server, f"flowstate_load_{uuid.uuid4().hex[:8]}")
    try:
        stack = Stack(database_url=url, redis_url=private_redis, state_dir=tmp_path / "state")
        report = _run(stack, count=50, concurrency=10)
    finally:
        postgres_database_drop(url)
    assert report["rejected"] == [], report
    assert report["problems"] == [], report
    assert report["lost"] == 0 and report["duplicated"] == 0


def test_sqlite_connections_use_wal_immediate_transactions_and_a_busy_timeout(tmp_path):
    """What every process of the embedded default gets on its SQLite connection."""
    stack = Stack(database_url=f"sqlite:///{tmp_path / 'flowstate.sqlite3'}", redis_url="redis://127.0.0.1:1/0",
                  state_dir=tmp_path / "state")
    out = stack.manage("shell", "-c", (
        "from django.db import connection, transaction\n"
        "cursor = connection.cursor()\n"
        "values = [cursor.execute(f'PRAGMA {name}').fetchone()[0] for name in ('journal_mode', 'busy_timeout', 'synchronous')]\n"
        "with transaction.atomic():\n"
        "    values.append(connection.connection.in_transaction)\n"
        "print('PRAGMAS', values, connection.settings_dict['OPTIONS']['transaction_mode'])\n"))
    assert "PRAGMAS ['wal', 30000, 1, True] IMMEDIATE" in out, out
