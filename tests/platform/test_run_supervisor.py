"""`make run` stops everything it started, whatever signal arrives and however often (issue 52).

Each test starts the real supervisor (scripts/run.py: embedded Redis, migrate, Ray head, Celery
worker, sandbox fleet, uvicorn) from one shared copy of this checkout, waits for /healthz, stops it
the way a user or a process manager would, and walks /proc for anything of that run still alive
(its process groups, its state directory in a process's environment, working directory or command
line). A start is heavy (on two busy cores: about 170 s for the first, which migrates a fresh
SQLite database, then 60-70 s), so the copy is shared and the four cases (five starts, about 8
minutes) run in one module; each case's start is also the check that the stopped run before it left
nothing that keeps the next one from coming up.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.platform.supervisor_harness import (
    SCRUBBED,
    free_port,
    kill_leftovers,
    make_checkout_copy,
    spawn_marked_orphan,
    start_run,
    stop_and_time,
)

STOP_LIMIT_S = 20.0
"""From the first signal to the last process of the run gone (issue 52)."""

CHILDREN = ("asgi server", "sandbox fleet", "celery worker", "ray head", "embedded redis")

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def checkout():
    path = make_checkout_copy()
    yield path
    shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture
def started(checkout):
    runs = []

    def start():
        run = start_run(checkout)
        runs.append(run)
        assert run.healthz()["checks"]["database"]["ok"], run.healthz()
        return run

    yield start
    for run in runs:
        if run.process.poll() is None:
            run.process.send_signal(signal.SIGKILL)
            run.process.wait()
        kill_leftovers(run)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _assert_clean_stop(run, how: str) -> float:
    seconds, left = stop_and_time(run, how, limit_s=STOP_LIMIT_S + 10)
    assert not left, f"{how}: still alive {seconds:.1f}s after the first signal:\n" + "\n".join(left)
    assert seconds <= STOP_LIMIT_S, f"{how}: the run took {seconds:.1f}s to stop"
    assert run.process.wait(timeout=5) == 0, run.log()[-3000:]
    log = run.log()
    # The supervisor's own stop never raised (children may print theirs, e.g. Ray's SIGTERM handler).
    assert 'scripts/run.py", line' not in log, log[-3000:]
    assert f"] stopping ({'SIGTERM' if how == 'sigterm-group' else 'SIGINT'})" in log
    for name in CHILDREN:
        assert f"] stopped {name} at +" in log, f"{how}: no stop time logged for {name}:\n{log[-3000:]}"
    assert "] stopped everything in" in log
    assert not (run.state_dir / "run.pid").exists()
    stops = re.findall(r"\] stopped (.+? at \+[\d.]+s)", log)
    print(f"{how}: every process gone {seconds:.1f}s after the first signal; {', '.join(stops)}")
    return seconds


def _dead_within(pid: int, *, seconds: float) -> bool:
    """``pid`` has exited: gone, or a zombie its parent (init, for an orphan) has not reaped yet; a
    loaded machine's init can take a moment to reap what the supervisor killed."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                         if line.startswith("State:"))
        except (FileNotFoundError, ProcessLookupError):
            return True
        if "Z" in state.split()[1]:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def test_one_sigint_stops_every_process(started):
    run = started()
    orphan = spawn_marked_orphan(run)
    _assert_clean_stop(run, "sigint")
    assert _dead_within(orphan, seconds=10), f"the orphan {orphan} still runs after the stop"


def test_a_second_start_is_refused_and_sigterm_to_the_process_group_stops_every_process(started, checkout):
    run = started()
    # A second supervisor on the same state directory (another port) must leave the live run alone.
    env = {key: value for key, value in os.environ.items() if key not in SCRUBBED}
    env.update(FLOWSTATE_PORT=str(free_port()), PYTHONPATH=str(checkout))
    second = subprocess.run([sys.executable, str(checkout / "scripts" / "run.py")], cwd=checkout, env=env,
                            capture_output=True, text=True, timeout=120)
    assert second.returncode != 0
    assert f"another `make run` (pid {run.process.pid}) is running" in second.stderr + second.stdout
    assert run.healthz() is not None, "the refused start must leave the running one alone"
    assert not [line for line in run.leftovers()
                if "scripts/run.py" in line and int(line.split()[0]) != run.process.pid]
    _assert_clean_stop(run, "sigterm-group")


def test_three_signals_in_quick_succession_do_not_abort_the_stop(started):
    run = started()
    _assert_clean_stop(run, "three-signals")
    assert "ignored 2 further signal(s) while stopping (SIGTERM, SIGINT)" in run.log()


def test_after_kill_9_of_the_supervisor_the_next_start_removes_what_is_left(started):
    crashed = started()
    crashed_groups = crashed.pgids | {crashed.process.pid}
    orphan = spawn_marked_orphan(crashed)  # nothing but the next start will stop this one
    seconds, left = stop_and_time(crashed, "kill-9", limit_s=STOP_LIMIT_S, ignore={orphan})
    crashed.process.wait(timeout=5)
    # The supervisor's children get SIGTERM from the kernel (PR_SET_PDEATHSIG); whatever is left
    # (nothing, when they all stop in time) must be gone once the next run is up.
    assert os.path.exists(f"/proc/{orphan}")
    survivors = {int(line.split()[0]): line for line in left} | {orphan: "orphan"}
    restarted = started()
    # Both runs share the state directory, so the old run's processes are the survivors seen
    # above and anything still in its process groups.
    still = [line for pid, line in survivors.items() if not _dead_within(pid, seconds=10)]
    still += [line for line in crashed.leftovers() if _pgid(int(line.split()[0])) in crashed_groups]
    assert not still, "\n".join(still)
    assert "processes a previous run of" in restarted.log()
    assert "another `make run`" not in restarted.log()
    _assert_clean_stop(restarted, "sigint")
    print(f"kill -9: all processes gone {seconds:.1f}s after the signal; left then: {left}")


def test_a_busy_port_is_refused_without_touching_another_run(tmp_path):
    """Cheap (no services start): the supervisor stops nothing but its own state directory's leftovers."""
    from sandboxes import proc
    from tests.platform.supervisor_harness import ROOT

    other_state = tmp_path / "other" / "var"
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                                 env={**os.environ, proc.RUN_OWNER_ENV: str(other_state)})
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        env = {key: value for key, value in os.environ.items() if key not in SCRUBBED}
        env.update(FLOWSTATE_PORT=str(busy.getsockname()[1]), FLOWSTATE_STATE_DIR=str(tmp_path / "var"))
        try:
            result = subprocess.run([sys.executable, str(ROOT / "scripts" / "run.py")], cwd=ROOT, env=env,
                                    capture_output=True, text=True, timeout=120)
            assert result.returncode != 0
            assert f"port {busy.getsockname()[1]} is already in use" in result.stderr, result.stderr
            assert bystander.poll() is None, "a process of another state directory was stopped"
            assert not (tmp_path / "var" / "run.pid").exists()
        finally:
            bystander.kill()
            bystander.wait()
