"""Two ASGI server processes (the project's server command) behind the Redis channel layer.

A task runs in this process (the worker's code path: claim, agent loop in a local sandbox, each event
stored and then published through Redis); viewers connected to either server process before the
run starts receive every event once, in order, live.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time

import pytest
import websockets

from tests.conftest import ROOT, _free_port, _test_database_env, _wait_for_port
from webapp.server_command import asgi_server_command

ORIGIN = {"Origin": "http://127.0.0.1"}


@pytest.fixture
def two_asgi_servers(transactional_db):
    ports = [_free_port(), _free_port()]
    procs = [subprocess.Popen(asgi_server_command(host="127.0.0.1", port=port, log_level="warning"), cwd=ROOT,
                              env=_test_database_env()) for port in ports]
    try:
        for port, proc in zip(ports, procs, strict=True):
            _wait_for_port(port, proc, timeout=60)
        yield [f"127.0.0.1:{port}" for port in ports], procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=15)


async def _watch(urls: list[str], token: str, connected: threading.Event, timeout: float = 120) -> list[list[dict]]:
    """One viewer per url; each reads until the task is over. Returns every viewer's events."""
    headers = {**ORIGIN, "Authorization": f"Token {token}"}
    sockets = [await websockets.connect(url, additional_headers=headers) for url in urls]
    connected.set()

    async def read(ws) -> list[dict]:
        # Until the terminal status and every event up to its last_seq (the verification's "tests"
        # event follows the agent's "final" one).
        events: list[dict] = []
        last_seq = None
        while last_seq is None or not events or events[-1]["seq"] < last_seq:
            message = json.loads(await ws.recv())
            if message["type"] == "events":
                events.extend(message["events"])
            elif message["type"] == "status" and message["status"] in ("succeeded", "failed", "cancelled"):
                last_seq = message["last_seq"]
        await ws.close()
        return events

    return await asyncio.wait_for(asyncio.gather(*(read(ws) for ws in sockets)), timeout)


def test_viewers_on_two_server_processes_each_see_every_event_once_in_order(two_asgi_servers, owner, settings,
                                                                             tmp_path):
    from training.agent.demo_repo import write_demo_repository
    from webapp.accounts.services import api_token_get_or_create
    from webapp.agents import services
    from webapp.agents.models import AgentTask, Repository

    servers, procs = two_asgi_servers
    settings.STATE_DIR = tmp_path
    repository = services.repository_create(owner=owner, name="demo", kind=Repository.Kind.PATH,
                                            location=str(write_demo_repository(tmp_path / "demo")),
                                            allow_server_path=True)
    task = services.task_create(owner=owner, prompt="fix it", repository=repository, backend="scripted",
                                policy_options={"step_delay_s": 0.05}, enqueue=False)
    token = api_token_get_or_create(user=owner)
    urls = [f"ws://{server}/ws/tasks/{task.pk}/events/?after=-1" for server in servers for _ in range(3)]

    connected = threading.Event()
    result: dict = {}

    def viewers() -> None:
        result["events"] = asyncio.run(_watch(urls, token, connected))

    watching = threading.Thread(target=viewers)
    watching.start()
    assert connected.wait(60), "the viewers did not connect"
    time.sleep(0.5)  # every consumer has joined its group before the first event is published
    assert services.task_run(task_id=task.pk).startswith("succeeded")
    watching.join(timeout=150)
    assert not watching.is_alive(), "a viewer did not get the final event"

    stored = AgentTask.objects.get(pk=task.pk)
    expected = list(range(stored.last_seq + 1))
    assert len(expected) > 10
    for url, events in zip(urls, result["events"], strict=True):
        assert [event["seq"] for event in events] == expected, f"viewer on {url} missed, repeated or reordered"
    assert all(proc.poll() is None for proc in procs)
