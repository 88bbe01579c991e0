"""The Docker backend against the real engine and the offline-built sandbox image."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sandboxes.base import PathOutsideWorkspace, RepoSource, SandboxGone, SandboxLimits

pytestmark = pytest.mark.docker

LIMITS = SandboxLimits(command_timeout_s=20, lifetime_s=120, memory_mb=256, max_processes=64, disk_mb=64)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from sandboxes.base import BackendUnavailable
    from sandboxes.docker_backend import DockerBackend, DockerBackendConfig

    try:
        backend = DockerBackend(DockerBackendConfig(root=tmp_path_factory.mktemp("docker-root"), cpus=0.5))
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def snapshot(backend, tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    (repo / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (repo / "test_calc.py").write_text("from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    return backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))


def test_commands_run_locked_down(backend, snapshot):
    with backend.sandbox_create(snapshot=snapshot, limits=LIMITS) as sandbox:
        result = sandbox.exec("id -u; pwd; grep CapEff /proc/self/status; grep NoNewPrivs /proc/self/status; echo oops >&2; exit 3")
        assert result.exit_code == 3 and result.stderr == "oops\n" and not result.timed_out
        uid, cwd, caps, nnp = result.stdout.splitlines()
        assert (uid, cwd) == ("1000", "/workspace")
        assert caps.split()[1] == "0000000000000000" and nnp.split()[1] == "1"
        assert sandbox.exec("python3 -m pytest -q test_calc.py").exit_code == 0
        assert "Read-only file system" in sandbox.exec("touch /usr/x").stderr
        assert sandbox.exec("echo ok > /tmp/t && cat /tmp/t").stdout == "ok\n"
        offline = sandbox.exec("python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), timeout=2)'")
        assert offline.exit_code != 0 and "unreachable" in offline.stderr
        # pids_limit: a fork bomb fails inside the sandbox, the sandbox keeps working.
        bomb = sandbox.exec("for i in $(seq 200); do sleep 5 & done; wait", timeout_s=10)
        assert "fork" in bomb.stderr.lower() or "resource" in bomb.stderr.lower()
        assert sandbox.exec("echo alive").stdout == "alive\n"


def test_timeout_kills_the_command_and_its_children(backend, snapshot):
    with backend.sandbox_create(snapshot=snapshot, limits=LIMITS) as sandbox:
        started = time.monotonic()
        result = sandbox.exec("sh -c 'sleep 61' & sleep 62", timeout_s=1)
        assert result.timed_out and result.exit_code == -9
        assert time.monotonic() - started < 6
        left = sandbox.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
        assert "sleep 6" not in left and "sleep" in left  # only the container's own lifetime sleep is left


def test_host_file_tools_and_diff(backend, snapshot):
    with backend.sandbox_create(snapshot=snapshot, limits=LIMITS) as sandbox:
        sandbox.write_bytes("pkg/new.py", b"x = 1\n")
        assert sandbox.exec("cat pkg/new.py && stat -c %u pkg/new.py").stdout == "x = 1\n1000\n"
        sandbox.exec("sed -i 's/a + b/a - b/' calc.py")
        assert sandbox.read_bytes("calc.py") == b"def add(a, b):\n    return a - b\n"
        assert [e.name for e in sandbox.list_dir("")] == ["calc.py", "pkg", "test_calc.py"]
        diff = sandbox.diff()
        assert "-    return a + b\n+    return a - b\n" in diff
        assert "diff --git a/pkg/new.py b/pkg/new.py\nnew file mode 100644\n" in diff
        sandbox.exec("ln -s /etc/passwd escape")
        with pytest.raises(PathOutsideWorkspace):
            sandbox.read_bytes("escape")
        with pytest.raises(PathOutsideWorkspace):
            sandbox.read_bytes("../etc/passwd")
        sandbox.reset()
        assert sandbox.diff() == ""
        assert sandbox.read_bytes("calc.py").endswith(b"a + b\n")


def test_forks_are_independent_copy_on_write(backend, snapshot):
    forks = backend.sandbox_fork(snapshot=snapshot, count=3, limits=LIMITS)
    try:
        assert len({f.id for f in forks}) == 3
        forks[0].exec("echo changed > calc.py")
        assert forks[1].read_bytes("calc.py").startswith(b"def add")
        assert forks[0].read_bytes("calc.py") == b"changed\n"
        quota = forks[2].exec("head -c 100000000 /dev/zero > big.bin")
        assert quota.exit_code != 0  # the 64 MiB workspace quota
    finally:
        for fork in forks:
            fork.destroy()
    with pytest.raises(SandboxGone):
        forks[0].exec("true")
    with pytest.raises(ValueError, match="positive integer"):
        backend.sandbox_fork(snapshot=snapshot, count=0, limits=LIMITS)


def test_lifetime_ends_the_sandbox(backend, snapshot):
    short = SandboxLimits(command_timeout_s=1, lifetime_s=2, memory_mb=128)
    sandbox = backend.sandbox_create(snapshot=snapshot, limits=short)
    assert sandbox.exec("echo up").stdout == "up\n"
    time.sleep(2.2)
    with pytest.raises(SandboxGone, match="lifetime"):
        sandbox.exec("echo late")
    assert not backend._client.api.containers(all=True, filters={"id": sandbox.container_id or "none"})


def test_reap_orphans_removes_sandboxes_of_a_dead_owner(backend, snapshot):
    script = textwrap.dedent(f"""
        import pathlib, sys, time
        from sandboxes.base import RepoSource, SandboxLimits
        from sandboxes.docker_backend import DockerBackend, DockerBackendConfig
        backend = DockerBackend(DockerBackendConfig(root=pathlib.Path({str(backend.root)!r})))
        snap = backend.snapshot_create(source=RepoSource(kind="path", location={snapshot.location!r}))
        sandbox = backend.sandbox_create(snapshot=snap, limits=SandboxLimits(lifetime_s=600))
        print(sandbox.container_id, flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=os.getcwd())
    container_id = child.stdout.readline().strip()
    assert container_id, "the child process failed to create its sandbox"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    with backend.sandbox_create(snapshot=snapshot, limits=LIMITS) as mine:
        assert backend.reap_orphans() == 1
        assert not backend._client.api.containers(all=True, filters={"id": container_id})
        assert mine.exec("echo still here").stdout == "still here\n"  # a live owner's sandbox survives


