"""Follow-up latency: a follow-up message sent -> the agent's first event of the continuation.

The measured path is the product path: ``followups.followup_send`` commits the message (the clock
starts just before it) and wakes the task's worker; a real Celery worker (solo pool, child process)
continues the conversation with the scripted expert (not a model; no step delay) in a local sandbox.
The agent's first event is the ``user_message`` event (the loop took the message; its ``ts`` is the
agent's clock on the same machine) and the ``turn_start`` after it (the model call begins).

Two workspaces: **warm** (the worker kept the finished task's sandbox, ``AGENT_FOLLOWUP_WARM_S=120``)
and **rebuilt** (``AGENT_FOLLOWUP_WARM_S=0``: a Celery message, a fresh snapshot, the patch applied).
Baseline in the same run: a new task submitted -> its ``start`` and first ``turn_start`` events, on
the same worker (a first turn pays the same queue, snapshot and sandbox costs as a rebuilt follow-up).

Needs PostgreSQL and Redis. Run:  .venv/bin/python benchmarks/bench_followup_latency.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/flowstate_bench_followups")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/5")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
if "FLOWSTATE_STATE_DIR" not in os.environ:
    os.environ["FLOWSTATE_STATE_DIR"] = tempfile.mkdtemp(prefix="bench-followups-")
    os.chmod(os.environ["FLOWSTATE_STATE_DIR"], 0o755)  # sandbox processes run as another uid
os.environ.setdefault("LOG_LEVEL", "WARNING")

from benchmarks.bench_events import ensure_database  # noqa: E402


def _worker(warm_s: int) -> subprocess.Popen:
    from django.conf import settings

    from webapp.celery import app

    env = dict(os.environ, AGENT_FOLLOWUP_WARM_S=str(warm_s))
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "webapp", "worker", "--pool", "solo", "--loglevel",
                             "warning", "--without-gossip", "--without-mingle", "-n", f"bench-{os.getpid()}-{warm_s}@%h",
                             "-Q", ",".join(settings.FLOWSTATE_CELERY_QUEUES)], cwd=ROOT, env=env)
    deadline = time.monotonic() + 60
    while not app.control.ping(timeout=0.5):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the Celery worker did not start")
    return proc


def _wait_finished(task_id: int, timeout_s: float = 120) -> None:
    from webapp.agents.models import AgentTask

    deadline = time.monotonic() + timeout_s
    while AgentTask.objects.filter(pk=task_id).values_list("status", flat=True).first() != "succeeded":
        if time.monotonic() > deadline:
            raise TimeoutError(f"task {task_id} did not finish")
        time.sleep(0.05)


def _event_ts(task_id: int, kind: str, after_seq: int, timeout_s: float = 120) -> tuple[int, float]:
    from webapp.agents.models import TaskEvent

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        event = TaskEvent.objects.filter(task_id=task_id, kind=kind, seq__gt=after_seq).order_by("seq").first()
        if event is not None:
            return event.seq, event.ts
        time.sleep(0.01)
    raise TimeoutError(f"no {kind} event of task {task_id}")


def _first_turns(owner, repository, repeats: int) -> dict[str, list[float]]:
    from webapp.agents import services

    out: dict[str, list[float]] = {"first event": [], "first turn_start": []}
    for _ in range(repeats):
        sent = time.time()
        task = services.task_create(owner=owner, prompt="Fix the failing median test", backend="scripted",
                                    repository=repository)
        seq, start_ts = _event_ts(task.pk, "start", -1)
        _, turn_ts = _event_ts(task.pk, "turn_start", seq)
        out["first event"].append(start_ts - sent)
        out["first turn_start"].append(turn_ts - sent)
        _wait_finished(task.pk)
    return out


def _followups(owner, repository, repeats: int) -> dict[str, list[float]]:
    from webapp.agents import followups, services
    from webapp.agents.models import AgentTask

    task = services.task_create(owner=owner, prompt="Fix the failing median test", backend="scripted",
                                repository=repository)
    _wait_finished(task.pk)
    out: dict[str, list[float]] = {"first event": [], "first turn_start": []}
    for index in range(repeats):
        time.sleep(0.5)  # the worker is back in its warm wait
        last = AgentTask.objects.get(pk=task.pk).last_seq
        sent = time.time()
        followups.followup_send(task=AgentTask.objects.get(pk=task.pk), user=owner, message=f"Follow-up {index}")
        seq, user_ts = _event_ts(task.pk, "user_message", last)
        _, turn_ts = _event_ts(task.pk, "turn_start", seq)
        out["first event"].append(user_ts - sent)
        out["first turn_start"].append(turn_ts - sent)
        _wait_finished(task.pk)
    return out


def _print(name: str, samples: dict[str, list[float]]) -> None:
    for what, values in samples.items():
        print(f"{name:<34} {what:<17} median {statistics.median(values) * 1000:8.1f} ms   "
              f"min {min(values) * 1000:8.1f}   max {max(values) * 1000:8.1f}   (n={len(values)})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import django

    django.setup()
    ensure_database()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from django.contrib.auth import get_user_model

    User = get_user_model()
    from training.agent.demo_repo import write_demo_repository
    from webapp.agents.demo import DEMO_REPOSITORY_NAME
    from webapp.agents.models import Repository
    from webapp.agents.services import repository_create

    owner = User.objects.filter(username="bench-followups").first() or User.objects.create_user("bench-followups")
    path = write_demo_repository(Path(os.environ["FLOWSTATE_STATE_DIR"]) / "demo")
    repository = Repository.objects.filter(owner=owner, name=DEMO_REPOSITORY_NAME).first() or repository_create(
        owner=owner, name=DEMO_REPOSITORY_NAME, kind="path", location=str(path), allow_server_path=True)
    print(f"load average before: {os.getloadavg()}", flush=True)
    for warm_s, name in ((0, "rebuilt workspace"), (120, "warm workspace")):
        worker = _worker(warm_s)
        try:
            if not warm_s:  # a worker that keeps sandboxes warm would hold its slot between the new tasks
                _print("baseline: new task (same worker)", _first_turns(owner, repository, args.repeats))
            _print(f"follow-up, {name}", _followups(owner, repository, args.repeats))
        finally:
            worker.terminate()
            try:
                worker.wait(timeout=20)
            except subprocess.TimeoutExpired:
                worker.kill()
    print(f"load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
