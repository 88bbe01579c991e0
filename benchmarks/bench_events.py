"""Live-view latency: a tool call finishing -> its event at a websocket client.

The measured path is the product path: the agent loop (scripted expert, not a model) runs tools in
a local sandbox; each event is stored in PostgreSQL under the task's claim (``task_event_append``)
and published to the Channels group (Redis) after commit; the ``TaskEventsConsumer`` in a uvicorn
child forwards it to websocket clients. Latency = client receive time - ``payload.finished_at``.

Baseline measured in the same run: a message of the same size sent with ``group_send`` straight
to the same group (no database, no loop), i.e. the transport's own floor. Printed: p50/p99 for one
viewer and for N concurrent viewers of one task, and the ratio against the baseline.

Needs PostgreSQL and Redis (the defaults below are the development services; override with
DATABASE_URL / REDIS_URL). Run:  .venv/bin/python benchmarks/bench_events.py [--quick] [--viewers 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/flowstate_bench_events")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/13")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
if "FLOWSTATE_STATE_DIR" not in os.environ:
    os.environ["FLOWSTATE_STATE_DIR"] = tempfile.mkdtemp(prefix="bench-events-")
    os.chmod(os.environ["FLOWSTATE_STATE_DIR"], 0o755)  # sandbox processes run as another uid
os.environ.setdefault("LOG_LEVEL", "WARNING")


def ensure_database() -> None:
    import psycopg
    from django.conf import settings

    db = settings.DATABASES["default"]
    if not db["ENGINE"].endswith("postgresql"):
        return
    with psycopg.connect(host=db.get("HOST") or "127.0.0.1", port=db.get("PORT") or 5432, user=db.get("USER") or "postgres",
                         password=db.get("PASSWORD") or None, dbname="postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db["NAME"],)).fetchone():
            conn.execute(f'CREATE DATABASE "{db["NAME"]}"')


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(name: str, samples: list[float], baseline: list[float] | None = None) -> None:
    p50, p99 = statistics.median(samples), percentile(samples, 0.99)
    line = f"{name:<44} p50 {p50 * 1000:7.2f} ms   p99 {p99 * 1000:7.2f} ms   (n={len(samples)})"
    if baseline:
        line += f"   ratio vs baseline: p50 {p50 / statistics.median(baseline):.2f}x, p99 {p99 / percentile(baseline, 0.99):.2f}x"
    print(line, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    from webapp.server_command import asgi_server_command

    proc = subprocess.Popen(asgi_server_command(host="127.0.0.1", port=port, log_level="warning"), cwd=ROOT,
                            env=dict(os.environ))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("uvicorn did not start")


async def _watch(url: str, token: str, count: int, ready, stop) -> list[list[tuple]]:
    import websockets

    headers = {"Authorization": f"Token {token}", "Origin": "http://127.0.0.1"}
    samples: list[list[tuple]] = [[] for _ in range(count)]
    sockets = []
    for _ in range(count):
        sockets.append(await websockets.connect(url, additional_headers=headers, max_queue=None, open_timeout=120))
    ready.set()

    async def read(index: int, ws) -> None:
        try:
            async for raw in ws:
                now = time.time()
                message = json.loads(raw)
                for event in message.get("events", ()):
                    stamp = event["payload"].get("finished_at") or event["payload"].get("sent_at")
                    samples[index].append((event["seq"], event["kind"], stamp, now))
        except websockets.ConnectionClosed:
            pass

    readers = [asyncio.create_task(read(i, ws)) for i, ws in enumerate(sockets)]
    while not stop.is_set():
        await asyncio.sleep(0.1)
    for ws in sockets:
        await ws.close()
    await asyncio.gather(*readers)
    return samples


def _viewer_process(url: str, token: str, count: int, ready, stop, results) -> None:
    results.put(asyncio.run(_watch(url, token, count, ready, stop)))


class Viewers:
    """N websocket clients of one task spread over a few processes, so the measuring clients do not
    share one interpreter; each records (seq, kind, finished_at or sent_at, received_at)."""

    def __init__(self, url: str, token: str, count: int, processes: int = 4) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.stop = context.Event()
        self.results = context.Queue()
        sizes = [count // processes + (1 if i < count % processes else 0) for i in range(min(processes, count))]
        self.ready = [context.Event() for _ in sizes]
        self.workers = [context.Process(target=_viewer_process, args=(url, token, size, ready, self.stop, self.results),
                                        daemon=True) for size, ready in zip(sizes, self.ready, strict=True)]
        self.samples: list[list[tuple]] = []

    def __enter__(self):
        for worker in self.workers:
            worker.start()
        for ready in self.ready:
            if not ready.wait(180):
                raise SystemExit("the viewers did not all connect")
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for _ in self.workers:
            self.samples.extend(self.results.get(timeout=120))
        for worker in self.workers:
            worker.join(timeout=30)

    def latencies(self, kind: str) -> list[float]:
        return [received - stamp for per_client in self.samples for _, k, stamp, received in per_client if k == kind and stamp]


def benchmark_script(turns: int, step_delay_s: float):
    from training.agent.scripted import ScriptedExpertPolicy, ScriptedTurn

    return ScriptedExpertPolicy(step_delay_s=step_delay_s, turns=[ScriptedTurn(f"step {i}", (("list_dir", {"path": "."}), ("read_file", {"path": "README.md"})))
                                       for i in range(turns)], final_message="done", name="bench-scripted")


def run_product_path(task_id: int, sandbox, turns: int, step_delay_s: float) -> None:
    """What webapp.agents.services.task_run does, with a longer script than the demo's."""
    from training.agent.config import AgentLimits
    from training.agent.loop import run_agent
    from webapp.agents import services

    task, token = services.task_claim(task_id=task_id)
    result = run_agent(sandbox=sandbox, policy=benchmark_script(turns, step_delay_s), prompt="benchmark", limits=AgentLimits(max_turns=turns + 1),
                       on_event=lambda event: services.task_event_append(task_id=task_id, claim_token=token, event=event),
                       first_seq=task.last_seq + 1)
    services.task_finish(task_id=task_id, claim_token=token, result=result)


