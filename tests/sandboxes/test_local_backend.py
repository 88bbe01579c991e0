"""Local-backend specifics: warm pool, orphan reaping, registry, configuration errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from sandboxes import _holder, get_backend
from sandboxes.base import BackendUnavailable, RepoSource, SandboxLimits
from sandboxes.local_backend import LocalBackend, LocalBackendConfig
from tests.sandboxes.conftest import TEST_LIMITS

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def state_root():
    root = Path(tempfile.mkdtemp(prefix="flowstate-local-", dir="/tmp"))
    root.chmod(0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "f.txt").write_text("f\n")
    return tmp_path / "repo"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_warm_pool_hands_out_started_clean_sandboxes(state_root, repo):
    backend = LocalBackend(LocalBackendConfig(root=state_root, warm_pool_size=2))
    try:
        snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
        backend.prewarm(snapshot=snapshot, limits=TEST_LIMITS, wait=True)
        assert backend.warm_count(snapshot=snapshot, limits=TEST_LIMITS) == 2
        claimed = backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS)
        assert claimed.deadline > time.time() + TEST_LIMITS.lifetime_s - 5
        assert claimed.exec("cat f.txt").stdout == "f\n"
        claimed.write_bytes("f.txt", b"dirty\n")
        other = backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS)
        assert other.read_bytes("f.txt") == b"f\n"
        # The pool refills in the background.
        deadline = time.monotonic() + 30
        while backend.warm_count(snapshot=snapshot, limits=TEST_LIMITS) < 2:
            assert time.monotonic() < deadline, "warm pool did not refill"
            time.sleep(0.05)
        claimed.destroy()
        other.destroy()
    finally:
        backend.close()
    assert backend.reap_orphans() == 0
    assert list((state_root / "registry").iterdir()) == []


def test_destroy_kills_the_init_process_and_removes_state(state_root, repo):
    backend = LocalBackend(LocalBackendConfig(root=state_root))
    snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
    box = backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS)
    pid = box.holder_pid
    assert _alive(pid)
    assert (state_root / "registry" / f"{box.id}.json").exists()
    box.destroy()
    assert not _alive(pid)
    assert not (state_root / "sandboxes" / box.id).exists()
    assert not (state_root / "registry" / f"{box.id}.json").exists()


def test_sandboxes_die_with_their_owner_process_and_reap_orphans_clears_them(state_root, repo):
    """Killed by SIGKILL (no cleanup runs), the owner's sandboxes still end within seconds:
    their init processes (and slirp4netns, with network on) read EOF on the owner's lifeline pipe."""
    network = shutil.which("slirp4netns") is not None
    script = (
        "import os, sys; from pathlib import Path\n"
        "from sandboxes.local_backend import LocalBackend, LocalBackendConfig\n"
        "from sandboxes.base import RepoSource, SandboxLimits\n"
        f"backend = LocalBackend(LocalBackendConfig(root=Path({str(state_root)!r})))\n"
        f"snap = backend.snapshot_create(source=RepoSource(kind='path', location={str(repo)!r}))\n"
        "box = backend.sandbox_create(snapshot=snap, limits=SandboxLimits(lifetime_s=120, command_timeout_s=10,\n"
        f"                                                                network={network}))\n"
        "box.exec('sleep 100 >/dev/null 2>&1 &')\n"
        "network = box._holder.network.pid if box._holder.network else 0\n"
        "print(box.holder_pid, backend._factory.pid, network, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    backend = LocalBackend(LocalBackendConfig(root=state_root))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == -9, result.stderr
    holder, factory, slirp = (int(part) for part in result.stdout.split())
    assert bool(slirp) == network
    deadline = time.monotonic() + 5
    while _alive(holder) or _alive(factory) or (slirp and _alive(slirp)):
        assert time.monotonic() < deadline, "a sandbox, its network or the factory outlived its owner by 5 s"
        time.sleep(0.02)
    assert backend.reap_orphans() == 1
    assert list((state_root / "registry").iterdir()) == []
    assert backend.reap_orphans() == 0


def test_a_new_backend_reaps_what_crashed_owners_left(state_root, repo):
    script = (
        "from pathlib import Path\n"
        "from sandboxes.local_backend import LocalBackend, LocalBackendConfig\n"
        "from sandboxes.base import RepoSource, SandboxLimits\n"
        f"backend = LocalBackend(LocalBackendConfig(root=Path({str(state_root)!r})))\n"
        f"snap = backend.snapshot_create(source=RepoSource(kind='path', location={str(repo)!r}))\n"
        "box = backend.sandbox_create(snapshot=snap, limits=SandboxLimits(lifetime_s=120, command_timeout_s=10))\n"
        "print(box.holder_pid, flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60,
                            check=True)
    holder = int(result.stdout.strip())
    LocalBackend(LocalBackendConfig(root=state_root))
    deadline = time.monotonic() + 5
    while _alive(holder):
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_reap_orphans_ends_sandboxes_past_their_lifetime(state_root, repo):
    backend = LocalBackend(LocalBackendConfig(root=state_root))
    snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
    box = backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS)
    record_path = state_root / "registry" / f"{box.id}.json"
    record = json.loads(record_path.read_text())
    record["deadline"] = time.time() - 1
    record_path.write_text(json.dumps(record))
    live = backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS)
    assert backend.reap_orphans() == 1
    assert live.exec("echo fine").stdout == "fine\n"
    live.destroy()
    box.destroy()


