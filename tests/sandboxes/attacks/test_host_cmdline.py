"""No process a sandbox can see names a host path in its command line or environment.

``/proc/<pid>/cmdline`` is readable by everyone, whatever the process's dumpable flag: the local
sandbox's init was started as ``<checkout>/.venv/bin/python -I -S <checkout>/sandboxes/_holder.py``,
which told the agent where the platform's code (and, beside it, its state) lives.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import sandboxes

PROBE = ("for p in /proc/[0-9]*; do echo \"== $p\"; tr '\\0' ' ' < $p/cmdline; echo; "
         "tr '\\0' '\\n' < $p/environ 2>/dev/null; done")


def _host_paths(backend) -> list[str]:
    checkout = Path(sandboxes.__file__).resolve().parents[1]
    return sorted({str(checkout), str(backend.root), str(Path(backend.root).resolve()), sys.executable,
                   os.path.realpath(sys.executable), sys.prefix, str(Path(sandboxes.__file__).parent)})


def test_no_host_path_in_any_command_line_inside_the_sandbox(sandbox_backend, sandbox):
    probe = sandbox.exec(PROBE)
    seen = probe.stdout + probe.stderr
    assert "== /proc/1\n" in seen  # the probe did read init's command line
    assert seen.count("== /proc/") >= 2  # init and the probe itself
    for host_path in _host_paths(sandbox_backend):
        assert host_path not in seen, [line for line in seen.splitlines() if host_path in line]


def test_setup_commands_see_no_host_path_in_command_lines(sandbox_backend, tmp_path):
    from sandboxes.base import RepoSource
    from tests.sandboxes.conftest import TEST_LIMITS

    repo = tmp_path / "repo"
    repo.mkdir()
    snapshot = sandbox_backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)),
                                               setup_commands=(f"{{ {PROBE}; }} > probe.txt 2>&1",))
    try:
        with sandbox_backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS) as box:
            seen = box.read_bytes("probe.txt").decode()
        assert "== /proc/1\n" in seen
        for host_path in [*_host_paths(sandbox_backend), str(tmp_path)]:
            assert host_path not in seen, [line for line in seen.splitlines() if host_path in line]
    finally:
        sandbox_backend.snapshot_delete(snapshot=snapshot)
