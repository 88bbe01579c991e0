"""Request bodies over the limit are refused with 413 before they are read, whoever sends them.

The real ASGI app runs under uvicorn on a loopback port, with a temp dir of its own and small limits
(1 MiB in general, 2 MiB + 64 KiB for archive uploads), and is attacked the way a disk-filling client
would: a huge declared Content-Length, and an endless chunked stream, anonymous and with an API token.
While a body streams in, the server process's temporary files (in its temp dir, or open there and
already deleted, as Python's spooled files are) are measured.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, _free_port, _test_database_env, _wait_for_port
from webapp.server_command import asgi_server_command

GENERAL_LIMIT = 1024 * 1024
UPLOAD_LIMIT = 2 * 1024 * 1024 + 64 * 1024
CHUNK = 1024 * 1024


@pytest.fixture(scope="module")
def limited_server(django_db_setup, tmp_path_factory):
    """One server for the module (on the test database); each test's rows are its own (transactional_db)."""
    temp = tmp_path_factory.mktemp("server-tmp")
    env = {**_test_database_env(), "TMPDIR": str(temp), "FLOWSTATE_MAX_REQUEST_BYTES": str(GENERAL_LIMIT),
           "FLOWSTATE_MAX_UPLOAD_BYTES": str(2 * 1024 * 1024), "FLOWSTATE_UPLOAD_FORM_BYTES": str(64 * 1024)}
    port = _free_port()
    proc = subprocess.Popen(asgi_server_command(host="127.0.0.1", port=port, log_level="warning"), cwd=ROOT, env=env)
    try:
        _wait_for_port(port, proc)
        yield port, proc.pid, temp
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _temp_bytes(pid: int, temp: Path) -> int:
    """Bytes of the server's temporary files: those in its temp dir and those open there but deleted."""
    total = sum(path.stat().st_size for path in temp.rglob("*") if path.is_file())
    fds = Path(f"/proc/{pid}/fd")
    for fd in fds.iterdir():
        try:
            if os.readlink(fd).startswith(str(temp)):
                total += os.stat(fd).st_size
        except OSError:
            continue  # closed meanwhile
    return total


def _headers(path: str, token: str | None, extra: str) -> bytes:
    auth = f"Authorization: Token {token}\r\n" if token else ""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n{auth}{extra}"
            "\r\n").encode()


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            part = sock.recv(65536)
            if not part:
                break
            data += part
    except ConnectionResetError:
        pass  # the server closed with the body unread: what it answered before is in `data`
    return data


def _declared(port: int, path: str, token: str | None, length: int, body: bytes = b"") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(_headers(path, token, f"Content-Length: {length}\r\n") + body)
        return _read_response(sock)


def _streamed(port: int, pid: int, temp: Path, path: str, token: str | None, total_mb: int) -> tuple[bytes, int, int]:
    """Send ``total_mb`` MiB in chunks while reading the answer; (answer, MiB sent, most temp bytes seen)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(_headers(path, token, "Transfer-Encoding: chunked\r\n"))
    sent, most, done = [0], [0], threading.Event()

    def pump() -> None:
        chunk = b"%x\r\n" % CHUNK + b"y" * CHUNK + b"\r\n"
        try:
            for _ in range(total_mb):
                sock.sendall(chunk)
                sent[0] += 1
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server stopped reading and closed the connection

    def watch() -> None:
        while not done.is_set():
            most[0] = max(most[0], _temp_bytes(pid, temp))
            time.sleep(0.005)

    threads = [threading.Thread(target=pump), threading.Thread(target=watch)]
    for thread in threads:
        thread.start()
    try:
        answer = _read_response(sock)
    finally:
        threads[0].join(60)
        done.set()
        threads[1].join(10)
        sock.close()
    return answer, sent[0], most[0]


@pytest.fixture
def token(transactional_db, owner):
    from webapp.accounts.services import api_token_get_or_create

    return api_token_get_or_create(user=owner)


@pytest.mark.parametrize("path, authenticated", [("/healthz", False), ("/api/tasks/", True), ("/api/tasks/", False),
                                                 ("/api/tasks/1/cancel/", True)])
def test_a_declared_oversized_body_is_refused_before_it_is_read(limited_server, token, path, authenticated):
    port, pid, temp = limited_server
    # Only the headers are sent: a server that waited for the 400 MB would not answer within the timeout.
    answer = _declared(port, path, token if authenticated else None, 400 * 1024 * 1024)
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    assert b"connection: close" in answer.lower()
    assert _temp_bytes(pid, temp) == 0


@pytest.mark.parametrize("path, authenticated", [("/healthz", False), ("/api/tasks/", True), ("/api/tasks/", False),
                                                 ("/api/repositories/", True)])
def test_a_streamed_oversized_body_is_cut_off_and_never_reaches_the_disk(limited_server, token, path,
                                                                        authenticated):
    port, pid, temp = limited_server
    answer, sent_mb, most_temp = _streamed(port, pid, temp, path, token if authenticated else None, total_mb=48)
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    assert sent_mb < 48, "the server read the whole stream"
    assert most_temp == 0, f"the server spooled {most_temp} bytes to its temp dir"


def test_the_archive_upload_endpoints_take_the_larger_limit_and_only_they(limited_server, token):
    port, _, _ = limited_server
    body = b"z" * (GENERAL_LIMIT + CHUNK // 2)  # over the general limit, within the upload one
    upload = _declared(port, "/api/repositories/", token, len(body), body)
    assert upload.startswith(b"HTTP/1.1 415 "), upload  # read and answered by the view: not an archive form
    other = _declared(port, "/api/tasks/1/followups/", token, len(body), body)
    assert other.startswith(b"HTTP/1.1 413 "), other
    over = _declared(port, "/api/repositories/", token, UPLOAD_LIMIT + 1)
    assert over.startswith(b"HTTP/1.1 413 "), over


def test_bodies_within_the_limit_are_served_as_before(limited_server, token):
    port, _, _ = limited_server
    body = b'{"prompt": ""}'
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"POST /api/tasks/ HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Authorization: Token {token}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert _read_response(sock).startswith(b"HTTP/1.1 400 ")  # the API's own validation answers
