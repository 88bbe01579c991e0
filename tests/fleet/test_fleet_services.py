"""Heartbeats, lost-host detection and the live fleet stream against the real database and Redis."""

import asyncio
import json
import logging
import threading
import time
from datetime import timedelta

import pytest
import websockets
from django.utils import timezone

from sandboxes.fleet.heartbeat import HostHeartbeat, QueueMetrics, SandboxStatus
from webapp.accounts.services import api_token_get_or_create
from webapp.fleet.models import HostUtilisationSample, SandboxHost, SandboxRecord
from webapp.fleet.selectors import fleet_overview
from webapp.fleet.services import fleet_history_prune, host_heartbeat_record, hosts_mark_lost


def beat(name="node-a", sandboxes=(), **overrides):
    values = {
        "host_name": name, "backend": "local", "slots_total": 8, "slots_used": len(sandboxes),
        "cpu_percent": 42.0, "memory_percent": 30.0, "memory_used_mb": 2048.0, "sandboxes": tuple(sandboxes),
        "queue": QueueMetrics(product_waiting=1, training_waiting=3, admitted_total=7, wait_p50_s=0.1, wait_p95_s=0.5),
    }
    return HostHeartbeat(**(values | overrides))


@pytest.mark.django_db
def test_heartbeat_upserts_host_and_syncs_sandboxes(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        host_heartbeat_record(heartbeat=beat(sandboxes=[
            SandboxStatus("sb-1", "busy", "product"), SandboxStatus("sb-2", "idle", "training"),
        ]))
    assert len(callbacks) == 1  # the websocket event waits for the commit
    host = SandboxHost.objects.get(name="node-a")
    assert (host.state, host.slots_used, host.queue_product, host.queue_training) == ("alive", 2, 1, 3)
    assert dict(SandboxRecord.objects.values_list("sandbox_id", "state")) == {"sb-1": "busy", "sb-2": "idle"}

    host_heartbeat_record(heartbeat=beat(sandboxes=[SandboxStatus("sb-2", "busy", "training", 87.5, 120.0)], starting=3))
    records = dict(SandboxRecord.objects.values_list("sandbox_id", "state"))
    assert records == {"sb-1": "destroyed", "sb-2": "busy"}
    assert SandboxRecord.objects.get(sandbox_id="sb-1").ended_at is not None
    assert HostUtilisationSample.objects.filter(host=host).count() == 2

    overview = fleet_overview()
    [payload] = overview["hosts"]
    assert payload["sandboxes"] == [["sb-2", 2, 1, 87.5, 120.0]]  # busy, training, cpu, memory: live ones only
    assert overview["totals"]["queue_length"] == 4
    assert payload["starting"] == 3  # a fork in progress, not yet sandboxes with ids
    assert overview["totals"]["sandboxes_by_state"]["destroyed"] == 1


@pytest.mark.django_db
def test_silent_host_is_lost_with_its_sandboxes_and_comes_back():
    host_heartbeat_record(heartbeat=beat("node-a", [SandboxStatus("sb-1", "busy", "product")]))
    host_heartbeat_record(heartbeat=beat("node-b", [SandboxStatus("sb-9", "idle", "training")]))
    SandboxHost.objects.filter(name="node-a").update(last_heartbeat_at=timezone.now() - timedelta(seconds=30))

    assert hosts_mark_lost(stale_after_s=10) == ["node-a"]
    assert SandboxHost.objects.get(name="node-a").state == "lost"
    assert SandboxRecord.objects.get(sandbox_id="sb-1").state == "lost"
    assert SandboxRecord.objects.get(sandbox_id="sb-9").state == "idle"
    assert hosts_mark_lost(stale_after_s=10) == []

    # The host restarts: it is alive again, but a sandbox that was lost stays lost.
    host_heartbeat_record(heartbeat=beat("node-a", [SandboxStatus("sb-1", "idle", "product")]))
    assert SandboxHost.objects.get(name="node-a").state == "alive"
    assert SandboxRecord.objects.get(sandbox_id="sb-1").state == "lost"
    with pytest.raises(ValueError, match="must be positive"):
        hosts_mark_lost(stale_after_s=0)


def test_heartbeat_rejects_inconsistent_values():
    with pytest.raises(ValueError, match="exceeds slots_total"):
        beat(slots_total=1, sandboxes=[SandboxStatus("a", "idle", "training"), SandboxStatus("b", "idle", "training")])
    with pytest.raises(ValueError, match="not a sandbox state"):
        SandboxStatus("a", "running", "training")
    round_trip = HostHeartbeat.from_dict(beat(sandboxes=[SandboxStatus("a", "idle", "warm")]).to_dict())
    assert round_trip.sandboxes[0].purpose == "warm" and round_trip.queue.waiting == 4


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_gives_way_to_a_statement_that_locks_the_fleet_tables_one_by_one(caplog):
    """A test flush (TRUNCATE of every table, in an arbitrary order) deadlocked with a host's heartbeat:
    the heartbeat held the hosts table and waited for the records table, which the TRUNCATE held while
    it waited for the hosts table. Played here with explicit locks in that order."""
    from django.db import connection, transaction

    caplog.set_level(logging.INFO, logger="webapp.fleet.services")
    host_heartbeat_record(heartbeat=beat("node-a", [SandboxStatus("sb-1", "idle", "training")]))
    hosts, records = SandboxHost._meta.db_table, SandboxRecord._meta.db_table
    errors: list[BaseException] = []

    def heartbeat() -> None:
        try:
            host_heartbeat_record(heartbeat=beat("node-a", [SandboxStatus("sb-1", "busy", "training")]))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)
        finally:
            connection.close()

    beating = threading.Thread(target=heartbeat)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL lock_timeout = '20s'")
        cursor.execute(f"LOCK TABLE {records} IN ACCESS EXCLUSIVE MODE")
        beating.start()

        def heartbeat_blocked() -> bool:  # waiting on the records table (holding hosts), or given way
            cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = %s::regclass", [records])
            return cursor.fetchone()[0] > 0 or "fleet tables locked by another statement" in caplog.text

        deadline = time.monotonic() + 30
        while not heartbeat_blocked():
            assert time.monotonic() < deadline, "the heartbeat never reached the locked table"
            time.sleep(0.05)
        cursor.execute(f"LOCK TABLE {hosts} IN ACCESS EXCLUSIVE MODE")  # the flush's next table: no deadlock
    beating.join(timeout=30)
    assert not beating.is_alive() and errors == []
    assert SandboxRecord.objects.get(sandbox_id="sb-1").state == "busy"


