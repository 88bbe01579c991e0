"""Credentials in URLs never reach the ASGI server's log: the real server command (uvicorn, the
log configuration `make run` uses) at info level, requests with ``?token=`` as a websocket client
sends them (a browser cannot set headers on a websocket), and the log read back afterwards."""

from __future__ import annotations

import asyncio
import subprocess
import time
import urllib.error
import urllib.request

import pytest
import websockets

from tests.conftest import ROOT, _free_port, _test_database_env, _wait_for_port
from webapp.accounts.services import api_token_get_or_create
from webapp.server_command import asgi_server_command, redact

pytestmark = pytest.mark.django_db(transaction=True)


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


async def _websocket(url: str) -> object:
    try:
        async with websockets.connect(url, open_timeout=10) as ws:
            await asyncio.wait_for(ws.recv(), timeout=10)
            return "open"
    except websockets.exceptions.ConnectionClosed as closed:
        return closed.rcvd.code if closed.rcvd else None
    except websockets.exceptions.InvalidStatus as refused:
        return refused.response.status_code


def test_query_string_credentials_are_redacted_in_the_servers_log(owner, tmp_path):
    real_token = api_token_get_or_create(user=owner)
    port = _free_port()
    log_path = tmp_path / "uvicorn.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(asgi_server_command(host="127.0.0.1", port=port, log_level="info"), cwd=ROOT,
                                  env=_test_database_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_port(port, server)
        base = f"127.0.0.1:{port}"
        _get(f"http://{base}/login/?token=secret-in-http&x=1")  # any status: the request line is logged
        _get(f"http://{base}/no-such-page/?access_token=secret-access&api_key=secret-key")
        # A refused and an accepted websocket: uvicorn logs both paths with their query strings.
        asyncio.run(_websocket(f"ws://{base}/ws/tasks/1/events/?after=0&token=secret-in-ws"))
        assert asyncio.run(_websocket(f"ws://{base}/ws/tasks/1/events/?token={real_token}")) is not None
        time.sleep(0.5)  # the access log line is written after the response
    finally:
        server.terminate()
        server.wait(timeout=15)
    log = log_path.read_text(errors="replace")
    assert "GET /login/?token=[redacted]&x=1" in log, log  # the request is still logged, usefully
    assert "WebSocket /ws/tasks/1/events/?after=0&token=[redacted]" in log, log
    for secret in ("secret-in-http", "secret-access", "secret-key", "secret-in-ws", real_token):
        assert secret not in log, f"{secret!r} is in the server's log:\n{log}"


@pytest.mark.parametrize(("line", "expected"), [
    ("/ws/x/?token=abc", "/ws/x/?token=[redacted]"),
    ("/a?after=3&TOKEN=abc&b=2", "/a?after=3&TOKEN=[redacted]&b=2"),
    ('"GET /p?auth_token=abc HTTP/1.1" 200', '"GET /p?auth_token=[redacted] HTTP/1.1" 200'),
    ("/p?password=hunter2;next=/", "/p?password=[redacted];next=/"),
    ("/p?tokenizer_only=1", "/p?tokenizer_only=1"),
])
def test_redact_rewrites_only_credential_parameters(line, expected):
    assert redact(line) == expected
