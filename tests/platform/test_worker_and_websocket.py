"""Real processes end to end: a task sent from the web process runs in a Celery worker child and
writes to the real database; the event it publishes after commit crosses the real Redis channel
layer to a websocket client connected to the ASGI server child."""

import asyncio
import json
import uuid

import pytest
import websockets
from django.conf import settings

from webapp.accounts.services import api_token_get_or_create


@pytest.mark.django_db(transaction=True)
def test_task_runs_in_real_worker_and_writes_database(celery_worker_process):
    from webapp.core.models import WorkerProbe
    from webapp.core.tasks import worker_probe

    nonce = uuid.uuid4().hex
    result = worker_probe.delay(nonce)
    pk = result.get(timeout=30)
    probe = WorkerProbe.objects.get(pk=pk)
    assert probe.nonce == nonce
    assert probe.worker_pid == celery_worker_process.pid  # ran in the worker, not here
    from django_celery_results.models import TaskResult

    stored = TaskResult.objects.get(task_id=result.id)
    assert stored.status == "SUCCESS"  # results live in the database


@pytest.mark.django_db(transaction=True)
def test_worker_event_reaches_websocket_client(owner, asgi_server, celery_worker_process):
    from webapp.core.tasks import worker_probe

    token = api_token_get_or_create(user=owner)
    nonce = uuid.uuid4().hex

    async def scenario():
        async with websockets.connect(
            f"ws://{asgi_server}/ws/notifications/", additional_headers={"Authorization": f"Token {token}", "Origin": "http://127.0.0.1"}
        ) as ws:
            # The group subscription happens during the handshake, so the send cannot race it.
            await asyncio.to_thread(lambda: worker_probe.delay(nonce, owner.pk).get(timeout=30))
            message = json.loads(await asyncio.wait_for(ws.recv(), timeout=15))
            return message

    message = asyncio.run(scenario())
    assert message["kind"] == "worker_probe"
    assert message["nonce"] == nonce
    assert message["worker_pid"] == celery_worker_process.pid
    assert settings.CHANNEL_LAYERS["default"]["BACKEND"] == "channels_redis.core.RedisChannelLayer"


@pytest.mark.django_db(transaction=True)
def test_websocket_refuses_anonymous_and_bad_tokens(asgi_server):
    async def attempt(headers):
        try:
            async with websockets.connect(f"ws://{asgi_server}/ws/notifications/", additional_headers=headers) as ws:
                await asyncio.wait_for(ws.recv(), timeout=5)
        except websockets.exceptions.ConnectionClosed as closed:
            return closed.rcvd.code if closed.rcvd else None
        except websockets.exceptions.InvalidStatus as refused:
            return refused.response.status_code
        return "open"

    origin = {"Origin": "http://127.0.0.1"}
    assert asyncio.run(attempt(origin)) == 4401
    assert asyncio.run(attempt({**origin, "Authorization": "Token not-a-real-token"})) == 4401


@pytest.mark.django_db(transaction=True)
def test_websocket_events_stay_with_their_user(owner, outsider, asgi_server, celery_worker_process):
    from webapp.core.tasks import worker_probe

    outsider_token = api_token_get_or_create(user=outsider)

    async def scenario():
        async with websockets.connect(
            f"ws://{asgi_server}/ws/notifications/", additional_headers={"Authorization": f"Token {outsider_token}", "Origin": "http://127.0.0.1"}
        ) as ws:
            await asyncio.to_thread(lambda: worker_probe.delay(uuid.uuid4().hex, owner.pk).get(timeout=30))
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(ws.recv(), timeout=2)

    asyncio.run(scenario())
