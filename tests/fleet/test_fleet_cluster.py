"""The fleet on a Ray cluster of several nodes (Ray's own multi-node test cluster, on this machine).

Nodes are tiny (1 CPU, the smallest object store) and each offers its own ``sandbox_slots``: the head
1, two workers 2 each. The tests share the cluster and run in order: placement on every node and the
fleet API showing them all; a node that joins mid-burst getting a host from the fleet's own follower
(``Fleet.start`` follows the cluster, as an experiment driver's fleet does) and taking work, then
leaving (its host and sandboxes lost within 10 s, queued work going elsewhere); a product task whose
sandbox host leaves.

The hosts heartbeat into the test database while each test's flush truncates it: the heartbeat
takes the fleet tables' locks all at once or gives way (``webapp.fleet.services._fleet_tables_lock``),
so a flush never deadlocks with it.
"""

from __future__ import annotations

import threading
import time

import pytest

from sandboxes.base import RepoSource, SandboxGone, SandboxLimits

LIMITS = SandboxLimits(command_timeout_s=20, lifetime_s=300, memory_mb=256)
NODE = {"num_cpus": 1, "object_store_memory": 78 * 2**20}
HOSTS_DB_APP = "flowstate-fleet-cluster-test"  # application_name of the host actors' database sessions


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "resources": {"sandbox_slots": 1}})
    for _ in range(2):  # the two nodes start side by side; wait_for_nodes waits for both
        cluster.add_node(wait=False, **NODE, resources={"sandbox_slots": 2})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    path = tmp_path_factory.mktemp("fleet-cluster") / "repo"
    path.mkdir()
    (path / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    return path


@pytest.fixture(scope="module")
def fleet(cluster, django_db_setup, django_db_blocker):
    """One host per node, heartbeating into the test database; every host stopped at the end.

    Started like an experiment driver's own fleet (``Fleet.start``, which follows the cluster: nodes
    that join get a host); placing clients do not refresh by themselves (``refresh_interval_s=0``).
    """
    from sandboxes.fleet.client import Fleet, FleetConfig
    from tests.conftest import _test_database_env

    with django_db_blocker.unblock():
        env = _test_database_env()
    database_url = f"{env['DATABASE_URL']}?application_name={HOSTS_DB_APP}"
    fleet = Fleet.start(FleetConfig(backend="local", heartbeat_interval_s=0.5, refresh_interval_s=0,
                                    follow_interval_s=0.5,
                                    env={"DATABASE_URL": database_url, "REDIS_URL": env["REDIS_URL"]}))
    yield fleet
    fleet.shutdown()  # destroys what a failed test left, sends each host's last heartbeat
    with django_db_blocker.unblock():
        from django.db import connection

        from webapp.fleet.models import SandboxHost

        with connection.cursor() as cursor:
            # The stopped hosts' processes keep their database sessions until Ray reaps them, and the
            # test database is dropped at the end: end those sessions now instead of waiting.
            cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                           "WHERE datname = current_database() AND application_name = %s", [HOSTS_DB_APP])
        # The hosts' last heartbeats came after the last test's flush: remove them, or the next module's
        # tests find these hosts beside their own.
        SandboxHost.objects.all().delete()
        connection.close()