def test_holder_exits_by_itself_at_the_lifetime(state_root, repo):
    backend = LocalBackend(LocalBackendConfig(root=state_root))
    snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
    box = backend.sandbox_create(snapshot=snapshot, limits=SandboxLimits(command_timeout_s=1, lifetime_s=1.5))
    pid = box.holder_pid
    box.exec("sleep 100 >/dev/null 2>&1 &")
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, "sandbox init outlived its lifetime"
        time.sleep(0.05)
    box.destroy()


def test_configuration_errors_say_how_to_fix_them(tmp_path):
    with pytest.raises(ValueError, match="must be absolute"):
        LocalBackendConfig(extra_readonly_paths=("relative/path",))
    with pytest.raises(ValueError, match="would shadow"):
        LocalBackendConfig(extra_readonly_paths=("/workspace",))
    with pytest.raises(ValueError, match="warm_pool_size"):
        LocalBackendConfig(warm_pool_size=-1)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    if os.geteuid() == 0:
        with pytest.raises(BackendUnavailable, match="chmod o\\+x"):
            LocalBackend(LocalBackendConfig(root=private / "state"))


def test_get_backend_returns_a_shared_configured_instance(settings, monkeypatch, state_root):
    settings.SANDBOX_ROOT = state_root
    settings.SANDBOX_BACKEND = "local"
    import sandboxes

    monkeypatch.setattr(sandboxes, "_backends", {})
    backend = get_backend()
    assert isinstance(backend, LocalBackend) and backend is get_backend("local")
    assert backend.root == state_root
    with pytest.raises(ValueError, match="unknown sandbox backend 'vm'"):
        get_backend("vm")


ROOTLESS_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from sandboxes.local_backend import LocalBackend, LocalBackendConfig
from sandboxes.base import RepoSource, SandboxLimits
backend = LocalBackend(LocalBackendConfig(root=Path(sys.argv[2]) / "state"))
snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=sys.argv[3]))
box = backend.sandbox_create(snapshot=snapshot, limits=SandboxLimits(lifetime_s=60, command_timeout_s=10,
                                                                    max_processes=16))
status = box.exec("grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; ls /proc/1/root/ 2>&1; cat /etc/shadow")
box.write_bytes("made.txt", b"made\\n")
print(json.dumps({"rootless": backend.rootless, "status": status.stdout, "diff": box.diff(),
                  "echo": box.exec("cat made.txt").stdout}))
