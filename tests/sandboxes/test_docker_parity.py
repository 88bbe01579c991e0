"""The same tool calls give byte-identical results on the local and the Docker backend."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import pytest

from sandboxes.base import BackendUnavailable, RepoSource, SandboxLimits
from sandboxes.tools import ToolCall, execute_tool_calls

pytestmark = pytest.mark.docker

LIMITS = SandboxLimits(command_timeout_s=30, lifetime_s=300, memory_mb=512, max_processes=64, disk_mb=64)

FILES = {
    "app/calc.py": "import os\n\n\ndef add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n",
    "app/__init__.py": "",
    "tests/test_calc.py": "from app.calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
    "README.md": "# calc\n\nAdds numbers.\n",
}

TURNS = [
    [ToolCall("1", "list_dir", {"path": "."}), ToolCall("2", "read_file", {"path": "app/calc.py"}),
     ToolCall("3", "grep", {"pattern": "def \\w+", "path": "."})],
    [ToolCall("4", "edit_file", {"path": "app/calc.py", "old_str": "return a - b", "new_str": "return a - b + undefined_name"}),
     ToolCall("5", "create_file", {"path": "app/util.py", "content": "import sys\n\n\ndef twice(x):\n    return 2 * x\n"})],
    [ToolCall("6", "read_lints", {}), ToolCall("7", "read_file", {"path": "app/calc.py", "start_line": 7, "end_line": 9}),
     # Only commands both toolchains share: the local backend runs the host's /usr, Docker the image's.
     ToolCall("8", "run_terminal", {"command": "python3 -c 'from app.calc import add; print(add(2, 3))'; "
                                               "echo $HOME $USER $TMPDIR; id -u; pwd; git --version | cut -c1-11"}),
     ToolCall("9", "read_file", {"path": "../etc/passwd"}), ToolCall("10", "list_dir", {"path": "app"})],
]


def _transcript(backend, repo) -> tuple[list[dict], str]:
    snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
    with backend.sandbox_create(snapshot=snapshot, limits=LIMITS) as sandbox:
        results = []
        for calls in TURNS:
            for result in execute_tool_calls(sandbox=sandbox, calls=calls):
                record = dataclasses.asdict(result)
                record.pop("duration_s")
                record["meta"] = {k: v for k, v in record["meta"].items() if "duration" not in k}
                results.append(record)
        return results, sandbox.diff()


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_tool_results_and_diff_are_identical_on_local_and_docker(tmp_path, request, runtime):
    """Local vs Docker on each OCI runtime (runsc skips with the backend's refusal where it cannot run)."""
    from sandboxes.docker_backend import DockerBackend, DockerBackendConfig
    from sandboxes.local_backend import LocalBackend, LocalBackendConfig

    repo = tmp_path / "repo"
    for relative, text in FILES.items():
        (repo / relative).parent.mkdir(parents=True, exist_ok=True)
        (repo / relative).write_text(text)
    # Local sandbox init processes run as an unprivileged uid: the state root must be traversable.
    state = Path(tempfile.mkdtemp(prefix="flowstate-parity-", dir="/tmp"))
    state.chmod(0o711)
    request.addfinalizer(lambda: shutil.rmtree(state, ignore_errors=True))
    try:
        docker = DockerBackend(DockerBackendConfig(root=state / "docker", runtime=runtime))
    except BackendUnavailable as exc:
        pytest.skip(f"docker backend on {runtime}: {exc}")
    local = LocalBackend(LocalBackendConfig(root=state / "local"))
    local_results, local_diff = _transcript(local, repo)
    docker_results, docker_diff = _transcript(docker, repo)
    for mine, theirs in zip(local_results, docker_results, strict=True):
        assert mine == theirs, f"tool {mine['name']} differs between backends"
    assert local_diff == docker_diff and "+ undefined_name" in docker_diff
    lints = next(r for r in docker_results if r["name"] == "read_lints")
    assert "undefined_name" in lints["output"] and "sys" in lints["output"]
    terminal = next(r for r in docker_results if r["name"] == "run_terminal")["output"]
    assert "\n5\n/workspace sandbox /tmp\n1000\n/workspace\ngit version\n" in terminal
