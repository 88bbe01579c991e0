"""Fork bombs, memory bombs, disk fills and runaway CPU hit sandbox limits; the host keeps headroom."""

from __future__ import annotations

import time

import pytest

from sandboxes.base import SandboxLimitExceeded, SandboxLimits
from sandboxes.tools import ToolCall, execute_tool_calls
from tests.sandboxes.conftest import TEST_LIMITS, host_is_healthy, under_gvisor


def terminal(sandbox, command, timeout_s=15):
    return execute_tool_calls(sandbox=sandbox, calls=[
        ToolCall("c", "run_terminal", {"command": command, "timeout_s": timeout_s})])[0]


def test_fork_bomb_is_capped_and_sandbox_recovers(sandbox):
    started = time.monotonic()
    # A fork-free busy loop keeps the shell alive until the timeout kills the whole process group.
    result = terminal(sandbox, "bomb(){ bomb | bomb & }; bomb; while :; do :; done", timeout_s=3)
    assert time.monotonic() - started < 30
    # Either the timeout kills the group or the backend's process cap kills the shell: never success.
    assert not result.ok, result.output[-2000:]
    assert "timed out" in result.output or result.meta["exit_code"] != 0
    host_is_healthy()
    assert sandbox.exec("echo alive", timeout_s=10).stdout.strip() == "alive"
    count = len(sandbox.exec("ls -d /proc/[0-9]*", timeout_s=10).stdout.split())
    assert count <= TEST_LIMITS.max_processes


def test_memory_bomb_fails_inside_the_sandbox(sandbox):
    result = terminal(sandbox, f"python3 -c 'b = bytearray({TEST_LIMITS.memory_mb * 4} * 1024 * 1024); print(len(b))'")
    assert not result.ok
    assert "MemoryError" in result.output or "Killed" in result.output or result.meta["exit_code"] != 0
    assert "[exit code" in result.output
    host_is_healthy()


def test_disk_fill_hits_the_quota_not_the_host(sandbox):
    quota = TEST_LIMITS.disk_mb * 1024 * 1024
    result = terminal(sandbox, f"dd if=/dev/zero of=big bs=1M count={TEST_LIMITS.disk_mb * 3} 2>&1; ls -l big")
    assert not result.ok or "No space" in result.output or "File size limit" in result.output
    size = int(sandbox.exec("stat -c %s big").stdout.strip() or 0)
    assert size <= quota
    # /tmp shares the quota, so filling it cannot go around the workspace limit.
    tmp = terminal(sandbox, f"dd if=/dev/zero of=/tmp/big bs=1M count={TEST_LIMITS.disk_mb * 3} 2>&1")
    assert not tmp.ok
    try:
        sandbox.write_bytes("more.bin", b"x" * quota)
        raise AssertionError("writing past the quota through the file API must fail")
    except SandboxLimitExceeded as exc:
        assert "quota" in str(exc)
    sandbox.exec("rm -f big /tmp/big")
    assert sandbox.exec("echo ok > after.txt && cat after.txt").stdout.strip() == "ok"
    host_is_healthy()


def test_runaway_command_is_killed_at_the_timeout(sandbox):
    started = time.monotonic()
    result = terminal(sandbox, "sleep 600 & while :; do :; done", timeout_s=2)
    assert result.meta["timed_out"] and not result.ok
    assert "timed out after 2s" in result.output
    assert time.monotonic() - started < 10
    # The whole process group died, background sleep included.
    assert "sleep 600" not in sandbox.exec("ps -eo args --no-headers").stdout
    host_is_healthy()


def test_cpu_seconds_limit_kills_a_spinning_process(sandbox_backend, make_snapshot):
    if under_gvisor(sandbox_backend):
        pytest.skip("gVisor does not enforce RLIMIT_CPU: measured, `ulimit -t 2` then a Python spin loop ran "
                    "until its 15 s command timeout; under runsc CPU is bounded by the command timeout, the "
                    "container's CPU share and the sandbox lifetime")
    limits = SandboxLimits(cpu_seconds=1, memory_mb=256, max_processes=32, disk_mb=16,
                           command_timeout_s=30, lifetime_s=60)
    box = sandbox_backend.sandbox_create(snapshot=make_snapshot({"x.txt": "x\n"}), limits=limits)
    try:
        result = box.exec("python3 -c 'while True: pass'", timeout_s=30)
        assert not result.timed_out
        assert result.exit_code != 0
    finally:
        box.destroy()
