"""The RL driver as an operating-system process: start it, tell whether it still runs, stop it.

No database here: ``webapp.experiments.monitor`` decides when to start or stop a driver and records
what happened. A driver runs in its own session (its pid is its process group), so stopping it
reaches the children it started too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sandboxes import proc

ROOT = Path(__file__).resolve().parents[2]
DRIVER_MODULE = "training.rollout.driver"
CONFIG_FILE = "driver_config.json"
LOG_FILE = "driver.log"


def driver_alive(pid: int | None, run_dir: str) -> bool:
    """True if `pid` is a live driver process of this run directory (pids get reused)."""
    if not pid or not proc.alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            command = handle.read().split(b"\0")
    except OSError:
        return False
    return DRIVER_MODULE.encode() in command and any(
        part.decode(errors="replace") == str(Path(run_dir) / CONFIG_FILE) for part in command
    )


def driver_start(*, run_dir: Path, config: dict) -> subprocess.Popen:
    """Write the driver's config into ``run_dir`` and start it in its own session, logging to the run dir."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / CONFIG_FILE
    config_path.write_text(json.dumps(config))
    log = open(run_dir / LOG_FILE, "ab")  # noqa: SIM115  (handed to the child, closed below)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", DRIVER_MODULE, "--config", str(config_path)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        )
    finally:
        log.close()


def driver_log_tail(run_dir: str, lines: int = 15) -> str:
    path = Path(run_dir) / LOG_FILE
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_for_exit(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            finished, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            finished = pid if not Path(f"/proc/{pid}").exists() else 0
        if finished == pid or not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.2)
    return False


def driver_stop(pid: int, *, grace_s: float = 120.0) -> None:
    """SIGTERM the driver (it checkpoints and exits); SIGKILL its whole process group after ``grace_s``."""
    os.kill(pid, signal.SIGTERM)
    if not wait_for_exit(pid, timeout_s=grace_s):
        os.killpg(pid, signal.SIGKILL)
        wait_for_exit(pid, timeout_s=10)