box.destroy()
backend.close()
"""


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/python3").exists() or shutil.which("setpriv") is None,
                    reason="needs root to impersonate an unprivileged user, plus /usr/bin/python3 and setpriv")
def test_rootless_mode_works_for_an_unprivileged_user(tmp_path):
    """An ordinary user (no root on the host) gets the same isolation through its own user namespace."""
    work = Path(tempfile.mkdtemp(prefix="flowstate-rootless-", dir="/tmp"))
    try:
        (work / "repo").mkdir()
        (work / "repo" / "a.txt").write_text("a\n")
        # The user's own copy of the code: the checkout may sit in a directory only root can enter
        # (a clone under /root or a 700 temp dir), which an unprivileged user could not import from.
        shutil.copytree(REPO_ROOT / "sandboxes", work / "code" / "sandboxes",
                        ignore=shutil.ignore_patterns("__pycache__"))
        os.chown(work, 65534, 65534)
        for path in work.rglob("*"):
            os.chown(path, 65534, 65534)
        result = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
             ROOTLESS_SCRIPT, str(work / "code"), str(work), str(work / "repo")],
            capture_output=True, text=True, timeout=120, check=False, cwd="/tmp",
            env={"PATH": "/usr/bin:/bin", "HOME": str(work)},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report["rootless"] is True
        assert "CapEff:\t0000000000000000" in report["status"] and "NoNewPrivs:\t1" in report["status"]
        assert "Permission denied" in report["status"]
        assert "root:" not in report["status"]
        assert report["echo"] == "made\n"
        assert "+++ b/made.txt" in report["diff"]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_a_sandbox_dying_under_a_command_raises_sandbox_gone(state_root, repo):
    """Infrastructure failure mid-command must surface as SandboxGone, never as a failed command."""
    import signal
    import threading

    from sandboxes.base import SandboxGone

    backend = LocalBackend(LocalBackendConfig(root=state_root))
    snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
    box = backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS)
    killer = threading.Timer(0.5, os.kill, args=(box.holder_pid, signal.SIGKILL))
    killer.start()
    with pytest.raises(SandboxGone, match="ended while a command was running"):
        box.exec("sleep 10")
    killer.join()
    with pytest.raises(SandboxGone):
        box.exec("true")


def test_whole_sandbox_memory_is_capped_by_a_cgroup(state_root, repo):
    """Many processes, each within its own address-space limit, cannot together exceed the sandbox cap."""
    from sandboxes.cgroups import cgroups_available

    if not cgroups_available():
        pytest.skip("no writable cgroup v1 memory/pids hierarchy here; the sandbox relies on rlimits only")
    backend = LocalBackend(LocalBackendConfig(root=state_root))
    snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
    limits = SandboxLimits(memory_mb=160, disk_mb=16, max_processes=32, command_timeout_s=60, lifetime_s=120)
    box = backend.sandbox_create(snapshot=snapshot, limits=limits)
    try:
        cgroup = box.cgroup
        assert cgroup is not None
        hog = "python3 -c 'import time; b = b\"x\" * (100 * 1024 * 1024); time.sleep(2)'"
        box.exec(f"for i in 1 2 3 4 5 6; do {hog} & done; wait", timeout_s=60)
        peak = int((cgroup.paths["memory"] / "memory.max_usage_in_bytes").read_text())
        assert peak <= (limits.memory_mb + limits.disk_mb) * 1024 * 1024
        assert cgroup.memory_failures() > 0, "six 100 MiB processes should have hit the sandbox cap"
        assert box.exec("echo alive").stdout == "alive\n"
        paths = list(cgroup.paths.values())
    finally:
        box.destroy()
    assert not any(path.exists() for path in paths)


def test_a_forked_child_gets_its_own_factory_and_pool(state_root, repo):
    """Prefork servers fork after creating the backend; the child must not talk over the parent's pipes."""
    backend = LocalBackend(LocalBackendConfig(root=state_root))
    snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
    parent_box = backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        status = 1
        try:
            with backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS) as box:
                status = 0 if box.exec("cat f.txt").stdout == "f\n" else 2
        finally:
            os.write(write_end, bytes([status]))
            os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    assert os.read(read_end, 1) == b"\x00"
    os.close(read_end)
    with backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS) as again:
        assert again.exec("echo parent").stdout == "parent\n"
    assert parent_box.exec("echo still").stdout == "still\n"
    parent_box.destroy()
    backend.close()


@pytest.mark.parametrize(
    "lines",
    [["U", "P4242", "R"], ["U", "R", "P4242"]],
    ids=["pid-first", "ready-first"],
)
def test_holder_answers_with_the_pid_whichever_status_line_arrives_first(lines):
    # Under load the new pid 1 can report "R" before its parent reports its pid; the answer used to
    # be "OK None" then, and the backend failed with a ValueError instead of returning the sandbox.
    assert _holder.fold_status(lines, on_user_namespace=lambda: None) == "OK 4242"


def test_holder_reports_the_first_setup_error_over_a_later_ready():
    answer = _holder.fold_status(["U", "P7", "R"], on_user_namespace=lambda: "Ewriting uid/gid maps failed: x")
    assert answer == "Ewriting uid/gid maps failed: x"
    assert _holder.fold_status(["U", "P7", "Emount failed"], on_user_namespace=lambda: None) == "Emount failed"
    assert _holder.fold_status(["U"], on_user_namespace=lambda: None) == "Esandbox init exited during setup"
