"""Live-view latency: a tool call finishing -> its event at a websocket client.

The measured path is the product path: the agent loop (scripted expert, not a model) runs tools in
a local sandbox; each event is stored in PostgreSQL under the task's claim (``task_event_append``)
and published to the Channels group (Redis) after commit; the ``TaskEventsConsumer`` in a uvicorn
child forwards it to websocket clients. Latency = client receive time - ``payload.finished_at``.

Baseline measured in the same run: a message of the same size sent with ``group_send`` straight
to the same group (no database, no loop), i.e. the transport's own floor. Printed: p50/p99 for one
viewer and for N concurrent viewers of one task, the ratio against the baseline, and the CPU time the
server process and the viewer processes spent per frame delivered while the viewers watched.

The viewers run in 4 processes on the same machine as the server. ``--client lean`` (default) is a
minimal frame reader on uvloop that stamps a frame when its bytes come off the socket;
``--client websockets`` is the ``websockets`` library's client, stamping after its reader task woke
(the client of the figures before 2026-11-25). Baseline and product path always use the same client.

Needs PostgreSQL and Redis (the defaults below are the development services; override with
DATABASE_URL / REDIS_URL). Run:  .venv/bin/python benchmarks/bench_events.py [--quick] [--viewers 500]
[--many-only] [--client lean|websockets]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

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


class _FrameReader(asyncio.Protocol):
    """A small websocket client that still reads every frame: the HTTP upgrade, unmasked server
    frames (RFC 6455 5.1), fragments, ping -> pong, the closing handshake. One process holds over a
    hundred viewers on the same two cores as the server, so what a client does per message delays
    the next viewer's reading: the arrival time is taken when the bytes come off the socket, and
    the JSON (each event's order and timestamp) is read after the run."""

    def __init__(self, host: str, path: str, headers: dict[str, str]) -> None:
        loop = asyncio.get_running_loop()
        self.request = "".join([
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n",
            f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\nSec-WebSocket-Version: 13\r\n",
            *(f"{name}: {value}\r\n" for name, value in headers.items()), "\r\n",
        ]).encode()
        self.opened, self.closed = loop.create_future(), loop.create_future()
        self.close_sent = False
        self.buffer = bytearray()
        self.fragments: list[bytes] = []
        self.messages: list[tuple[float, bytes]] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def connection_lost(self, exc) -> None:
        if not self.opened.done():
            self.opened.set_exception(ConnectionError(f"connection lost before the upgrade: {exc}"))
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        now = time.time()
        self.buffer += data
        if not self.opened.done():
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            if not self.buffer.startswith(b"HTTP/1.1 101 "):
                self.opened.set_exception(ConnectionError(bytes(self.buffer[:end]).decode("latin-1")))
                self.transport.close()
                return
            del self.buffer[:end + 4]
            self.opened.set_result(None)
        self._read_frames(now)

    def _read_frames(self, now: float) -> None:
        buffer, start = self.buffer, 0
        while len(buffer) - start >= 2:
            first, length = buffer[start], buffer[start + 1] & 0x7F
            header = 2 + {126: 2, 127: 8}.get(length, 0)
            if len(buffer) - start < header:
                break
            if header > 2:
                length = int.from_bytes(buffer[start + 2:start + header], "big")
            end = start + header + length
            if len(buffer) < end:
                break
            self._frame(first & 0x80, first & 0x0F, bytes(buffer[start + header:end]), now)
            start = end
        del buffer[:start]

    def _frame(self, fin: int, opcode: int, payload: bytes, now: float) -> None:
        if opcode in (0x0, 0x1, 0x2):
            self.fragments.append(payload)
            if fin:
                self.messages.append((now, b"".join(self.fragments)))
                self.fragments = []
        elif opcode == 0x9:
            self.send_frame(0xA, payload)
        elif opcode == 0x8:
            if not self.close_sent:
                self.send_frame(0x8, payload[:2])
            if not self.closed.done():
                self.closed.set_result(None)
            self.transport.close()

    def send_frame(self, opcode: int, payload: bytes) -> None:
        # Client frames are masked (RFC 6455 5.3); the payloads here are a few bytes.
        mask = os.urandom(4)
        masked = bytes(byte ^ mask[i % 4] for i, byte in enumerate(payload))
        self.transport.write(bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + masked)

    async def close(self) -> None:
        if not self.closed.done():
            self.send_frame(0x8, (1000).to_bytes(2, "big"))
            self.close_sent = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.closed), 10)
        self.transport.close()


