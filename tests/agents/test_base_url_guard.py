"""A task's base_url is attacker input: the worker may not be aimed at internal services, and the operator's
key goes only to the operator's server.

Each test starts a real HTTP listener on loopback, the way an attacker would point the worker at an
internal service (a port scan reads the status codes back from the task's failure), and checks what that
listener received: nothing, when the URL must be refused; the exact Authorization header, when it may be
reached.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading

import httpx2
import pytest
from django.test import Client

from training.agent.demo_repo import DEMO_PROMPT
from webapp.agents import services
from webapp.agents.models import AgentTask

pytestmark = pytest.mark.django_db

OPERATOR_KEY = "sk-operator-secret-key"


class Listener:
    """A loopback HTTP server recording every request; it answers ``status`` with an OpenAI-style error,
    or a redirect to ``redirect_to``."""

    def __init__(self, host: str = "127.0.0.1", *, port: int = 0, status: int = 404, redirect_to: str = "") -> None:
        self.requests: list[dict] = []
        listener = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                listener.requests.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
                if redirect_to:
                    self.send_response(307)
                    self.send_header("Location", redirect_to)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                payload = json.dumps({"error": {"message": "not here", "type": "invalid_request_error"}}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Listener:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _create(owner, repository, **extra):
    return services.task_create(owner=owner, prompt=DEMO_PROMPT, repository=repository, enqueue=False,
                                **{"backend": "openai", "model_name": "gpt-x", **extra})


def _run(task) -> AgentTask:
    services.task_run(task_id=task.pk)
    task.refresh_from_db()
    return task


@pytest.fixture
def no_internal_hosts(settings):
    settings.GIT_ALLOWED_HOSTS = []
    settings.OPENAI_BASE_URL = None
    settings.OPENAI_API_KEY = OPERATOR_KEY


@pytest.mark.parametrize("template", [
    "http://127.0.0.1:{port}/v1", "http://localhost:{port}/v1", "http://[::ffff:127.0.0.1]:{port}/v1",
    "http://0x7f000001:{port}/v1", "http://127.1:{port}/v1",
])
def test_submission_to_an_internal_address_is_refused_with_400_naming_base_url(
        owner, demo_repository, api_client_for, no_internal_hosts, template):
    with Listener() as listener:
        url = template.format(port=listener.port)
        response = api_client_for(owner).post("/api/tasks/", {
            "prompt": "Fix it", "backend": "openai", "model_name": "gpt-x", "base_url": url,
            "repository_id": demo_repository.pk}, format="json")
        assert response.status_code == 400, response.content
        body = response.json()
        assert set(body) == {"base_url"} and "internal address" in body["base_url"][0], body
        page = Client()
        page.force_login(owner)
        form = page.post("/tasks/", {"prompt": "Fix it", "backend": "openai", "model_name": "gpt-x", "base_url": url,
                                     "max_turns": 5, "max_tokens": 1000, "wall_time_s": 60,
                                     "repository": demo_repository.pk})
        assert "internal address" in form.content.decode()
    assert listener.requests == []
    assert not AgentTask.objects.exists()


@pytest.mark.parametrize("url", ["ftp://example.com/v1", "http://user:pw@example.com/v1", "file:///etc/passwd"])
def test_other_schemes_and_credentials_in_the_url_are_refused(owner, demo_repository, no_internal_hosts, url):
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError) as error:
        _create(owner, demo_repository, base_url=url)
    assert set(error.value.message_dict) == {"base_url"}


def test_an_edited_row_is_refused_when_the_task_runs_and_nothing_is_sent(owner, demo_repository, settings,
                                                                         no_internal_hosts):
    task = _create(owner, demo_repository, base_url="https://8.8.8.8/v1")  # public: accepted, never called
    with Listener() as listener:
        # The submission check passed; the row now names an internal service (or DNS now answers one).
        AgentTask.objects.filter(pk=task.pk).update(base_url=listener.url)
        task = _run(task)
    assert listener.requests == []
    assert task.status == "failed"
    assert "base_url host '127.0.0.1' resolves to an internal address" in task.status_reason
    assert "404" not in task.status_reason


def test_a_user_url_never_gets_the_operators_key(owner, demo_repository, settings, no_internal_hosts):
    settings.GIT_ALLOWED_HOSTS = ["127.0.0.1"]  # this listener may be reached: what does it receive?
    settings.OPENAI_BASE_URL = "https://api.example.com/v1"
    with Listener() as listener:
        _run(_create(owner, demo_repository, base_url=listener.url))
        _run(_create(owner, demo_repository, base_url=listener.url, api_key="sk-users-own"))
    assert listener.requests, "the allow-listed server should have been called"
    keyless = [r for r in listener.requests if "sk-users-own" not in r["headers"].get("authorization", "")]
    assert keyless, listener.requests
    for request in keyless:
        assert "authorization" not in request["headers"], request["headers"]
    for request in listener.requests:
        assert OPERATOR_KEY not in json.dumps(request["headers"]) and OPERATOR_KEY.encode() not in request["body"]
    assert any(r["headers"].get("authorization") == "Bearer sk-users-own" for r in listener.requests)


def test_the_operators_server_gets_the_operators_key(owner, demo_repository, settings, no_internal_hosts):
    with Listener() as listener:
        settings.OPENAI_BASE_URL = listener.url  # the operator's own (internal) server: not the user's choice
        task = _run(_create(owner, demo_repository))
    assert task.base_url == listener.url
    assert listener.requests and all(r["headers"].get("authorization") == f"Bearer {OPERATOR_KEY}"
                                     for r in listener.requests)


def test_redirects_are_not_followed_to_another_server(owner, demo_repository, settings, no_internal_hosts):
    settings.GIT_ALLOWED_HOSTS = ["127.0.0.1"]
    with Listener("127.0.0.2") as hidden, Listener(redirect_to=f"{hidden.url}/chat/completions") as redirector:
        task = _run(_create(owner, demo_repository, base_url=redirector.url))
    assert redirector.requests and hidden.requests == []
    assert task.status == "failed"


def test_the_connection_goes_to_the_address_checked_even_if_dns_changes(monkeypatch):
    """DNS rebinding: the name resolves to one address when checked and another when connecting."""
    from sandboxes.outbound import pinned_http_client

    real = socket.getaddrinfo
    answer = {"address": "127.0.0.1"}

    def resolver(host, port, *args, **kwargs):
        if host == "rebind.test":
            return real(answer["address"], port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    with Listener("127.0.0.1", status=200) as checked, Listener("127.0.0.2", port=checked.port, status=200) as rebound:
        client = pinned_http_client(f"http://rebind.test:{checked.port}/v1", label="base_url",
                                    hosts_allowed=frozenset({"rebind.test"}))
        answer["address"] = "127.0.0.2"  # what a rebinding DNS server answers next
        assert client.post(f"http://rebind.test:{checked.port}/v1/chat/completions", json={}).status_code == 200
        with pytest.raises(httpx2.ConnectError, match="may only reach"):
            client.post(f"http://127.0.0.2:{checked.port}/v1/chat/completions", json={})
    assert len(checked.requests) == 1 and rebound.requests == []
    assert checked.requests[0]["headers"]["host"] == f"rebind.test:{checked.port}"


def test_openai_backend_cannot_target_this_servers_own_v1(owner, demo_repository, api_client_for, settings,
                                                          no_internal_hosts):
    settings.GIT_ALLOWED_HOSTS = ["testserver", "127.0.0.1"]  # even where loopback is allow-listed for git
    response = api_client_for(owner).post("/api/tasks/", {
        "prompt": "Fix it", "backend": "openai", "model_name": "someone-elses-model", "base_url": "http://testserver/v1",
        "repository_id": demo_repository.pk}, format="json")
    assert response.status_code == 400 and "backend=builtin" in response.json()["base_url"][0]


def test_the_host_headers_port_cannot_aim_a_builtin_task_at_another_local_service(
        owner, demo_repository, api_client_for, settings, no_internal_hosts):
    settings.AGENT_BUILTIN_BASE_URL = None
    settings.MODEL_CHECKPOINT = "/configured/checkpoint"
    with Listener() as listener:
        # Django checks the Host header's name against ALLOWED_HOSTS, but not its port.
        response = api_client_for(owner).post("/api/tasks/", {
            "prompt": "Fix it", "backend": "builtin", "repository_id": demo_repository.pk}, format="json",
            HTTP_HOST=f"127.0.0.1:{listener.port}")
        assert response.status_code == 201, response.content
        task = AgentTask.objects.get(pk=response.json()["id"])
        assert str(listener.port) not in task.base_url and task.base_url == "http://127.0.0.1/v1"
        _run(task)
    assert listener.requests == []


def test_the_next_checked_address_is_tried_when_one_does_not_connect(monkeypatch):
    """A host with several addresses (IPv6 and IPv4, say) still works where one of them is unreachable."""
    from sandboxes.outbound import pinned_http_client

    real = socket.getaddrinfo

    def resolver(host, port, *args, **kwargs):
        if host == "multi.test":
            return real("127.0.0.1", port, *args, **kwargs) + real("127.0.0.3", port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    with Listener("127.0.0.3", status=200) as second:  # nothing listens on 127.0.0.1 at this port
        client = pinned_http_client(f"http://multi.test:{second.port}/v1", label="base_url",
                                    hosts_allowed=frozenset({"multi.test"}))
        assert client.post(f"http://multi.test:{second.port}/v1/chat/completions", json={}).status_code == 200
    assert len(second.requests) == 1