def run_baseline(task_id: int, count: int, size: int, interval_s: float) -> None:
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    from webapp.agents.selectors import LIVE_CHANNEL_LAYER, task_group_name

    layer = get_channel_layer(LIVE_CHANNEL_LAYER)
    async def send_all() -> None:
        # One event loop for the whole baseline, like the product's publisher thread.
        for seq in range(count):
            event = {"seq": seq, "kind": "baseline", "turn": 0, "ts": time.time(), "attempt": 1, "has_full_output": False,
                     "payload": {"display": "x" * size, "sent_at": time.time()}}
            text = json.dumps({"type": "events", "events": [event]})
            await layer.group_send(task_group_name(task_id=task_id),
                                   {"type": "task.event", "seq": seq, "last_seq": seq, "text": text})
            await asyncio.sleep(interval_s)

    async_to_sync(send_all)()


def measure(*, viewers: int, turns: int, step_delay_s: float, port: int, owner, repository, sandbox) -> None:
    from webapp.accounts.services import api_token_get_or_create
    from webapp.agents.services import task_create

    token = api_token_get_or_create(user=owner)
    baseline_task = task_create(owner=owner, prompt="baseline", repository=repository, backend="scripted", enqueue=False)
    with Viewers(f"ws://127.0.0.1:{port}/ws/tasks/{baseline_task.pk}/events/?after=-1", token, viewers) as watching:
        run_baseline(baseline_task.pk, count=2 * turns, size=300, interval_s=max(0.01, step_delay_s / 2))
        time.sleep(2.0 + viewers / 50)  # let the slowest viewer drain
    baseline = watching.latencies("baseline")

    task = task_create(owner=owner, prompt="benchmark", repository=repository, backend="scripted", enqueue=False)
    with Viewers(f"ws://127.0.0.1:{port}/ws/tasks/{task.pk}/events/?after=-1", token, viewers) as watching:
        run_product_path(task.pk, sandbox, turns, step_delay_s)
        time.sleep(2.0 + viewers / 50)  # let the slowest viewer drain
    latencies = watching.latencies("tool_result")
    expected = 2 * turns * viewers
    seqs_ok = all([s for s, *_ in per] == list(range(len(per))) for per in watching.samples)
    print(f"-- {viewers} viewer(s), {turns} turns x 2 parallel tool calls, {step_delay_s}s per model turn; every viewer got every event in order: {seqs_ok}; "
          f"tool results received {len(latencies)}/{expected}")
    report(f"baseline group_send -> {viewers} viewer(s)", baseline)
    report(f"tool finished -> event at {viewers} viewer(s)", latencies, baseline)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer turns (smoke run)")
    parser.add_argument("--viewers", type=int, default=500, help="concurrent viewers in the second scenario")
    parser.add_argument("--turn-delay", type=float, default=1.0, help="seconds per scripted model turn with many viewers")
    args = parser.parse_args()

    import django

    django.setup()
    ensure_database()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from django.contrib.auth import get_user_model

    from sandboxes import get_backend
    from sandboxes.base import RepoSource, SandboxLimits
    from training.agent.demo_repo import write_demo_repository
    from webapp.accounts.services import user_create
    from webapp.agents.models import Repository
    from webapp.agents.services import repository_create

    user = get_user_model().objects.filter(username="bench-events").first() or user_create(username="bench-events", password="bench-events-pass")
    path = write_demo_repository(Path(os.environ["FLOWSTATE_STATE_DIR"]) / "bench-repo")
    repository = Repository.objects.filter(owner=user, location=str(path)).first() or repository_create(
        owner=user, name=f"bench-{path.parent.name}", kind="path", location=str(path), allow_server_path=True)
    backend = get_backend("local")
    sandbox = backend.sandbox_create(snapshot=backend.snapshot_create(source=RepoSource(kind="path", location=str(path))),
                                     limits=SandboxLimits())
    port = free_port()
    server = start_server(port)
    try:
        turns = 20 if args.quick else 100
        measure(viewers=1, turns=turns, step_delay_s=0.0, port=port, owner=user, repository=repository, sandbox=sandbox)
        # Many viewers: model turns paced like a fast model (--turn-delay), tools as fast as they run.
        measure(viewers=args.viewers, turns=max(10, turns // 5), step_delay_s=args.turn_delay, port=port, owner=user,
                repository=repository, sandbox=sandbox)
    finally:
        server.terminate()
        server.wait(timeout=15)
        sandbox.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