async def _connect_lean(url: str, headers: dict[str, str]) -> _FrameReader:
    location = urlsplit(url)
    path = f"{location.path}?{location.query}" if location.query else location.path
    _, reader = await asyncio.get_running_loop().create_connection(
        lambda: _FrameReader(location.netloc, path, headers), location.hostname, location.port)
    await asyncio.wait_for(reader.opened, 120)
    return reader


async def _watch_lean(url: str, headers: dict[str, str], count: int, ready, stop) -> tuple[list[list[tuple[float, bytes]]], float]:
    readers = [await _connect_lean(url, headers) for _ in range(count)]
    ready.set()
    cpu_start = time.process_time()
    while not stop.is_set():
        await asyncio.sleep(0.1)
    cpu_s = time.process_time() - cpu_start
    await asyncio.gather(*(reader.close() for reader in readers))
    return [reader.messages for reader in readers], cpu_s


async def _watch_websockets(url: str, headers: dict[str, str], count: int, ready, stop) -> tuple[list[list[tuple[float, bytes]]], float]:
    import websockets

    received: list[list[tuple[float, bytes]]] = [[] for _ in range(count)]
    sockets = []
    for _ in range(count):
        sockets.append(await websockets.connect(url, additional_headers=headers, max_queue=None, open_timeout=120))
    ready.set()
    cpu_start = time.process_time()

    async def read(index: int, ws) -> None:
        try:
            async for raw in ws:
                received[index].append((time.time(), raw))
        except websockets.ConnectionClosed:
            pass

    readers = [asyncio.create_task(read(i, ws)) for i, ws in enumerate(sockets)]
    while not stop.is_set():
        await asyncio.sleep(0.1)
    cpu_s = time.process_time() - cpu_start
    for ws in sockets:
        await ws.close()
    await asyncio.gather(*readers)
    return received, cpu_s


CLIENTS = {"lean": _watch_lean, "websockets": _watch_websockets}


def _samples(received: list[tuple[float, bytes | str]]) -> list[tuple]:
    samples = []
    for now, raw in received:
        for event in json.loads(raw).get("events", ()):
            stamp = event["payload"].get("finished_at") or event["payload"].get("sent_at")
            samples.append((event["seq"], event["kind"], stamp, now))
    return samples


def _viewer_process(client: str, url: str, token: str, count: int, ready, stop, results) -> None:
    import uvloop

    headers = {"Authorization": f"Token {token}", "Origin": "http://127.0.0.1"}
    # The lean client reads on uvloop, as the server does (half the client CPU per frame of asyncio's
    # own loop here); the websockets client keeps asyncio's loop, as this benchmark always ran it.
    run = uvloop.run if client == "lean" else asyncio.run
    received, cpu_s = run(CLIENTS[client](url, headers, count, ready, stop))
    results.put(([_samples(per_client) for per_client in received], sum(map(len, received)), cpu_s))


