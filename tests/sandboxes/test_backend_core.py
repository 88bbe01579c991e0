"""The one backend core: settings handed over once, one liveness check, shared warm pool and output cap."""

from __future__ import annotations

import ast
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

import sandboxes
from sandboxes import proc
from sandboxes import settings as sandbox_settings
from sandboxes.backend_core import CappedOutput, setup_result_check
from sandboxes.base import ExecResult, RepoSource, SnapshotError
from sandboxes.docker_backend import _owner_alive
from sandboxes.local_backend import LocalBackend, LocalBackendConfig
from tests.sandboxes.conftest import TEST_LIMITS

SANDBOXES_DIR = Path(sandboxes.__file__).parent


def test_no_module_of_sandboxes_imports_django():
    importers = []
    for path in SANDBOXES_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(name == "django" or name.startswith("django.") for name in names):
                importers.append(str(path.relative_to(SANDBOXES_DIR)))
    assert importers == []


def test_settings_come_from_the_environment_until_configured(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox_settings, "_configured", None)
    monkeypatch.setenv("SANDBOX_BACKEND", "docker")
    monkeypatch.setenv("SANDBOX_ROOT", str(tmp_path / "env-root"))
    monkeypatch.setenv("SANDBOX_IMAGE", "img:env")
    monkeypatch.setenv("FLOWSTATE_GIT_ALLOWED_HOSTS", "Git.Example, ")
    monkeypatch.setenv("SEMANTIC_VECTOR_STORE", "memory")
    current = sandbox_settings.current()
    assert (current.backend, current.root, current.image) == ("docker", tmp_path / "env-root", "img:env")
    assert current.git_hosts_allowed() == {"git.example"}
    assert current.semantic_setting("SEMANTIC_VECTOR_STORE") == "memory"
    assert current.database_dsn() is None
    given = sandbox_settings.SandboxSettings(root=tmp_path / "given", git_allowed_hosts=("internal",),
                                             semantic={"SEMANTIC_VECTOR_STORE": "auto"})
    sandbox_settings.configure(given)
    assert sandbox_settings.current() is given
    # The environment still adds git hosts and fills semantic settings the caller did not give.
    assert given.git_hosts_allowed() == {"internal", "git.example"}
    assert given.semantic_setting("SEMANTIC_VECTOR_STORE") == "auto"
    with pytest.raises(ValueError, match="unknown sandbox backend 'vm'"):
        sandbox_settings.SandboxSettings(backend="vm")
    with pytest.raises(ValueError, match="unknown names"):
        sandbox_settings.SandboxSettings(semantic={"SEMANTIC_TYPO": "x"})
    with pytest.raises(TypeError):
        sandbox_settings.configure({"backend": "local"})


def test_the_web_app_hands_over_its_settings_and_every_override(settings, tmp_path):
    settings.SANDBOX_ROOT = tmp_path / "overridden"
    settings.GIT_ALLOWED_HOSTS = ["Repo.Internal"]
    settings.SANDBOX_IMAGE = "img:override"
    current = sandbox_settings.current()
    assert (current.root, current.image) == (tmp_path / "overridden", "img:override")
    assert "repo.internal" in current.git_hosts_allowed()
    assert current.database["NAME"] == settings.DATABASES["default"]["NAME"]


def test_one_liveness_check_tells_pid_reuse_and_zombies_apart():
    me = os.getpid()
    assert proc.alive(me) and proc.alive(me, proc.start_time(me))
    assert not proc.alive(me, proc.start_time(me) + 1)  # same pid, another process
    child = subprocess.Popen(["true"])
    while proc.proc_info(child.pid).state != "Z":
        pass
    assert proc.start_time(child.pid) is None and not proc.alive(child.pid)  # a zombie is dead
    child.wait()
    assert not proc.alive(child.pid)


def test_a_container_owner_is_alive_only_as_the_same_process_on_this_host():
    me = os.getpid()
    labels = {"flowstate.owner-host": socket.gethostname(), "flowstate.owner-pid": str(me),
              "flowstate.owner-start": repr(proc.start_time(me))}
    assert _owner_alive(labels)
    assert not _owner_alive({**labels, "flowstate.owner-start": repr(proc.start_time(me) + 1)})
    assert not _owner_alive({**labels, "flowstate.owner-host": "another-host"})
    assert not _owner_alive({**labels, "flowstate.owner-start": "1700000000.5"})  # unreadable: not the owner
    assert not _owner_alive({**labels, "flowstate.owner-pid": "0"})


def test_output_is_capped_per_stream_with_a_note():
    output = CappedOutput(5)
    output.add(b"abc")
    output.add(b"defgh")
    assert output.text() == "abcde\n[sandbox: 3 more bytes of output were dropped]\n"
    assert CappedOutput(5).text() == ""


def test_a_failed_setup_command_refuses_the_snapshot_with_its_output():
    setup_result_check("true", ExecResult(exit_code=0, stdout="", stderr="", timed_out=False, duration_s=0.1))
    with pytest.raises(SnapshotError, match="'make' exited with 2: boom"):
        setup_result_check("make", ExecResult(exit_code=2, stdout="", stderr="boom", timed_out=False, duration_s=1))
    with pytest.raises(SnapshotError, match="timed out"):
        setup_result_check("sleep 9", ExecResult(exit_code=-9, stdout="", stderr="", timed_out=True, duration_s=1))


@pytest.fixture
def local_backend(tmp_path):
    root = Path(tempfile.mkdtemp(prefix="flowstate-core-", dir="/tmp"))
    root.chmod(0o711)
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "f.txt").write_text("f\n")
    backend = LocalBackend(LocalBackendConfig(root=root))
    yield backend, backend.snapshot_create(source=RepoSource(kind="path", location=str(tmp_path / "repo")))
    backend.close()
    shutil.rmtree(root, ignore_errors=True)


def test_prewarm_with_a_count_works_on_the_local_backend_too(local_backend):
    backend, snapshot = local_backend
    backend.prewarm(snapshot=snapshot, limits=TEST_LIMITS, count=1, wait=True)
    assert backend.warm_count(snapshot=snapshot, limits=TEST_LIMITS) == 1
    with pytest.raises(ValueError, match="between 0 and 64"):
        backend.prewarm(snapshot=snapshot, limits=TEST_LIMITS, count=65)
    backend.snapshot_delete(snapshot=snapshot)
    assert backend.warm_count(snapshot=snapshot, limits=TEST_LIMITS) == 0


def test_fork_refuses_a_boolean_count_on_both_backends_alike(local_backend):
    backend, snapshot = local_backend
    with pytest.raises(ValueError, match="positive integer"):
        backend.sandbox_fork(snapshot=snapshot, count=True, limits=TEST_LIMITS)
