"""Start the real `make run` supervisor (scripts/run.py) from a copy of this checkout and find every
process of that run, for tests/platform/test_run_supervisor.py and benchmarks/bench_stop.py.

The copy holds the working tree's tracked and untracked (not ignored) files, so what is tested is
what is checked out, edits included; it runs with this checkout's virtualenv interpreter, with
PYTHONPATH and the working directory set to the copy, so the copy's code (not the editable
install's) is what every child imports.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRUBBED = ("REDIS_URL", "RAY_ADDRESS", "DATABASE_URL", "FLOWSTATE_STATE_DIR", "FLOWSTATE_RUN_OWNER",
            "SANDBOX_ROOT", "STATIC_ROOT")


def make_checkout_copy() -> Path:
    """A temporary copy of this checkout's working tree (0755, as a clone in a home directory is)."""
    base = Path(tempfile.mkdtemp(prefix="fs-run-", dir="/tmp"))
    base.chmod(0o755)
    target = base / "repo"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.split(b"\0")
    for name in filter(None, listed):
        source = ROOT / os.fsdecode(name)
        if source.is_file():
            destination = target / os.fsdecode(name)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination)
    return target


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def _ancestors() -> set[int]:
    found, pid = set(), os.getpid()
    while pid > 1 and pid not in found:
        found.add(pid)
        stat = _read(f"/proc/{pid}/stat")
        if not stat:
            break
        pid = int(stat.rsplit(b")", 1)[1].split()[1])
    return found


@dataclass
class Run:
    checkout: Path
    port: int
    process: subprocess.Popen
    log_path: Path
    started_at: float
    pgids: set[int] = field(default_factory=set)

    @property
    def state_dir(self) -> Path:
        return self.checkout / "var"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_pgids(self) -> set[int]:
        """Each child runs in its own session: its pid is its process group."""
        return {int(pid) for pid in re.findall(r"\] started .+ \(pid (\d+)\)", self.log())}

    def healthz(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=5) as response:
                return json.loads(response.read())
        except (OSError, ValueError):
            return None

    def leftovers(self) -> list[str]:
        """Every live process of this run: in its process groups (the supervisor's and its children's),
        or with the run's state directory in its environment, working directory or command line."""
        groups = self.pgids | self.child_pgids() | {self.process.pid}
        marker = str(self.state_dir).encode()
        checkout = str(self.checkout).encode()
        spared = _ancestors()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in spared:
                continue
            stat = _read(f"/proc/{entry}/stat")
            if not stat:
                continue
            fields = stat.rsplit(b")", 1)[1].split()
            if fields[0] in (b"Z", b"X"):
                continue
            cmdline = _read(f"/proc/{entry}/cmdline")
            try:
                cwd = os.readlink(f"/proc/{entry}/cwd").encode()
            except OSError:
                cwd = b""
            if (int(fields[2]) in groups or marker in _read(f"/proc/{entry}/environ")
                    or cwd.startswith(checkout) or checkout in cmdline):
                command = cmdline.replace(b"\0", b" ")[:160].decode(errors="replace")
                found.append(f"{entry} {command}")
        return found


def start_run(checkout: Path, *, timeout_s: float = 300.0) -> Run:
    """`make run`'s command, in its own session (like `setsid make run`), up when /healthz answers."""
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key not in SCRUBBED}
    env.update(FLOWSTATE_PORT=str(port), PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    log_path = checkout.parent / f"run-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, str(checkout / "scripts" / "run.py")], cwd=checkout, env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    run = Run(checkout=checkout, port=port, process=process, log_path=log_path, started_at=time.monotonic())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the supervisor exited with {process.returncode}:\n{run.log()[-4000:]}")
        report = run.healthz()
        if report is not None and "is up on" in run.log():
            run.pgids = run.child_pgids()
            return run
        time.sleep(1)
    raise AssertionError(f"make run did not come up within {timeout_s:.0f}s:\n{run.log()[-4000:]}")


def stop_and_time(run: Run, how: str, *, limit_s: float = 30.0, ignore: set[int] = frozenset()) -> tuple[float, list[str]]:
    """Stop the run ``how`` (sigint | sigterm-group | three-signals | kill-9) and return the seconds
    from the first signal until no process of the run (but ``ignore``) was left (or ``limit_s``),
    with what is left."""
    run.pgids |= run.child_pgids()
    pid = run.process.pid
    began = time.monotonic()
    if how == "sigint":
        os.kill(pid, signal.SIGINT)
    elif how == "sigterm-group":
        os.killpg(pid, signal.SIGTERM)
    elif how == "three-signals":
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):
            os.kill(pid, sig)
            time.sleep(0.1)
    elif how == "kill-9":
        os.kill(pid, signal.SIGKILL)
    else:
        raise ValueError(f"how: unknown stop {how!r}")
    def remaining() -> list[str]:
        return [line for line in run.leftovers() if int(line.split()[0]) not in ignore]

    left = remaining()
    while left and time.monotonic() - began < limit_s:
        run.process.poll()  # reap the supervisor, which is our child
        time.sleep(0.05)
        left = remaining()
    return time.monotonic() - began, left


def spawn_marked_orphan(run: Run) -> int:
    """A process of the run that no child of the supervisor is the parent of, as an experiment
    driver is once the Celery pool process that launched it has died: own session, parent init."""
    env = {**os.environ, "FLOWSTATE_RUN_OWNER": str(run.state_dir), "FLOWSTATE_STATE_DIR": str(run.state_dir)}
    result = subprocess.run(["/bin/sh", "-c", "setsid sleep 600 >/dev/null 2>&1 & echo $!"], env=env,
                            capture_output=True, text=True, check=True, timeout=30)
    return int(result.stdout)


def kill_leftovers(run: Run) -> None:
    """Last resort for a failed test: SIGKILL what the run left (only its own processes)."""
    for line in run.leftovers():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(int(line.split()[0]), signal.SIGKILL)