class Viewers:
    """N websocket clients of one task spread over a few processes, so the measuring clients do not
    share one interpreter; each records (seq, kind, finished_at or sent_at, received_at). Also
    measured while they watch: the CPU seconds of the server process and of the clients."""

    def __init__(self, url: str, token: str, count: int, *, client: str, server_pid: int, processes: int = 4) -> None:
        import multiprocessing

        import psutil

        context = multiprocessing.get_context("spawn")
        self.stop = context.Event()
        self.results = context.Queue()
        sizes = [count // processes + (1 if i < count % processes else 0) for i in range(min(processes, count))]
        self.ready = [context.Event() for _ in sizes]
        self.workers = [context.Process(target=_viewer_process, args=(client, url, token, size, ready, self.stop, self.results),
                                        daemon=True) for size, ready in zip(sizes, self.ready, strict=True)]
        self.samples: list[list[tuple]] = []
        self.server = psutil.Process(server_pid)
        self.server_cpu_s = self.client_cpu_s = 0.0
        self.frames = 0

    def __enter__(self):
        for worker in self.workers:
            worker.start()
        for ready in self.ready:
            if not ready.wait(180):
                raise SystemExit("the viewers did not all connect")
        time.sleep(0.5)
        self.server_cpu_s = -self._server_cpu()
        return self

    def _server_cpu(self) -> float:
        times = self.server.cpu_times()
        return times.user + times.system

    def __exit__(self, *exc):
        self.server_cpu_s += self._server_cpu()
        self.stop.set()
        for _ in self.workers:
            samples, frames, cpu_s = self.results.get(timeout=120)
            self.samples.extend(samples)
            self.frames += frames
            self.client_cpu_s += cpu_s
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


def in_order(samples: list[list[tuple]], count: int) -> bool:
    """Every viewer got events 0..count-1, each once, in order."""
    return all([seq for seq, *_ in per_viewer] == list(range(count)) for per_viewer in samples)


def cpu_line(watching: Viewers) -> str:
    per_frame = 1e6 / max(1, watching.frames)
    return (f"{watching.frames} frames; CPU per frame delivered: server {watching.server_cpu_s * per_frame:.0f} us, "
            f"clients {watching.client_cpu_s * per_frame:.0f} us")


def measure(*, viewers: int, turns: int, step_delay_s: float, port: int, owner, repository, sandbox, client: str,
            server_pid: int) -> None:
    from webapp.accounts.services import api_token_get_or_create
    from webapp.agents.models import AgentTask
    from webapp.agents.services import task_create

    token = api_token_get_or_create(user=owner)
    baseline_task = task_create(owner=owner, prompt="baseline", repository=repository, backend="scripted", enqueue=False)
    with Viewers(f"ws://127.0.0.1:{port}/ws/tasks/{baseline_task.pk}/events/?after=-1", token, viewers, client=client,
                 server_pid=server_pid) as base_watching:
        run_baseline(baseline_task.pk, count=2 * turns, size=300, interval_s=max(0.01, step_delay_s / 2))
        time.sleep(2.0 + viewers / 50)  # let the slowest viewer drain
    baseline = base_watching.latencies("baseline")

    task = task_create(owner=owner, prompt="benchmark", repository=repository, backend="scripted", enqueue=False)
    with Viewers(f"ws://127.0.0.1:{port}/ws/tasks/{task.pk}/events/?after=-1", token, viewers, client=client,
                 server_pid=server_pid) as watching:
        run_product_path(task.pk, sandbox, turns, step_delay_s)
        time.sleep(2.0 + viewers / 50)  # let the slowest viewer drain
    latencies = watching.latencies("tool_result")
    expected = 2 * turns * viewers
    print(f"-- {viewers} viewer(s), {turns} turns x 2 parallel tool calls, {step_delay_s}s per model turn, {client} client; "
          f"every viewer got every event in order: baseline {in_order(base_watching.samples, 2 * turns)}, "
          f"product {in_order(watching.samples, AgentTask.objects.get(pk=task.pk).last_seq + 1)}; "
          f"tool results received {len(latencies)}/{expected}")
    report(f"baseline group_send -> {viewers} viewer(s)", baseline)
    print(f"   {cpu_line(base_watching)}")
    report(f"tool finished -> event at {viewers} viewer(s)", latencies, baseline)
    print(f"   {cpu_line(watching)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer turns (smoke run)")
    parser.add_argument("--viewers", type=int, default=500, help="concurrent viewers in the second scenario")
    parser.add_argument("--turn-delay", type=float, default=1.0, help="seconds per scripted model turn with many viewers")
    parser.add_argument("--client", choices=sorted(CLIENTS), default="lean",
                        help="websocket client of the viewers (the same one in the baseline and the product path)")
    parser.add_argument("--many-only", action="store_true", help="skip the one-viewer scenario")
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
        common = {"port": port, "owner": user, "repository": repository, "sandbox": sandbox, "client": args.client,
                  "server_pid": server.pid}
        if not args.many_only:
            measure(viewers=1, turns=turns, step_delay_s=0.0, **common)
        # Many viewers: model turns paced like a fast model (--turn-delay), tools as fast as they run.
        measure(viewers=args.viewers, turns=max(10, turns // 5), step_delay_s=args.turn_delay, **common)
    finally:
        server.terminate()
        server.wait(timeout=15)
        sandbox.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