def _wait_for(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _host_on(fleet, node) -> str:
    """The host the fleet's follower placed on ``node`` (a node that joined), once it takes work."""
    return _wait_for(lambda: next((name for name, host in fleet.hosts.items() if host.node_id == node.node_id), None),
                     timeout=120, what="the fleet's follower to place a host on the node that joined")


@pytest.mark.django_db(transaction=True)
def test_one_host_per_node_sandboxes_spread_and_the_api_lists_every_host(cluster, fleet, repo, owner,
                                                                           api_client_for):
    from webapp.fleet.models import SandboxHost

    assert len(fleet.hosts) == 3
    assert len({host.node_id for host in fleet.hosts.values()}) == 3
    assert sorted(host.slots for host in fleet.hosts.values()) == [1, 2, 2]
    snapshot = fleet.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
    sandboxes = [fleet.sandbox_create(snapshot=snapshot, limits=LIMITS) for _ in range(3)]
    # Least loaded first: three sandboxes land on three hosts (one per node).
    assert len({sandbox.host_name for sandbox in sandboxes}) == 3
    assert all(sandbox.exec("cat calc.py").stdout.startswith("def add") for sandbox in sandboxes)

    _wait_for(lambda: SandboxHost.objects.filter(name__in=fleet.hosts, state="alive").count() == 3,
              what="a heartbeat from every host")
    response = api_client_for(owner).get("/api/fleet/")
    assert response.status_code == 200, response.content
    listed = {host["name"]: host for host in response.json()["overview"]["hosts"]}
    assert set(fleet.hosts) <= set(listed)
    for sandbox in sandboxes:
        sandbox.destroy()


@pytest.mark.django_db(transaction=True)
def test_a_node_joining_mid_burst_takes_work_and_its_loss_is_marked_within_10_s(cluster, fleet, repo):
    from webapp.fleet.models import SandboxHost, SandboxRecord
    from webapp.fleet.services import hosts_mark_lost

    snapshot = fleet.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
    held = [fleet.sandbox_create(snapshot=snapshot, limits=LIMITS) for _ in range(5)]  # every slot taken
    import ray

    queued: list[str] = []

    def queued_request() -> None:
        sandbox = fleet.sandbox_create(snapshot=snapshot, limits=LIMITS)
        queued.append(sandbox.host_name)
        sandbox.destroy()  # two requests may wait on one host: the second gets this slot

    waiting = [threading.Thread(target=queued_request) for _ in range(2)]
    for thread in waiting:
        thread.start()
    _wait_for(lambda: sum(ray.get(h.actor.load.remote())["waiting"] for h in fleet.hosts.values()) == 2,
              what="the burst queued on the full hosts")

    joined = cluster.add_node(**NODE, resources={"sandbox_slots": 2})
    new_host = _host_on(fleet, joined)  # nobody calls refresh: Fleet.start's follower places it
    assert len(fleet.hosts) == 4
    # The burst's next requests go to the node that joined (the snapshot is built there on first use).
    fresh = [fleet.sandbox_create(snapshot=snapshot, limits=LIMITS) for _ in range(2)]
    assert {sandbox.host_name for sandbox in fresh} == {new_host}
    assert fresh[0].exec("cat calc.py").stdout.startswith("def add")
    _wait_for(lambda: SandboxRecord.objects.filter(sandbox_id__in=[s.id for s in fresh], state="idle").count() == 2,
              what="the new host's sandboxes recorded")

    cluster.remove_node(joined)
    removed_at = time.monotonic()
    with pytest.raises(SandboxGone, match="lost with its host"):
        fresh[0].exec("echo still there?")

    def marked_lost():
        hosts_mark_lost(stale_after_s=3.0)
        return SandboxHost.objects.get(name=new_host).state == "lost"

    _wait_for(marked_lost, timeout=10, what="the host marked lost")
    assert time.monotonic() - removed_at < 10
    assert set(SandboxRecord.objects.filter(sandbox_id__in=[s.id for s in fresh]).values_list("state", flat=True)) == {
        "lost"}

    # Freed slots go to the queued requests (each waits on the host it was placed on); new requests
    # never go to the lost host.
    for sandbox in held:
        sandbox.destroy()
    for thread in waiting:
        thread.join(timeout=60)
    assert len(queued) == 2 and new_host not in queued
    later = fleet.sandbox_create(snapshot=snapshot, limits=LIMITS)
    assert later.host_name != new_host and new_host in fleet.lost and new_host not in fleet.hosts
    later.destroy()


@pytest.mark.django_db(transaction=True)
def test_a_product_task_whose_sandbox_host_leaves_fails_with_the_reason(cluster, fleet, owner, settings, tmp_path):
    """Product tasks reach the fleet through AGENT_SANDBOX_BACKEND=fleet (sandboxes.fleet.backend)."""
    from sandboxes.fleet.backend import FleetBackend
    from training.agent.demo_repo import write_demo_repository
    from webapp.agents import services
    from webapp.agents.models import AgentTask, Repository
    from webapp.fleet.models import SandboxRecord

    settings.STATE_DIR = tmp_path
    # The other hosts are kept full by training sandboxes, so the task's sandbox lands on the product node.
    snapshot = fleet.snapshot_create(source=RepoSource(kind="path", location=str(write_demo_repository(
        tmp_path / "warm"))))
    held = [fleet.sandbox_create(snapshot=snapshot, limits=LIMITS) for _ in range(5)]
    product_node = cluster.add_node(**NODE, resources={"sandbox_slots": 2})
    product_host = _host_on(fleet, product_node)
    assert product_host not in {sandbox.host_name for sandbox in held}

    repository = services.repository_create(owner=owner, team=None, name="demo", kind=Repository.Kind.PATH,
                                            location=str(write_demo_repository(tmp_path / "demo")),
                                            allow_server_path=True)
    task = services.task_create(owner=owner, prompt="fix it", repository=repository, backend="scripted",
                                policy_options={"step_delay_s": 1.0}, enqueue=False)
    settings.AGENT_SANDBOX_BACKEND = "fleet"
    backend = FleetBackend(fleet.config)
    backend._fleet = fleet  # the test's own fleet handle (a worker attaches with Fleet.connect)
    import sandboxes

    sandboxes._backends["fleet"] = backend
    try:
        def run_task() -> None:  # a Celery worker's part; its database session must not outlive it
            from django.db import connection

            try:
                services.task_run(task_id=task.pk)
            finally:
                connection.close()

        runner = threading.Thread(target=run_task)
        runner.start()

        def product_sandbox_or_task_over():
            ended = AgentTask.objects.filter(pk=task.pk).exclude(
                status__in=[AgentTask.Status.QUEUED, AgentTask.Status.RUNNING]).values_list("status_reason").first()
            if ended is not None:  # e.g. the task path rejecting the fleet's snapshot, as it did after a merge
                raise AssertionError(f"the task ended before its host left: {ended[0]}")
            return SandboxRecord.objects.filter(host__name=product_host, purpose="product").first()

        record = _wait_for(product_sandbox_or_task_over, what="the product sandbox on the product node")
        cluster.remove_node(product_node)
        runner.join(timeout=60)
        assert not runner.is_alive()
    finally:
        sandboxes._backends.pop("fleet", None)
        for sandbox in held:
            sandbox.destroy()
    task.refresh_from_db()
    assert task.status == AgentTask.Status.FAILED
    assert "SandboxGone" in task.status_reason and product_host in task.status_reason
    assert record.sandbox_id in task.status_reason
