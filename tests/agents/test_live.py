"""Real processes: API -> Redis -> Celery worker child -> sandbox -> PostgreSQL -> channel layer ->
uvicorn child -> websocket client. Covers the resume cursor across a dropped connection, websocket
permissions, cancellation from the API and a worker killed mid-task."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import websockets
from django.conf import settings

from webapp.accounts.services import api_token_get_or_create

ORIGIN = {"Origin": "http://127.0.0.1"}


def _submit(api_client_for, user, repository, *, delay: float) -> dict:
    response = api_client_for(user).post("/api/tasks/", {
        "prompt": "Fix the failing median test", "backend": "scripted", "repository_id": repository.pk,
        "policy_options": {"step_delay_s": delay}, "share_with_team": user.teams.first().name,
    }, format="json")
    assert response.status_code == 201, response.json()
    return response.json()


def _wait_status(task_id: int, statuses: tuple[str, ...], timeout: float = 120) -> str:
    from webapp.agents.models import AgentTask

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = AgentTask.objects.values_list("status", flat=True).get(pk=task_id)
        if status in statuses:
            return status
        time.sleep(0.2)
    raise TimeoutError(f"task {task_id} still {status} after {timeout}s")


async def _read_events(url: str, token: str, *, until, timeout: float = 90) -> tuple[list[dict], list[dict]]:
    """Read until ``until(events)`` is true; return (events, other messages)."""
    events, others = [], []
    async with websockets.connect(url, additional_headers={**ORIGIN, "Authorization": f"Token {token}"}) as ws:
        deadline = time.monotonic() + timeout
        while not until(events):
            message = json.loads(await asyncio.wait_for(ws.recv(), timeout=max(0.1, deadline - time.monotonic())))
            if message["type"] == "events":
                events.extend(message["events"])
            else:
                others.append(message)
    return events, others


@pytest.mark.django_db(transaction=True)
def test_live_run_with_reconnect_gets_every_event_exactly_once(owner, teammate, demo_repository, asgi_server,
                                                               celery_worker_process, api_client_for):
    from webapp.agents.models import AgentTask

    task = _submit(api_client_for, owner, demo_repository, delay=0.3)
    url = f"ws://{asgi_server}/ws/tasks/{task['id']}/events/"
    token = api_token_get_or_create(user=teammate)  # a teammate watches the owner's shared task

    first, _ = asyncio.run(_read_events(f"{url}?after=-1", token, until=lambda ev: len(ev) >= 8))
    # The connection is gone while the agent keeps working; then the browser resumes from its cursor.
    time.sleep(1.0)
    cursor = first[-1]["seq"]
    assert AgentTask.objects.get(pk=task["id"]).last_seq > cursor, "steps must happen while disconnected"
    rest, others = asyncio.run(_read_events(f"{url}?after={cursor}", token,
                                            until=lambda ev: bool(ev) and ev[-1]["kind"] == "final"))
    received = [e["seq"] for e in first + rest]
    stored = AgentTask.objects.get(pk=task["id"])
    assert received == list(range(stored.last_seq + 1)), "no gaps and no duplicates"
    assert _wait_status(task["id"], ("succeeded", "failed")) == "succeeded"
    final = rest[-1]["payload"]
    assert final["status"] == "succeeded" and "ordered[middle - 1]" in final["diff"]
    assert any(m.get("type") == "status" for m in others)
    tool_results = [e for e in first + rest if e["kind"] == "tool_result"]
    assert tool_results and all("output" not in e["payload"] and "display" in e["payload"] for e in tool_results)
    # The API serves the same patch the final event carried.
    assert api_client_for(owner).get(f"/api/tasks/{task['id']}/patch/").content.decode() == final["diff"]


@pytest.mark.django_db(transaction=True)
def test_websocket_permissions(owner, outsider, demo_repository, asgi_server):
    from webapp.agents.services import task_create

    task = task_create(owner=owner, prompt="x", repository=demo_repository, backend="scripted", enqueue=False)

    async def close_code(headers):
        try:
            async with websockets.connect(f"ws://{asgi_server}/ws/tasks/{task.pk}/events/", additional_headers=headers) as ws:
                await asyncio.wait_for(ws.recv(), timeout=5)
                return "open"
        except websockets.exceptions.ConnectionClosed as closed:
            return closed.rcvd.code if closed.rcvd else None
        except websockets.exceptions.InvalidStatus as refused:
            return refused.response.status_code

    assert asyncio.run(close_code(ORIGIN)) == 4401
    assert asyncio.run(close_code({**ORIGIN, "Authorization": f"Token {api_token_get_or_create(user=outsider)}"})) == 4404
    assert asyncio.run(close_code({**ORIGIN, "Authorization": f"Token {api_token_get_or_create(user=owner)}"})) == "open"


@pytest.mark.django_db(transaction=True)
def test_cancel_from_the_api_stops_a_running_task(owner, demo_repository, celery_worker_process, api_client_for):
    from webapp.agents.models import AgentTask

    task = _submit(api_client_for, owner, demo_repository, delay=1.0)
    _wait_status(task["id"], ("running",))
    response = api_client_for(owner).post(f"/api/tasks/{task['id']}/cancel/")
    assert response.status_code == 200
    assert _wait_status(task["id"], ("cancelled", "succeeded", "failed")) == "cancelled"
    stored = AgentTask.objects.get(pk=task["id"])
    assert stored.status_reason == "cancelled by the user"
    assert stored.events.last().kind == "final" and stored.events.last().payload["status"] == "cancelled"


def _start_worker(env: dict[str, str], name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "webapp", "worker", "--pool", "solo", "--loglevel", "warning",
         "--without-gossip", "--without-mingle", "-n", f"{name}-{os.getpid()}@%h",
         "-Q", ",".join(settings.FLOWSTATE_CELERY_QUEUES)],
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), env=env,
    )


@pytest.mark.django_db(transaction=True)
def test_worker_killed_mid_task_is_retried_without_duplicate_events(owner, demo_repository, api_client_for):
    from tests.conftest import _test_database_env
    from webapp.agents.models import AgentTask

    env = {**_test_database_env(), "AGENT_HEARTBEAT_S": "1", "AGENT_STALE_AFTER_S": "3"}
    first = _start_worker(env, "doomed")
    second = None
    try:
        task = _submit(api_client_for, owner, demo_repository, delay=0.3)
        _wait_status(task["id"], ("running",), timeout=60)
        # A second worker is up while the first runs the task; it must not start a second agent.
        second = _start_worker(env, "rescuer")
        deadline = time.monotonic() + 60
        while AgentTask.objects.get(pk=task["id"]).last_seq < 6:
            assert time.monotonic() < deadline, "the first worker never got going"
            time.sleep(0.2)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        before = AgentTask.objects.get(pk=task["id"])
        assert before.status == "running" and before.attempt == 1
        # The live worker notices the silent heartbeat (at its start or in its periodic sweep).
        assert _wait_status(task["id"], ("succeeded", "failed"), timeout=120) == "succeeded"
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=15)
    stored = AgentTask.objects.get(pk=task["id"])
    assert stored.attempt == 2
    rows = list(stored.events.values_list("seq", "kind", "attempt"))
    assert [seq for seq, _, _ in rows] == list(range(len(rows)))
    retry = [i for i, (_, kind, _) in enumerate(rows) if kind == "retry"]
    assert len(retry) == 1
    assert {attempt for _, _, attempt in rows[: retry[0]]} == {1}
    assert {attempt for _, _, attempt in rows[retry[0] + 1:]} == {2}
    assert [kind for _, kind, _ in rows].count("final") == 1
