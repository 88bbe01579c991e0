"""The fleet on a real local Ray: host actors own sandboxes, queue when full, heartbeat into the database."""

from __future__ import annotations

import threading
import time

import pytest

from sandboxes.base import RepoSource, SandboxError, SandboxGone, SandboxLimits

LIMITS = SandboxLimits(command_timeout_s=20, lifetime_s=300, memory_mb=512)


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=1, resources={"sandbox_slots": 2}, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def start_fleet(ray_session):
    """Fleet.start, with the host actors killed when the test ends, passed or not.

    A failed test would otherwise leave its named host actor alive for the next test (which then
    cannot start a host of that name) and heartbeating into the database while it is being flushed.
    """
    from sandboxes.fleet.client import Fleet

    fleets = []

    def start(config):
        fleets.append(Fleet.start(config))
        return fleets[-1]

    yield start
    for fleet in fleets:
        fleet.follow_stop()  # or it would place a host again on the node emptied below
        for host in fleet.hosts.values():
            ray_session.kill(host.actor)  # a no-op for an actor the test already killed


# Generous: a host actor on a loaded 2-core machine can take many seconds to import Django and beat.
def _wait_for(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.django_db(transaction=True)
def test_fleet_queues_prioritises_heartbeats_and_loses_hosts(ray_session, start_fleet, tmp_path):
    from sandboxes.fleet.client import FleetConfig
    from sandboxes.tools import ToolCall
    from tests.conftest import _test_database_env
    from webapp.fleet.models import SandboxHost, SandboxRecord
    from webapp.fleet.services import hosts_mark_lost

    env = _test_database_env()
    fleet = start_fleet(FleetConfig(backend="local", heartbeat_interval_s=0.5,
                                    env={"DATABASE_URL": env["DATABASE_URL"], "REDIS_URL": env["REDIS_URL"]}))
    [host] = fleet.hosts.values()
    assert host.slots == 2  # capacity is the node's sandbox_slots resource
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    snapshot = fleet.snapshot_create(source=RepoSource(kind="path", location=str(repo)))

    first, second = fleet.sandbox_fork(snapshot=snapshot, count=2, limits=LIMITS, purpose="training", tenant="exp-1")
    assert first.exec("cat calc.py").stdout.startswith("def add")
    [edit, read] = first.run_tools([
        ToolCall(id="c1", name="edit_file", arguments={"path": "calc.py", "old_str": "a + b", "new_str": "a - b"}),
        ToolCall(id="c2", name="read_file", arguments={"path": "calc.py"}),
    ])
    assert edit.ok and read.ok and "a - b" in read.output
    assert "-    return a + b" in first.diff() and second.diff() == ""

    # The host is full: further requests wait (they do not fail), product ahead of training.
    finished: list[str] = []

    def request(purpose, label):
        sandbox = fleet.sandbox_create(snapshot=snapshot, limits=LIMITS, purpose=purpose, tenant=label)
        finished.append(label)
        return sandbox

    results: dict[str, object] = {}
    training = threading.Thread(target=lambda: results.setdefault("training", request("training", "exp-2")))
    training.start()
    _wait_for(lambda: ray_session.get(host.actor.load.remote())["waiting"] == 1, what="training request queued")
    product = threading.Thread(target=lambda: results.setdefault("product", request("product", "user-7")))
    product.start()
    _wait_for(lambda: ray_session.get(host.actor.load.remote())["waiting"] == 2, what="product request queued")

    # Heartbeats reach the database through the service, with states, purposes and the queue.
    def beat_shows_queue():
        row = SandboxHost.objects.filter(name=host.name).first()
        return row if row and row.queue_product == 1 and row.queue_training == 1 else None

    row = _wait_for(beat_shows_queue, what="heartbeat with the queue")
    assert (row.state, row.slots_total, row.slots_used, row.backend) == ("alive", 2, 2, "local")
    assert set(SandboxRecord.objects.filter(state__in=["idle", "busy"]).values_list("sandbox_id", flat=True)) == {
        first.id, second.id}

    second.destroy()
    product.join(timeout=20)
    assert finished == ["user-7"]  # the product request got the freed slot first
    first.destroy()
    training.join(timeout=20)
    assert finished == ["user-7", "exp-2"]
    product_sandbox = results["product"]
    assert product_sandbox.exec("echo ok").stdout == "ok\n"
    _wait_for(lambda: SandboxRecord.objects.filter(sandbox_id=product_sandbox.id, purpose="product").exists(),
              what="product sandbox recorded")
    assert SandboxRecord.objects.get(sandbox_id=first.id).state == "destroyed"
    with pytest.raises(SandboxError, match="not on host"):
        first.exec("true")

    # The host dies without a goodbye: its heartbeats stop, and it is declared lost with its sandboxes.
    ray_session.kill(host.actor)
    time.sleep(2.0)
    assert hosts_mark_lost(stale_after_s=1.5) == [host.name]
    assert SandboxHost.objects.get(name=host.name).state == "lost"
    with pytest.raises(SandboxGone, match="lost with its host"):  # infrastructure failure, not a zero reward
        product_sandbox.exec("echo hello")
    assert set(SandboxRecord.objects.filter(state="lost").values_list("sandbox_id", flat=True)) == {
        product_sandbox.id, results["training"].id}


@pytest.mark.django_db(transaction=True)
def test_clean_shutdown_marks_host_stopped(start_fleet):
    from sandboxes.fleet.client import Fleet, FleetConfig
    from tests.conftest import _test_database_env
    from webapp.fleet.models import SandboxHost

    env = _test_database_env()
    fleet = start_fleet(FleetConfig(backend="local", heartbeat_interval_s=0.2,
                                    env={"DATABASE_URL": env["DATABASE_URL"], "REDIS_URL": env["REDIS_URL"]}))
    [host] = fleet.hosts.values()
    _wait_for(lambda: SandboxHost.objects.filter(name=host.name).exists(), what="first heartbeat")
    # Another driver in the cluster reaches the same hosts by name.
    attached = Fleet.connect()
    assert list(attached.hosts) == [host.name] and attached.hosts[host.name].slots == 2
    with pytest.raises(SandboxError, match="exceed the largest host"):
        fleet.sandbox_fork(snapshot=None, count=3, limits=LIMITS)
    assert fleet.shutdown() == 0
    assert SandboxHost.objects.get(name=host.name).state == "stopped"
