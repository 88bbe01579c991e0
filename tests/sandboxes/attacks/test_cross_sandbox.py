"""Sandboxes cannot see, signal or read each other's processes and files."""

from __future__ import annotations

import secrets
import time

from tests.sandboxes.conftest import TEST_LIMITS, host_is_healthy

# Reads /proc directly: not every sandbox image ships ps.
PROCESS_ARGS = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '"


def test_processes_of_another_sandbox_are_invisible_and_unkillable(sandbox_backend, make_snapshot):
    snapshot = make_snapshot({"a.txt": "a\n"})
    first, second = sandbox_backend.sandbox_fork(snapshot=snapshot, count=2, limits=TEST_LIMITS)
    try:
        marker = f"300.{secrets.randbelow(10**6):06d}"
        first.exec(f"sleep {marker} >/dev/null 2>&1 &")
        deadline = time.monotonic() + 10
        while marker not in first.exec(PROCESS_ARGS).stdout:
            assert time.monotonic() < deadline, "the background sleep never started"
            time.sleep(0.1)
        assert marker not in second.exec(PROCESS_ARGS).stdout
        second.exec("kill -9 -1; pkill -9 sleep; for p in $(seq 1 4000); do kill -9 $p 2>/dev/null; done; true",
                    timeout_s=60)
        assert marker in first.exec(PROCESS_ARGS).stdout
    finally:
        first.destroy()
        second.destroy()
    host_is_healthy()


def test_files_of_another_sandbox_are_unreachable(sandbox_backend, make_snapshot):
    snapshot = make_snapshot({"a.txt": "a\n"})
    first, second = sandbox_backend.sandbox_fork(snapshot=snapshot, count=2, limits=TEST_LIMITS)
    try:
        marker = f"cross-{secrets.token_hex(6)}"
        first.exec(f"echo {marker} > secret.txt && echo {marker} > /tmp/secret.txt")
        found = second.exec(
            f"grep -rls {marker} / --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr 2>/dev/null; "
            "cat secret.txt /tmp/secret.txt 2>&1", timeout_s=60)
        assert marker not in found.stdout
        assert "No such file" in found.stdout + found.stderr
    finally:
        first.destroy()
        second.destroy()
