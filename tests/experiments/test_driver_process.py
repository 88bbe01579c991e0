"""The RL driver as a process: recognised by pid and run directory, stopped with its whole process group."""

from __future__ import annotations

import subprocess
import sys
import time

from sandboxes import proc
from webapp.experiments.driver_process import driver_alive, driver_log_tail, driver_stop

STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "60"])
print(child.pid, flush=True)
time.sleep(60)
"""


def _start(run_dir, *, name="training.rollout.driver"):
    return subprocess.Popen([sys.executable, "-c", STUBBORN, name, str(run_dir / "driver_config.json")],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)


def test_a_driver_is_recognised_by_its_module_and_run_directory(tmp_path):
    driver = _start(tmp_path)
    other = _start(tmp_path, name="something.else")
    try:
        driver.stdout.readline()
        other.stdout.readline()
        assert driver_alive(driver.pid, str(tmp_path))
        assert not driver_alive(driver.pid, str(tmp_path / "another-run"))  # a reused pid of another run
        assert not driver_alive(other.pid, str(tmp_path))
        assert not driver_alive(None, str(tmp_path)) and not driver_alive(0, str(tmp_path))
    finally:
        for process in (driver, other):
            process.kill()
            process.wait()
    assert not driver_alive(driver.pid, str(tmp_path))


def test_a_driver_that_ignores_sigterm_is_killed_with_its_children(tmp_path):
    driver = _start(tmp_path)
    child = int(driver.stdout.readline())
    started = time.monotonic()
    driver_stop(driver.pid, grace_s=0.5)
    assert time.monotonic() - started < 5
    driver.wait(timeout=5)
    deadline = time.monotonic() + 5
    while proc.alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not proc.alive(child)


def test_the_log_tail_is_the_end_of_the_driver_log(tmp_path):
    assert driver_log_tail(str(tmp_path)) == ""
    (tmp_path / "driver.log").write_text("".join(f"line {n}\n" for n in range(40)))
    assert driver_log_tail(str(tmp_path), lines=2) == "line 38\nline 39"
