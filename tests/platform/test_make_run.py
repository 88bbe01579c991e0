"""`make run` from a checkout that other users cannot traverse (a 700 `mktemp -d`, /root, a 750 home).

The checkout is copied (tracked and untracked, non-ignored files: what a clone of this working tree
holds) into a fresh 0700 temporary directory, and `make run`'s supervisor (scripts/run.py) starts
there with the embedded defaults (SQLite, embedded Redis, a local Ray head, the local sandbox backend)
until /healthz answers ok; then SIGTERM stops it and every child it started.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from sandboxes.paths import default_sandbox_root, untraversable_ancestor

REPO = Path(__file__).resolve().parents[2]
# Variables a newcomer's shell does not have: the embedded defaults must apply.
SCRUBBED = ("DATABASE_URL", "REDIS_URL", "RAY_ADDRESS", "SANDBOX_ROOT", "SANDBOX_BACKEND", "FLOWSTATE_STATE_DIR",
            "DJANGO_SETTINGS_MODULE", "FLOWSTATE_PROFILE")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _copy_checkout(destination: Path) -> None:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=20) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:  # refused or slow while the server starts on a busy machine: ask again
        return 0, b""


def _stop(supervisor: subprocess.Popen) -> list[int]:
    """SIGTERM the supervisor's group; return the pids of its children still alive afterwards."""
    try:
        children = psutil.Process(supervisor.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    if supervisor.poll() is None:
        os.killpg(supervisor.pid, signal.SIGTERM)
    try:
        supervisor.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(supervisor.pid, signal.SIGKILL)
        supervisor.wait()
    _, alive = psutil.wait_procs(children, timeout=10)
    for process in alive:  # only processes this test started (descendants of its supervisor)
        process.kill()
    return [process.pid for process in alive]


def test_make_run_starts_from_a_directory_others_cannot_traverse():
    scratch = Path(tempfile.mkdtemp(prefix="flowstate-clone-"))  # mode 0700, like `mktemp -d`
    assert scratch.stat().st_mode & 0o777 == 0o700
    checkout = scratch / "flowstate"
    checkout.mkdir()
    _copy_checkout(checkout)
    assert untraversable_ancestor(checkout / "var" / "sandboxes") == scratch
    sandbox_root = default_sandbox_root(checkout / "var")
    port = _free_port()
    env = {key: value for key, value in os.environ.items() if key not in SCRUBBED}
    env["FLOWSTATE_PORT"] = str(port)
    log_path = scratch / "run.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        supervisor = subprocess.Popen([sys.executable, "scripts/run.py"], cwd=checkout, env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
    try:
        report, deadline = None, started + 420
        while time.monotonic() < deadline and supervisor.poll() is None:
            status, body = _get(f"http://127.0.0.1:{port}/healthz")
            if status == 200 and json.loads(body)["ok"]:
                report = json.loads(body)
                break
            time.sleep(1)
        output = log_path.read_text(errors="replace")
        assert report is not None, f"/healthz never became ok (supervisor exit {supervisor.poll()}):\n{output[-4000:]}"
        assert "BackendUnavailable" not in output and "Demo account" in output, output[-4000:]
        status, page = _get(f"http://127.0.0.1:{port}/login/")
        assert status == 200 and b'name="password"' in page
        print(f"make run from a 0700 directory: login page after {time.monotonic() - started:.1f}s")
        # The sandbox state went where the unprivileged sandbox uid can reach it, not into the clone.
        if os.geteuid() == 0:
            assert not sandbox_root.is_relative_to(scratch) and untraversable_ancestor(sandbox_root) is None
            assert (sandbox_root / "snapshots").is_dir()
    finally:
        leftovers = _stop(supervisor)
        shutil.rmtree(scratch, ignore_errors=True)
        if os.geteuid() == 0 and not sandbox_root.is_relative_to(scratch):
            shutil.rmtree(sandbox_root, ignore_errors=True)
    assert supervisor.returncode == 0
    assert leftovers == [], f"children outlived the supervisor: {leftovers}"


@pytest.fixture
def open_scratch():
    """A 0755 directory below only traversable ones (pytest's own tmp_path sits below a 0700 one)."""
    base = Path(tempfile.mkdtemp(dir="/var/tmp"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("euid", [0, 1000])
def test_default_sandbox_root_moves_only_when_root_cannot_share_the_checkout(open_scratch, euid):
    if untraversable_ancestor(open_scratch / "x") is not None:
        pytest.skip("/var/tmp sits below a directory others cannot traverse on this host")
    hidden = open_scratch / "hidden"
    hidden.mkdir(mode=0o700)
    open_dir = open_scratch / "open"
    open_dir.mkdir(mode=0o755)
    assert default_sandbox_root(open_dir / "var", euid=euid) == open_dir / "var" / "sandboxes"
    moved = default_sandbox_root(hidden / "var", euid=euid)
    if euid == 0:
        assert moved.parent == Path("/var/lib/flowstate") and moved.name.startswith("sandboxes-")
        # One directory per checkout: another hidden checkout gets another root.
        other = open_scratch / "hidden2"
        other.mkdir(mode=0o700)
        assert default_sandbox_root(other / "var", euid=0) != moved
    else:
        assert moved == hidden / "var" / "sandboxes"


def test_an_explicit_sandbox_root_below_a_closed_directory_is_refused_not_widened(open_scratch):
    if os.geteuid() != 0:
        pytest.skip("only root maps sandboxes onto another uid")
    from sandboxes.base import BackendUnavailable
    from sandboxes.local_backend import LocalBackend, LocalBackendConfig

    closed = open_scratch / "closed"
    closed.mkdir(mode=0o700)
    with pytest.raises(BackendUnavailable, match=f"below {closed}, which other users cannot traverse"):
        LocalBackend(LocalBackendConfig(root=closed / "sandboxes"))
    assert closed.stat().st_mode & 0o777 == 0o700  # the backend did not chmod the user's directory
