"""Host secrets are invisible: shadow file, home directories, environment, host processes, our files."""

from __future__ import annotations

import os
import secrets

from sandboxes.tools import ToolCall, execute_tool_calls
from tests.sandboxes.conftest import host_is_healthy


def run(sandbox, command):
    return execute_tool_calls(sandbox=sandbox, calls=[ToolCall("c", "run_terminal", {"command": command})])[0]


def test_shadow_and_home_directories_are_hidden(sandbox):
    result = sandbox.exec("cat /etc/shadow; echo ---; ls -A /root /home 2>&1; echo ---; ls /etc/ssh 2>&1")
    shadow = result.stdout.split("---")[0]
    assert "root:" not in shadow and "$" not in shadow
    listing = result.stdout.split("---")[1]
    assert ".bashrc" not in listing and ".pyenv" not in listing and ".ssh" not in listing
    assert "ssh_host" not in result.stdout.split("---")[2]
    host_is_healthy()


def test_host_environment_variables_do_not_leak(sandbox, monkeypatch):
    marker = f"flowstate-secret-{secrets.token_hex(8)}"
    monkeypatch.setenv("FLOWSTATE_LEAK_CANARY", marker)
    monkeypatch.setenv("DATABASE_URL", f"postgres://admin:{marker}@127.0.0.1/x")
    result = run(sandbox, "env; cat /proc/self/environ | tr '\\0' '\\n'; cat /proc/1/environ 2>&1 | tr '\\0' '\\n'")
    assert marker not in result.output
    assert "FLOWSTATE_LEAK_CANARY" not in result.output


def test_host_processes_and_platform_files_are_invisible(sandbox):
    result = sandbox.exec("ps -eo pid,comm --no-headers; echo ---; ls / ; echo ---; ls /work /var/lib/postgresql 2>&1")
    processes, root_listing, probes = result.stdout.split("---")
    host_pid = str(os.getpid())
    assert host_pid not in processes.split()
    assert "postgres" not in processes and "redis" not in processes and "pytest" not in processes
    assert len(processes.strip().splitlines()) < 10, processes
    assert "work" not in root_listing.split()
    assert "No such file" in probes


def test_sandbox_runs_unprivileged_without_capabilities(sandbox):
    status = sandbox.exec("grep -E '^(Uid|CapEff|CapPrm)' /proc/self/status").stdout
    fields = dict(line.split(":", 1) for line in status.strip().splitlines())
    assert int(fields["CapEff"].strip(), 16) == 0
    assert int(fields["CapPrm"].strip(), 16) == 0
    # prctl(PR_GET_NO_NEW_PRIVS) itself: gVisor's /proc/self/status has no NoNewPrivs line.
    no_new_privs = sandbox.exec("python3 -c 'import ctypes; print(ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))'")
    assert no_new_privs.stdout.strip() == "1", no_new_privs
    assert fields["Uid"].split()[0] != "0" or os.geteuid() != 0
