"""sandboxes/proc.py: what one run owns is found by its environment marker, nothing else is touched,
and a process told to die with its parent does, even when the parent is SIGKILLed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid

from sandboxes import proc

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _spawn(env_extra: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(SLEEPER, env={**os.environ, **env_extra}, start_new_session=True)


def _wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive(pid):
            return True
        time.sleep(0.02)
    return False


def test_the_marker_finds_the_runs_processes_and_spares_look_alikes_and_other_runs():
    owner = f"/tmp/flowstate-test-{uuid.uuid4().hex}/var"
    ours = _spawn({proc.RUN_OWNER_ENV: owner})
    other_run = _spawn({proc.RUN_OWNER_ENV: owner + "-other"})
    prefix = _spawn({proc.RUN_OWNER_ENV: owner + "/sub"})
    same_name = _spawn({})
    try:
        # /proc/<pid>/environ is readable once the child has exec'd.
        deadline = time.monotonic() + 5
        while proc.run_processes(owner) != [ours.pid]:
            assert time.monotonic() < deadline, proc.run_processes(owner)
            time.sleep(0.02)
        assert proc.stop_run_processes(owner, grace_s=2.0) == 1
        assert ours.wait(timeout=5) == -signal.SIGTERM
        for survivor in (other_run, prefix, same_name):
            assert survivor.poll() is None
        assert proc.run_processes(owner, pgids=[same_name.pid]) == [same_name.pid]
        assert proc.run_processes(owner, pgids=[same_name.pid], spare_pgids=[same_name.pid]) == []
    finally:
        for child in (ours, other_run, prefix, same_name):
            child.kill()
            child.wait()


def test_a_marked_process_that_ignores_sigterm_is_killed_after_the_grace():
    owner = f"/tmp/flowstate-test-{uuid.uuid4().hex}/var"
    stubborn = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print('ready', flush=True); time.sleep(600)"],
        env={**os.environ, proc.RUN_OWNER_ENV: owner}, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert stubborn.stdout.readline() == b"ready\n"
        started = time.monotonic()
        assert proc.stop_run_processes(owner, grace_s=0.5) == 1
        assert stubborn.wait(timeout=5) == -signal.SIGKILL
        assert time.monotonic() - started < 3
    finally:
        stubborn.kill()
        stubborn.wait()


def test_the_marker_never_matches_the_caller_or_its_ancestors():
    owner = f"/tmp/flowstate-test-{uuid.uuid4().hex}/var"
    # A shell that exported the marker runs a child that looks for its own run.
    script = (
        "import os, subprocess, sys, time\n"
        "from sandboxes import proc\n"
        "sleeper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        "time.sleep(0.5)\n"
        "found = proc.run_processes(os.environ[proc.RUN_OWNER_ENV])\n"
        "sleeper.kill()\n"
        "print(sorted(found) == [sleeper.pid], os.getpid() in found, os.getppid() in found)\n"
    )
    result = subprocess.run(["/bin/sh", "-c", '"$0" -c "$1"; true', sys.executable, script], capture_output=True,
                            text=True, env={**os.environ, proc.RUN_OWNER_ENV: owner}, timeout=60)
    assert result.stdout.split() == ["True", "False", "False"], result.stderr


def test_die_with_parent_survives_exec_and_fires_when_the_parent_is_sigkilled():
    # parent: starts a child with the preexec hook, prints its pid, then waits to be killed.
    script = (
        "import subprocess, sys, time, signal\n"
        "from sandboxes import proc\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
        "                         preexec_fn=proc.die_with_parent(signal.SIGTERM), start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    try:
        assert proc.alive(child_pid)
        parent.kill()
        parent.wait()
        assert _wait_gone(child_pid), "the child outlived its SIGKILLed parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child_pid, signal.SIGKILL)
