"""The semantic_search tool through sandboxes.tools on both backends: same text, shared index, fork edits."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from sandboxes.base import RepoSource, SandboxLimits
from sandboxes.tools import ToolCall, execute_tool_calls

LIMITS = SandboxLimits(command_timeout_s=30, lifetime_s=300, memory_mb=512, max_processes=64, disk_mb=64)


def _docker_skip_reason() -> str | None:
    try:
        import docker

        client = docker.from_env(timeout=5)
        client.ping()
        client.images.get(os.environ.get("SANDBOX_IMAGE", "flowstate-sandbox:latest"))
    except Exception as exc:  # noqa: BLE001 - any engine or image problem means "cannot run docker here"
        return f"Docker engine or sandbox image unavailable ({type(exc).__name__}: {exc})"
    return None


@pytest.fixture(params=["local", pytest.param("docker", marks=pytest.mark.docker)])
def backend(request):
    root = Path(tempfile.mkdtemp(prefix=f"flowstate-semantic-{request.param}-"))
    root.chmod(0o755)
    if request.param == "local":
        from sandboxes.local_backend import LocalBackend, LocalBackendConfig

        backend = LocalBackend(LocalBackendConfig(root=root))
    else:
        reason = _docker_skip_reason()
        if reason:
            shutil.rmtree(root, ignore_errors=True)
            pytest.skip(reason)
        from sandboxes.docker_backend import DockerBackend, DockerBackendConfig

        backend = DockerBackend(DockerBackendConfig(root=root))
    yield backend
    if hasattr(backend, "close"):
        backend.close()
    shutil.rmtree(root, ignore_errors=True)


def test_tool_finds_code_and_each_fork_sees_its_own_edit(backend, tiny_repository, settings, tmp_path):
    settings.SEMANTIC_INDEX_ROOT = str(tmp_path / "index")
    settings.SEMANTIC_VECTOR_STORE = "memory"
    settings.SEMANTIC_BACKGROUND_INDEXING = False  # semantic hits from the first call (BM25 stand-in: test_background_index)
    snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(tiny_repository)))
    forks = backend.sandbox_fork(snapshot=snapshot, count=2, limits=LIMITS)
    try:
        edited, untouched = forks
        results = execute_tool_calls(sandbox=edited, calls=[
            ToolCall("1", "create_file", {"path": "app/mail.py",
                                          "content": "def send_weekly_email_report(recipient):\n    return recipient\n"}),
            ToolCall("2", "semantic_search", {"query": "send the weekly report by email", "k": 2}),
            ToolCall("3", "semantic_search", {"query": "   ", "k": 2}),
        ])
        assert [result.ok for result in results] == [True, True, False]
        assert "1. app/mail.py:1-2 (score" in results[1].output
        assert "non-empty" in results[2].output

        (other,) = execute_tool_calls(sandbox=untouched, calls=[
            ToolCall("4", "semantic_search", {"query": "send the weekly report by email", "k": 5}),
        ])
        assert other.ok and "app/mail.py" not in other.output
        assert other.output.count("\n1. ") == 1
        index_directories = [path for path in (tmp_path / "index").glob("*/*") if path.is_dir()]
        assert len(index_directories) == 1
        chunk_rows = (index_directories[0] / "chunks.jsonl").read_text().count("\n")
        # durations.py: head + function; cache.py: class; geometry.py: head + function; deploy.md: one window.
        assert chunk_rows == 6
    finally:
        for sandbox in forks:
            sandbox.destroy()