@pytest.mark.django_db
def test_prune_drops_old_samples_and_ended_records():
    host_heartbeat_record(heartbeat=beat(sent_at=time.time() - 7200, sandboxes=[SandboxStatus("old", "idle", "training")]))
    host_heartbeat_record(heartbeat=beat())
    SandboxRecord.objects.filter(sandbox_id="old").update(ended_at=timezone.now() - timedelta(hours=2))
    assert fleet_history_prune(keep_samples_s=3600, keep_ended_sandboxes_s=3600) == 2
    assert HostUtilisationSample.objects.count() == 1 and not SandboxRecord.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_fleet_websocket_sends_overview_then_live_heartbeats(owner, asgi_server):
    host_heartbeat_record(heartbeat=beat("node-a"))
    token = api_token_get_or_create(user=owner)

    async def scenario():
        headers = {"Authorization": f"Token {token}", "Origin": "http://127.0.0.1"}
        async with websockets.connect(f"ws://{asgi_server}/ws/fleet/", additional_headers=headers) as ws:
            first = json.loads(await asyncio.wait_for(ws.recv(), timeout=15))
            await asyncio.to_thread(
                host_heartbeat_record, heartbeat=beat("node-b", [SandboxStatus("sb-7", "busy", "product")])
            )
            second = json.loads(await asyncio.wait_for(ws.recv(), timeout=15))
        return first, second

    first, second = asyncio.run(scenario())
    assert first["kind"] == "overview" and [h["name"] for h in first["overview"]["hosts"]] == ["node-a"]
    assert second["kind"] == "host" and second["host"]["name"] == "node-b"
    assert second["host"]["sandboxes"] == [["sb-7", 2, 0, 0.0, 0.0]]


@pytest.mark.django_db(transaction=True)
def test_fleet_websocket_and_page_refuse_anonymous(client, asgi_server):
    async def attempt():
        try:
            async with websockets.connect(f"ws://{asgi_server}/ws/fleet/", additional_headers={"Origin": "http://127.0.0.1"}) as ws:
                await asyncio.wait_for(ws.recv(), timeout=10)
        except websockets.ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd else None
        except websockets.InvalidStatus as exc:
            return exc.response.status_code

    assert asyncio.run(attempt()) in (4401, 403)
    response = client.get("/fleet/")
    assert response.status_code == 302 and "/login/" in response["Location"]


@pytest.mark.django_db
def test_fleet_monitor_command_marks_silent_hosts_lost():
    from io import StringIO

    from django.core.management import call_command

    host_heartbeat_record(heartbeat=beat("node-z"))
    SandboxHost.objects.filter(name="node-z").update(last_heartbeat_at=timezone.now() - timedelta(seconds=30))
    out = StringIO()
    call_command("fleet_monitor", "--once", "--lost-after", "10", stdout=out)
    assert out.getvalue() == "host node-z lost\n"
    assert SandboxHost.objects.get(name="node-z").state == "lost"


@pytest.mark.django_db
def test_fleet_api_needs_a_user_and_validates_the_window(api_client_for, outsider):
    host_heartbeat_record(heartbeat=beat("node-a", [SandboxStatus("sb-1", "busy", "product")]))
    assert api_client_for(None).get("/api/fleet/").status_code in (401, 403)
    response = api_client_for(outsider).get("/api/fleet/?window_s=60")
    assert response.status_code == 200
    body = response.json()
    assert body["overview"]["hosts"][0]["sandboxes"] == [["sb-1", 2, 0, 0.0, 0.0]]
    assert len(body["series"]["node-a"]) == 1
    bad = api_client_for(outsider).get("/api/fleet/?window_s=-5")
    assert bad.status_code == 400 and "window_s" in bad.json()


@pytest.mark.django_db
def test_heartbeat_records_the_hosts_runtime_for_the_fleet_page():
    host_heartbeat_record(heartbeat=beat("node-d", backend="docker", runtime="runsc"))
    host_heartbeat_record(heartbeat=beat("node-l"))
    hosts = {payload["name"]: payload for payload in fleet_overview()["hosts"]}
    assert (hosts["node-d"]["backend"], hosts["node-d"]["runtime"]) == ("docker", "runsc")
    assert (hosts["node-l"]["backend"], hosts["node-l"]["runtime"]) == ("local", "")
    again = HostHeartbeat.from_dict(beat("node-d", backend="docker", runtime="runc").to_dict())
    assert again.runtime == "runc"
