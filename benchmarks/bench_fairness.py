"""Fairness between users: a victim's latency alone and while another user floods, on a real stack.

`python -m benchmarks.bench_fairness` starts a fresh SQLite database, a private Redis, the ASGI server
serving a random-weights tiny checkpoint and one prefork Celery worker (benchmarks.task_load.Stack), then
measures, for a victim user:

- short /v1 requests (max_tokens=4, one at a time): alone, then while the flooder holds its
  USER_MAX_V1_CONCURRENT streaming requests of n=16 long choices each open (resubmitted as they end);
- task start (POST /api/tasks/ -> status running, scripted agent): alone, then while the flooder keeps
  its USER_MAX_ACTIVE_TASKS tasks queued or running (resubmitting when refused with 429).

It prints p50/p99 of each and the flood/alone ratio (target: p99 ratio <= 2). Every request goes to
loopback; every loop is bounded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.task_load import Stack, percentile, redis_server_start

VICTIM_SCRIPT = """
import json
from rest_framework.authtoken.models import Token
from webapp.accounts.services import user_create
from webapp.agents.models import Repository
from webapp.agents.services import repository_create
user = user_create(username="victim", password="victim-pass-123")
repo = repository_create(owner=user, name="stats-demo", kind=Repository.Kind.PATH, allow_server_path=True,
                         location=Repository.objects.get(owner__username="load").location)