def test_warm_pool_claim_is_a_started_sandbox_and_refills(backend, snapshot):
    backend.prewarm(snapshot=snapshot, limits=LIMITS, count=2, wait=True)
    assert backend.warm_count(snapshot=snapshot, limits=LIMITS) == 2
    started = time.monotonic()
    sandbox = backend.sandbox_create(snapshot=snapshot, limits=LIMITS)
    claim_s = time.monotonic() - started
    try:
        assert claim_s < 0.5
        assert sandbox.exec("echo warm").stdout == "warm\n"
        # The claimed sandbox has its whole lifetime ahead: its container outlives the deadline.
        labels = backend._client.api.inspect_container(sandbox.container_id)["Config"]["Labels"]
        assert float(labels["flowstate.deadline"]) >= sandbox.deadline
        deadline = time.monotonic() + 20
        while backend.warm_count(snapshot=snapshot, limits=LIMITS) < 2:  # refilled in the background
            assert time.monotonic() < deadline, "the warm pool was not refilled"
            time.sleep(0.1)
    finally:
        sandbox.destroy()
        backend.close()
    assert backend.warm_count(snapshot=snapshot, limits=LIMITS) == 0
    with pytest.raises(ValueError, match="between 0 and 64"):
        backend.prewarm(snapshot=snapshot, limits=LIMITS, count=100)
