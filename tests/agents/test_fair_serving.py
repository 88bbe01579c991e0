"""The shared model server under a flooding user: the real ASGI server and a real (random-weights) checkpoint.

A victim's short request must finish within a small bound while another user's many long generations run,
and the flooder's requests past its /v1 limits get OpenAI's 429 with Retry-After and the limit's name while
the victim is served."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from training.serving_scheduler import FairAdmission
from webapp.accounts.services import api_token_get_or_create

MESSAGES = [{"role": "user", "content": "Say hello."}]
VICTIM_BOUND_S = 8.0
"""Most a victim's 4-token request may take during the flood (alone it takes well under a second; first
come, first served it waits for most of the flood's 64 long choices)."""


pytestmark = pytest.mark.usefixtures("fresh_limit_keys")


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    from training.checkpoint import create_random_checkpoint

    return create_random_checkpoint(tmp_path_factory.mktemp("fair-ckpt"), size="tiny", seed=1, max_seq_len=4096)


@pytest.fixture
def server_env(checkpoint_dir, settings, monkeypatch):
    """The checkpoint and the /v1 limits of the server child process (started after this fixture)."""
    monkeypatch.setenv("FLOWSTATE_MODEL_CHECKPOINT", str(checkpoint_dir))
    settings.MODEL_CHECKPOINT = str(checkpoint_dir)
    monkeypatch.setenv("FLOWSTATE_USER_MAX_V1_CONCURRENT", "4")
    monkeypatch.setenv("FLOWSTATE_USER_MAX_V1_TOKENS_PER_MINUTE", "1000000")
    return monkeypatch


@pytest.fixture
def tight_tokens_env(server_env):
    server_env.setenv("FLOWSTATE_USER_MAX_V1_TOKENS_PER_MINUTE", "300")


def _post(address: str, token: str, **body) -> httpx.Response:
    return httpx.post(f"http://{address}/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
                      json={"model": "flowstate", "messages": MESSAGES, **body}, timeout=120)


class Flood:
    """`streams` streaming requests of n=16 long choices each, held open until stop() (which closes them,
    cancelling their generation). Starts once one of them is generating and the others had time to arrive
    (their first chunk comes only when a slot is free for them)."""

    def __init__(self, address: str, token: str, *, streams: int, max_tokens: int) -> None:
        self.generating = threading.Event()
        self.stopping = threading.Event()
        self.finished_early: list[int] = []
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self._one, args=(address, token, max_tokens, i), daemon=True)
                        for i in range(streams)]
        for thread in self.threads:
            thread.start()
        assert self.generating.wait(timeout=120), "the flood did not start"
        time.sleep(1.0)

    def _one(self, address: str, token: str, max_tokens: int, number: int) -> None:
        body = {"model": "flowstate", "messages": MESSAGES, "n": 16, "max_tokens": max_tokens, "stream": True}
        with httpx.stream("POST", f"http://{address}/v1/chat/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {token}"}) as response:
            self.statuses.append(response.status_code)
            lines = response.iter_lines()
            for line in lines:  # the first chunk: this request is being generated
                if line.startswith("data:"):
                    break
            self.generating.set()
            for line in lines:
                if self.stopping.is_set():
                    return
                if line == "data: [DONE]":
                    self.finished_early.append(number)
                    return

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=60)


@pytest.mark.django_db(transaction=True)
def test_a_victims_short_request_is_not_held_up_by_a_flood(server_env, owner, outsider, asgi_server):
    flooder, victim = api_token_get_or_create(user=owner), api_token_get_or_create(user=outsider)
    assert _post(asgi_server, victim, max_tokens=4).status_code == 200  # warm: the model is loaded
    flood = Flood(asgi_server, flooder, streams=4, max_tokens=800)
    try:
        started = time.monotonic()
        answer = _post(asgi_server, victim, max_tokens=4, temperature=0)
        took = time.monotonic() - started
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] >= 1
        assert took < VICTIM_BOUND_S, f"the victim waited {took:.1f}s behind the flood"
        assert not flood.finished_early, "the flood ended before the victim was measured: make it longer"
    finally:
        flood.stop()
    assert set(flood.statuses) <= {200}


@pytest.mark.django_db(transaction=True)
def test_the_flooders_requests_past_its_concurrency_limit_get_429(server_env, owner, outsider, asgi_server):
    flooder, victim = api_token_get_or_create(user=owner), api_token_get_or_create(user=outsider)
    flood = Flood(asgi_server, flooder, streams=4, max_tokens=800)
    try:
        refused = _post(asgi_server, flooder, max_tokens=4)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        error = refused.json()["error"]
        assert error["limit"] == "v1_concurrent_requests" and error["code"] == "rate_limit_exceeded"
        assert "v1_concurrent_requests" in error["message"]
        assert _post(asgi_server, victim, max_tokens=4).status_code == 200
    finally:
        flood.stop()
    # Closed streams give their places back.
    deadline = time.monotonic() + 30
    while (answer := _post(asgi_server, flooder, max_tokens=4)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert answer.status_code == 200, answer.text


@pytest.mark.django_db(transaction=True)
def test_the_flooders_requests_past_its_tokens_per_minute_get_429(tight_tokens_env, owner, outsider, asgi_server):
    flooder, victim = api_token_get_or_create(user=owner), api_token_get_or_create(user=outsider)
    assert _post(asgi_server, flooder, max_tokens=8).status_code == 200
    refused = _post(asgi_server, flooder, n=2, max_tokens=200)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["limit"] == "v1_tokens_per_minute" and error["type"] == "tokens"
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert _post(asgi_server, victim, n=2, max_tokens=100).status_code == 200


def test_fair_admission_shares_slots_round_robin_and_keeps_a_slot_for_newcomers():
    admission: FairAdmission[str] = FairAdmission(4, reserved_slots=1)
    flood = [f"f{i}" for i in range(10)]
    for request in flood:
        admission.add("flooder", request)
    assert [request for _, request in admission.admit()] == ["f0", "f1", "f2"]  # the last slot is kept
    admission.add("victim", "v0")
    admission.add("victim", "v1")
    assert [request for _, request in admission.admit()] == ["v0"]
    admission.released("flooder")
    assert list(admission.admit()) == []  # the one free slot is kept for owners holding none
    admission.add("newcomer", "n0")
    assert [request for _, request in admission.admit()] == ["n0"]
    admission.released("newcomer")
    admission.released("flooder")
    # Two free slots, both owners hold one: the one served least recently goes first, one slot stays kept.
    assert [request for _, request in admission.admit()] == ["f3"]
    admission.released("flooder")
    assert [request for _, request in admission.admit()] == ["v1"]
    assert admission.discard("flooder", flood[9]) and not admission.discard("flooder", flood[9])
    assert admission.drain() == [f"f{i}" for i in range(4, 9)] and not admission.has_waiting()
    lone: FairAdmission[str] = FairAdmission(3)
    for i in range(4):
        lone.add(None, f"r{i}")
    assert [request for _, request in lone.admit()] == ["r0", "r1", "r2"]  # no reserve: every slot is used
