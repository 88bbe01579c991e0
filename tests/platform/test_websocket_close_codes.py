"""Websockets against the real ASGI server (uvicorn child): token clients need no Origin, cookie
sessions keep the Origin check, and every refusal reaches the client as a close code it can read."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import websockets
from django.test import Client

from webapp.accounts.services import api_token_get_or_create

pytestmark = pytest.mark.django_db(transaction=True)

GOOD_ORIGIN = {"Origin": "http://127.0.0.1"}
EVIL_ORIGIN = {"Origin": "https://evil.example"}


@pytest.fixture
def finished_task(owner):
    from webapp.agents.models import AgentTask, TaskEvent

    task = AgentTask.objects.create(
        owner=owner, repo_kind="path", repo_location="/srv/demo", repo_label="demo", prompt="fix it",
        backend="scripted", model_name="scripted", status="succeeded", last_seq=2,
    )
    for seq, kind in enumerate(("user", "assistant", "final")):
        TaskEvent.objects.create(task=task, seq=seq, kind=kind, payload={"text": kind}, ts=time.time())
    return task


def _session_cookie(user, password: str) -> dict:
    client = Client()
    assert client.login(username=user.username, password=password)
    return {"Cookie": f"sessionid={client.cookies['sessionid'].value}"}


async def _outcome(url: str, headers: dict) -> tuple[object, list[dict]]:
    """("open", messages up to backlog_done), or the close code, or ("http", status) for a refused handshake."""
    messages = []
    try:
        async with websockets.connect(url, additional_headers=headers, open_timeout=10) as ws:
            while True:
                message = json.loads(await asyncio.wait_for(ws.recv(), timeout=10))
                messages.append(message)
                if message["type"] in ("backlog_done", "pong"):
                    return "open", messages
    except websockets.exceptions.ConnectionClosed as closed:
        return (closed.rcvd.code if closed.rcvd else None), messages
    except websockets.exceptions.InvalidStatus as refused:
        return ("http", refused.response.status_code), messages


def _run(url, headers):
    return asyncio.run(_outcome(url, headers))


def test_token_client_without_origin_follows_a_task_with_the_resume_cursor(owner, finished_task, asgi_server):
    token = api_token_get_or_create(user=owner)
    url = f"ws://{asgi_server}/ws/tasks/{finished_task.pk}/events/"
    outcome, messages = _run(url, {"Authorization": f"Token {token}"})  # no Origin header at all
    assert outcome == "open"
    seqs = [event["seq"] for m in messages if m["type"] == "events" for event in m["events"]]
    assert seqs == [0, 1, 2]
    # Resume after seq 1: only what was missed; the token may also travel in the query string.
    outcome, messages = _run(f"{url}?after=1&token={token}", {})
    assert outcome == "open"
    assert [e["seq"] for m in messages if m["type"] == "events" for e in m["events"]] == [2]
    assert messages[-1] == {"type": "backlog_done", "last_seq": 2}


def test_refusals_are_close_codes_not_a_403_handshake(owner, outsider, finished_task, asgi_server):
    url = f"ws://{asgi_server}/ws/tasks/{finished_task.pk}/events/"
    assert _run(url, {})[0] == 4403  # anonymous without Origin: the Origin check of non-token clients
    assert _run(url, GOOD_ORIGIN)[0] == 4401
    assert _run(url, {"Authorization": "Token not-a-real-token"})[0] == 4401
    outsider_token = api_token_get_or_create(user=outsider)
    assert _run(url, {"Authorization": f"Token {outsider_token}"})[0] == 4404
    owner_token = api_token_get_or_create(user=owner)
    missing = f"ws://{asgi_server}/ws/tasks/{finished_task.pk + 1000}/events/"
    assert _run(missing, {"Authorization": f"Token {owner_token}"})[0] == 4404
    assert _run(f"ws://{asgi_server}/ws/no-such-route/", {"Authorization": f"Token {owner_token}"})[0] == 4404
    assert _run(f"{url}?after=abc", {"Authorization": f"Token {owner_token}"})[0] == 4400


def test_cookie_sessions_keep_the_origin_check(owner, finished_task, asgi_server):
    cookie = _session_cookie(owner, "owner-pass-123")
    url = f"ws://{asgi_server}/ws/tasks/{finished_task.pk}/events/"
    assert _run(url, {**cookie, **GOOD_ORIGIN})[0] == "open"
    # A page on another site opening a socket with the user's cookies (cross-site websocket hijacking).
    assert _run(url, {**cookie, **EVIL_ORIGIN})[0] == 4403
    assert _run(url, cookie)[0] == 4403  # no Origin: not a browser page of ours
    # A bogus token does not unlock the Origin check for the cookie session: it authenticates no one.
    assert _run(f"{url}?token=bogus", {**cookie, **EVIL_ORIGIN})[0] == 4401
    assert _run(url, {**cookie, **EVIL_ORIGIN, "Authorization": "Token bogus"})[0] == 4401


def test_notifications_socket_takes_a_token_without_origin(owner, asgi_server):
    token = api_token_get_or_create(user=owner)

    async def ping():
        async with websockets.connect(f"ws://{asgi_server}/ws/notifications/",
                                      additional_headers={"Authorization": f"Token {token}"}) as ws:
            # Open and authenticated: nothing is sent until an event; the socket stays open.
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(ws.recv(), timeout=1)
            return ws.state.name

    assert asyncio.run(ping()) == "OPEN"


def test_the_readme_client_follows_a_task_to_its_end(owner, finished_task, asgi_server, capsys):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    code = "\n".join(line for line in code.splitlines() if not line.startswith("print(asyncio.run("))
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # the snippet exactly as users copy it
    token = api_token_get_or_create(user=owner)
    status = asyncio.run(namespace["follow"](finished_task.pk, token, host=asgi_server))
    assert status["type"] == "status" and status["status"] == "succeeded"
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed] == ["0", "1", "2"]