print("SETUP" + json.dumps({"token": Token.objects.get_or_create(user=user)[0].key, "repository": repo.pk}))
"""
SHORT = {"model": "flowstate", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
         "temperature": 0}


class Client:
    def __init__(self, address: str, token: str, repository: int) -> None:
        self.http = httpx.Client(base_url=f"http://{address}", timeout=300,
                                 headers={"Authorization": f"Token {token}"})
        self.bearer = {"Authorization": f"Bearer {token}"}
        self.repository = repository

    def short_request(self) -> float:
        started = time.perf_counter()
        response = self.http.post("/v1/chat/completions", json=SHORT, headers=self.bearer)
        response.raise_for_status()
        return time.perf_counter() - started

    def submit_task(self, step_delay_s: float) -> httpx.Response:
        return self.http.post("/api/tasks/", json={
            "prompt": "Fix the failing median test", "backend": "scripted", "repository_id": self.repository,
            "policy_options": {"step_delay_s": step_delay_s}})

    def status(self, task_id: int) -> str:
        return self.http.get(f"/api/tasks/{task_id}/").json()["status"]

    def task_start(self, *, timeout: float = 300) -> float:
        """Seconds from submitting a task to seeing it running; then cancels it and waits for it to end (the
        measure is the start; its run would only make the benchmark longer)."""
        started = time.perf_counter()
        response = self.submit_task(0.0)
        response.raise_for_status()
        task_id = response.json()["id"]
        deadline = time.monotonic() + timeout
        while (status := self.status(task_id)) == "queued" and time.monotonic() < deadline:
            time.sleep(0.02)
        took = time.perf_counter() - started
        if status != "running":
            raise RuntimeError(f"victim task {task_id} is {status}, not running, after {timeout}s")
        self.http.post(f"/api/tasks/{task_id}/cancel/")
        while status in ("queued", "running") and time.monotonic() < deadline:
            time.sleep(0.1)
            status = self.status(task_id)
        return took


class Flood:
    """Threads that keep the flooder at its limit until stop(); each loop is bounded by `rounds`."""

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.refused = 0

    def start(self, target, count: int) -> None:
        for _ in range(count):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self.threads.append(thread)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=120)


def v1_flood(client: Client, flood: Flood, *, max_tokens: int, rounds: int = 50):
    body = {**SHORT, "n": 16, "max_tokens": max_tokens, "temperature": 1.0, "stream": True}

    def run() -> None:
        for _ in range(rounds):
            if flood.stopping.is_set():
                return
            with client.http.stream("POST", "/v1/chat/completions", json=body, headers=client.bearer) as response:
                if response.status_code == 429:
                    flood.refused += 1
                    time.sleep(0.2)
                    continue
                for _line in response.iter_lines():
                    if flood.stopping.is_set():
                        return  # closing the stream cancels its generation
    return run


def task_flood(client: Client, flood: Flood, *, step_delay_s: float, rounds: int = 400):
    def run() -> None:
        for _ in range(rounds):
            if flood.stopping.is_set():
                return
            if client.submit_task(step_delay_s).status_code == 429:
                flood.refused += 1
                time.sleep(0.2)
    return run


def figures(alone: list[float], flooded: list[float]) -> dict:
    row = {"alone_p50_ms": 1000 * statistics.median(alone), "alone_p99_ms": 1000 * percentile(alone, 0.99),
           "flood_p50_ms": 1000 * statistics.median(flooded), "flood_p99_ms": 1000 * percentile(flooded, 0.99)}
    row["p50_ratio"] = row["flood_p50_ms"] / row["alone_p50_ms"]
    row["p99_ratio"] = row["flood_p99_ms"] / row["alone_p99_ms"]
    return row


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure(stack: Stack, address: str, args) -> dict:
    out = stack.manage("shell", "-c", VICTIM_SCRIPT)
    setup = json.loads(out.split("SETUP", 1)[1].splitlines()[0])
    victim = Client(address, setup["token"], setup["repository"])
    flooder = Client(address, stack.token, stack.repository)
    for _ in range(3):  # load the model, warm the engine
        victim.short_request()
    results = {}
    progress("v1: victim alone")
    alone = [victim.short_request() for _ in range(args.requests)]
    progress("v1: victim during the flood")
    flood = Flood()
    flood.start(v1_flood(flooder, flood, max_tokens=args.flood_max_tokens), args.flood_streams)
    time.sleep(2.0)  # the flood's requests are in
    flooded = [victim.short_request() for _ in range(args.requests)]
    flood.stop()
    results["v1_short_request"] = {**figures(alone, flooded), "flood_refused": flood.refused}
    progress(json.dumps(results["v1_short_request"]))
    progress("tasks: victim alone")
    victim.task_start()  # warm the worker
    alone = [victim.task_start() for _ in range(args.tasks)]
    flood = Flood()
    flood.start(task_flood(flooder, flood, step_delay_s=args.flood_step_delay_s), 1)
    time.sleep(2.0)
    progress("tasks: victim during the flood")
    flooded = [victim.task_start() for _ in range(args.tasks)]
    flood.stop()
    results["task_start"] = {**figures(alone, flooded), "flood_refused": flood.refused}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20, help="victim /v1 requests per phase")
    parser.add_argument("--tasks", type=int, default=5, help="victim tasks per phase")
    parser.add_argument("--flood-streams", type=int, default=4, help="the flooder's /v1 requests in flight")
    parser.add_argument("--flood-max-tokens", type=int, default=1500)
    parser.add_argument("--flood-step-delay-s", type=float, default=0.5, help="scripted agent delay per step")
    parser.add_argument("--max-active-tasks", type=int, default=2, help="FLOWSTATE_USER_MAX_ACTIVE_TASKS")
    parser.add_argument("--worker-concurrency", type=int, default=3)
    args = parser.parse_args()
    from training.checkpoint import create_random_checkpoint

    state = Path(tempfile.mkdtemp(prefix="flowstate-fairness-"))
    checkpoint = create_random_checkpoint(state / "checkpoint", size="tiny", seed=1, max_seq_len=4096)
    redis_proc, redis_url = redis_server_start(state)
    stack = Stack(database_url=f"sqlite:///{state / 'db.sqlite3'}", redis_url=redis_url, state_dir=state, env_extra={
        "FLOWSTATE_MODEL_CHECKPOINT": str(checkpoint), "FLOWSTATE_USER_MAX_ACTIVE_TASKS": str(args.max_active_tasks),
        "FLOWSTATE_USER_MAX_V1_CONCURRENT": str(args.flood_streams), "AGENT_FOLLOWUP_WARM_S": "0"})
    started = time.monotonic()
    try:
        stack.prepare()
        stack.start_worker("fair", "--concurrency", str(args.worker_concurrency))
        _, address = stack.start_asgi()
        results = measure(stack, address, args)
    finally:
        stack.stop()
        redis_proc.terminate()
    print(f"{'measure':18} {'alone p50':>10} {'alone p99':>10} {'flood p50':>10} {'flood p99':>10} "
          f"{'p50 x':>6} {'p99 x':>6}")
    for name, row in results.items():
        print(f"{name:18} {row['alone_p50_ms']:9.0f}ms {row['alone_p99_ms']:9.0f}ms {row['flood_p50_ms']:9.0f}ms "
              f"{row['flood_p99_ms']:9.0f}ms {row['p50_ratio']:6.2f} {row['p99_ratio']:6.2f}")
    print(json.dumps({"results": results, "args": vars(args), "wall_s": round(time.monotonic() - started, 1)}))


if __name__ == "__main__":
    main()
