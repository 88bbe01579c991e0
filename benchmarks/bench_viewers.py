"""Past one process and one node: live viewers on 2 ASGI processes, and rollouts on 1, 2 and 3 Ray nodes.

Part 1, viewers. Two server processes (the project's server command, the Redis channel layer); N
viewers of one task, half on each process, in 4 client processes (bench_events' lean client and
Viewers). Latency = a tool call finishing (``payload.finished_at``, stamped by the agent loop) -> the
frame at the viewer. Same-run baselines: (a) ``group_send`` of a same-size message straight to the
task's group through both processes (the channel layer + server, no database, no agent loop), and
(b) a raw Redis pub/sub round trip (publish -> a subscriber in another process, no Channels at all).

Part 2, rollout throughput on 1, 2 and 3 Ray nodes of Ray's test cluster, on the same cores (every
node on this machine, the total sandbox slots the same): the real agent loop (the scripted demo
expert, no model) runs each rollout in a fleet sandbox, the driver places sandboxes through
``Fleet``. It shows the scheduler's overhead as nodes are added, not a speed-up (the cores do not
grow): rollouts/s, and the driver's CPU per rollout (placement, Ray calls).

    .venv/bin/python benchmarks/bench_viewers.py [--viewers 500] [--turns 20] [--rollouts 48] [--skip-viewers]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contextlib

import bench_events as events  # (sets the environment and sys.path)

ROOT = events.ROOT


def _redis_subscriber(url: str, channel: str, count: int, ready, results) -> None:
    import redis

    client = redis.Redis.from_url(url)
    pubsub = client.pubsub()
    pubsub.subscribe(channel)
    pubsub.get_message(timeout=5)  # the subscribe confirmation
    ready.set()
    latencies = []
    while len(latencies) < count:
        message = pubsub.get_message(timeout=30)
        if message is None:
            break
        if message["type"] == "message":
            latencies.append(time.time() - json.loads(message["data"])["sent_at"])
    results.put(latencies)


def redis_round_trip(count: int, size: int, interval_s: float) -> list[float]:
    """Publish -> a subscriber in another process: Redis pub/sub alone, on the same machine and load."""
    import redis

    url, channel = os.environ["REDIS_URL"], f"bench-viewers-{os.getpid()}"
    context = multiprocessing.get_context("spawn")
    ready, results = context.Event(), context.Queue()
    subscriber = context.Process(target=_redis_subscriber, args=(url, channel, count, ready, results), daemon=True)
    subscriber.start()
    if not ready.wait(60):
        raise SystemExit("the Redis subscriber did not start")
    client = redis.Redis.from_url(url)
    for _ in range(count):
        client.publish(channel, json.dumps({"sent_at": time.time(), "pad": "x" * size}))
        time.sleep(interval_s)
    latencies = results.get(timeout=60)
    subscriber.join(timeout=10)
    return latencies


class _Phases:
    """Wall time of each phase of the viewers part, printed with the figures (where the minutes go)."""

    def __init__(self) -> None:
        self.started = self.last = time.monotonic()
        self.rows: list[tuple[str, float]] = []

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.rows.append((name, now - self.last))
        self.last = now

    def line(self) -> str:
        parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in self.rows)
        return f"   wall time {time.monotonic() - self.started:.1f} s: {parts} (s)"


def viewers_part(*, viewers: int, turns: int, step_delay_s: float) -> None:
    from sandboxes import get_backend
    from sandboxes.base import RepoSource, SandboxLimits
    from webapp.accounts.services import api_token_get_or_create
    from webapp.agents.models import AgentTask
    from webapp.agents.services import task_create

    phases = _Phases()
    user, repository, path = _bench_user_and_repository()
    backend = get_backend("local")
    sandbox = backend.sandbox_create(snapshot=backend.snapshot_create(source=RepoSource(kind="path", location=str(path))),
                                     limits=SandboxLimits())
    ports = [events.free_port(), events.free_port()]
    servers = [events.start_server(port) for port in ports]
    token = api_token_get_or_create(user=user)
    half = [viewers // 2, viewers - viewers // 2]
    drain_s = 2.0 + viewers / 50
    phases.done("servers")
    try:
        def watchers(task_id: int):
            return [events.Viewers(f"ws://127.0.0.1:{port}/ws/tasks/{task_id}/events/?after=-1", token, count,
                                   client="lean", server_pid=server.pid, processes=2)
                    for port, server, count in zip(ports, servers, half, strict=True)]

        base_task = task_create(owner=user, prompt="baseline", repository=repository, backend="scripted", enqueue=False)
        base = watchers(base_task.pk)
        for group in base:
            group.__enter__()
        phases.done("baseline viewers connect")
        events.run_baseline(base_task.pk, count=2 * turns, size=300, interval_s=max(0.01, step_delay_s / 2))
        time.sleep(drain_s)
        for group in base:
            group.__exit__(None, None, None)
        phases.done("baseline")

        task = task_create(owner=user, prompt="benchmark", repository=repository, backend="scripted", enqueue=False)
        product = watchers(task.pk)
        for group in product:
            group.__enter__()
        phases.done("product viewers connect")
        events.run_product_path(task.pk, sandbox, turns, step_delay_s)
        time.sleep(drain_s)
        for group in product:
            group.__exit__(None, None, None)
        phases.done("product path")
        raw = redis_round_trip(count=2 * turns, size=300, interval_s=max(0.01, step_delay_s / 2))
        phases.done("raw Redis")
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=15)
        sandbox.destroy()

    last_seq = AgentTask.objects.get(pk=task.pk).last_seq
    baseline = [value for group in base for value in group.latencies("baseline")]
    latencies = [value for group in product for value in group.latencies("tool_result")]
    in_order = all(events.in_order(group.samples, last_seq + 1) for group in product)
    per_process = [len(group.samples) for group in product]
    print(f"-- {viewers} viewers of one task on 2 server processes ({per_process[0]} + {per_process[1]} viewers), "
          f"4 client processes; {turns} turns x 2 tool calls, {step_delay_s}s per model turn; every viewer got every "
          f"event once, in order: {in_order}; tool results received {len(latencies)}/{2 * turns * viewers}")
    events.report("raw Redis pub/sub round trip (1 subscriber)", raw)
    events.report(f"baseline group_send -> {viewers} viewers", baseline)
    events.report(f"tool finished -> event at {viewers} viewers", latencies, baseline)
    for index, group in enumerate(product):
        print(f"   server process {index + 1}: {events.cpu_line(group)}")
    print(phases.line(), flush=True)


def _bench_user_and_repository():
    from django.contrib.auth import get_user_model

    from training.agent.demo_repo import write_demo_repository
    from webapp.accounts.services import user_create
    from webapp.agents.models import Repository
    from webapp.agents.services import repository_create

    user = get_user_model().objects.filter(username="bench-events").first() or user_create(
        username="bench-events", password="bench-events-pass")
    path = write_demo_repository(Path(os.environ["FLOWSTATE_STATE_DIR"]) / "bench-repo")
    repository = Repository.objects.filter(owner=user, location=str(path)).first() or repository_create(
        owner=user, name=f"bench-{path.parent.name}", kind="path", location=str(path), allow_server_path=True)
    return user, repository, path


def rollouts_on(nodes: int, *, slots: int, rollouts: int, repo: Path) -> dict:
    """``rollouts`` scripted-agent rollouts in fleet sandboxes on a cluster of ``nodes`` nodes (``slots`` in all)."""
    from concurrent.futures import ThreadPoolExecutor

    import ray
    from ray.cluster_utils import Cluster

    from sandboxes.base import RepoSource, SandboxLimits
    from sandboxes.fleet.client import Fleet, FleetConfig
    from training.agent.config import AgentLimits
    from training.agent.demo_repo import DEMO_PROMPT, demo_expert_policy
    from training.agent.loop import run_agent

    per_node = [slots // nodes + (1 if i < slots % nodes else 0) for i in range(nodes)]
    node = {"num_cpus": 1, "object_store_memory": 78 * 2**20}
    for attempt in range(3):  # on a loaded machine a raylet can miss Ray's fixed 30 s registration wait
        try:
            cluster = Cluster(initialize_head=True,
                              head_node_args={**node, "resources": {"sandbox_slots": per_node[0]}})
            for count in per_node[1:]:
                cluster.add_node(**node, resources={"sandbox_slots": count})
            cluster.wait_for_nodes()
            break
        except Exception as error:  # noqa: BLE001 - Ray raises a bare Exception for it
            print(f"   cluster start failed (attempt {attempt + 1} of 3): {error}", flush=True)
            with contextlib.suppress(Exception):  # best-effort cleanup; `cluster` may not even exist yet
                cluster.shutdown()
    else:
        raise SystemExit("Ray could not start the cluster")
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    try:
        fleet = Fleet.start(FleetConfig(backend="local", heartbeat_sink=None, refresh_interval_s=0))
        snapshot = fleet.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
        limits = SandboxLimits(command_timeout_s=60, lifetime_s=600, memory_mb=512)

        def one(_index: int) -> tuple[str, str]:
            sandbox = fleet.sandbox_create(snapshot=snapshot, limits=limits)
            try:
                result = run_agent(sandbox=sandbox, policy=demo_expert_policy(), prompt=DEMO_PROMPT,
                                   limits=AgentLimits(max_turns=20))
                return sandbox.host_name, result.status
            finally:
                sandbox.destroy()

        one(0)  # warm every code path once
        cpu, wall = time.process_time(), time.monotonic()
        with ThreadPoolExecutor(max_workers=slots) as pool:
            done = list(pool.map(one, range(rollouts)))
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        fleet.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    hosts = sorted({host for host, _ in done})
    return {"nodes": nodes, "slots": per_node, "rollouts": len(done), "wall_s": wall, "rollouts_per_s": len(done) / wall,
            "driver_cpu_ms_per_rollout": 1000 * cpu / len(done), "hosts_used": len(hosts),
            "succeeded": sum(1 for _, status in done if status == "succeeded")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--viewers", type=int, default=500)
    parser.add_argument("--turns", type=int, default=20, help="scripted turns (2 tool calls each) in the viewers part")
    parser.add_argument("--turn-delay", type=float, default=1.0, help="seconds per scripted model turn")
    parser.add_argument("--rollouts", type=int, default=48, help="rollouts per node count")
    parser.add_argument("--slots", type=int, default=6, help="sandbox slots in all, split over the nodes")
    parser.add_argument("--skip-viewers", action="store_true")
    parser.add_argument("--skip-rollouts", action="store_true")
    parser.add_argument("--nodes", default="1,2,3", help="node counts of the rollouts part")
    parser.add_argument("--rollouts-child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--repo", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()

    import django

    django.setup()
    events.ensure_database()
    from django.core.management import call_command

    if args.rollouts_child:  # one cluster per process: Ray keeps per-process state between clusters
        row = rollouts_on(args.rollouts_child, slots=args.slots, rollouts=args.rollouts, repo=Path(args.repo))
        print("ROW " + json.dumps(row), flush=True)
        return 0
    call_command("migrate", verbosity=0)
    print(f"load before: {os.getloadavg()}", flush=True)
    if not args.skip_viewers:
        viewers_part(viewers=args.viewers, turns=args.turns, step_delay_s=args.turn_delay)
        print(f"load after the viewers: {os.getloadavg()}", flush=True)
    if not args.skip_rollouts:
        from training.agent.demo_repo import write_demo_repository

        repo = write_demo_repository(Path(tempfile.mkdtemp(prefix="bench-viewers-")) / "demo")
        print(f"-- scripted-agent rollouts in fleet sandboxes, {args.slots} slots in all, {args.rollouts} rollouts "
              "per run (same cores)")
        for nodes in [int(n) for n in args.nodes.split(",")]:
            child = subprocess.run([sys.executable, __file__, "--rollouts-child", str(nodes), "--slots",
                                    str(args.slots), "--rollouts", str(args.rollouts), "--repo", str(repo)],
                                   capture_output=True, text=True, timeout=1200)
            rows = [line[4:] for line in child.stdout.splitlines() if line.startswith("ROW ")]
            if not rows:
                print(f"   {nodes} node(s): failed: {(child.stdout + child.stderr)[-600:]}", flush=True)
                continue
            row = json.loads(rows[0])
            print(f"   {nodes} node(s) {row['slots']}: {row['rollouts_per_s']:.2f} rollouts/s, "
                  f"driver CPU {row['driver_cpu_ms_per_rollout']:.1f} ms/rollout, {row['hosts_used']} hosts used, "
                  f"{row['succeeded']}/{row['rollouts']} succeeded, wall {row['wall_s']:.1f} s; "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
