"""File tools never reach outside the workspace, whatever path or link the agent constructs."""

from __future__ import annotations

import secrets
import threading
from pathlib import Path

import pytest

from sandboxes.base import PathOutsideWorkspace
from sandboxes.tools import ToolCall, execute_tool_calls
from tests.sandboxes.conftest import host_is_healthy


def call(sandbox, name, **arguments):
    return execute_tool_calls(sandbox=sandbox, calls=[ToolCall(id="c1", name=name, arguments=arguments)])[0]


ESCAPING_PATHS = ("../etc/passwd", "app/../../etc/passwd", "/etc/passwd", "~/x", "/workspace/../etc")


@pytest.mark.parametrize("tool", ["read_file", "list_dir", "create_file"])
def test_dotdot_and_absolute_paths_are_refused(sandbox, tool):
    for path in ESCAPING_PATHS:
        arguments = {"path": path}
        if tool == "create_file":
            arguments["content"] = "pwned\n"
        result = call(sandbox, tool, **arguments)
        assert not result.ok, path
        assert result.meta["error"] == "PathOutsideWorkspace", (path, result.output)
        assert "workspace" in result.output
        assert "root:" not in result.output
    assert sandbox.exec("ls").stdout.split() == ["README.md", "app"]


def test_symlink_out_is_refused_by_every_file_tool(sandbox):
    sandbox.exec("ln -s /etc/passwd abs_link && ln -s ../../../../etc rel_dir && ln -s app inside_link")
    for arguments in ({"path": "abs_link"}, {"path": "rel_dir/passwd"}):
        result = call(sandbox, "read_file", **arguments)
        assert not result.ok and result.meta["error"] == "PathOutsideWorkspace", result.output
        assert "root:" not in result.output
    assert call(sandbox, "list_dir", path="rel_dir").meta["error"] == "PathOutsideWorkspace"
    edit = call(sandbox, "edit_file", path="abs_link", old_str="root", new_str="toor")
    assert not edit.ok and "outside the workspace" in edit.output
    by_line = call(sandbox, "replace_lines", path="abs_link", start_line=1, end_line=1, new_text="toor\n")
    assert not by_line.ok and "outside the workspace" in by_line.output
    written = call(sandbox, "create_file", path="rel_dir/evil", content="x", overwrite=True)
    assert not written.ok and written.meta["error"] == "PathOutsideWorkspace"
    # A symlink that stays inside the workspace keeps working.
    assert "def add" in call(sandbox, "read_file", path="inside_link/calc.py").output


def test_direct_api_refuses_escapes(sandbox):
    for path in ("../x", "/etc/hostname", "a/../../x"):
        with pytest.raises(PathOutsideWorkspace):
            sandbox.read_bytes(path)
        with pytest.raises(PathOutsideWorkspace):
            sandbox.write_bytes(path, b"x")


def test_hardlinks_out_cannot_be_made_and_shared_inodes_are_refused(sandbox):
    outside = sandbox.exec("ln /etc/passwd stolen_passwd")
    assert outside.exit_code != 0, "hard-linking a file outside the workspace must fail"
    assert sandbox.exec("ln app/calc.py twin.py").exit_code == 0
    result = call(sandbox, "read_file", path="twin.py")
    assert not result.ok and "hard links" in result.output


def test_symlink_swap_race_never_leaks_host_files(sandbox):
    """A background loop flips ``d`` between a real directory and ``/tmp`` while we read ``d/<name>``."""
    name = f"flowstate-secret-{secrets.token_hex(6)}"
    host_secret = Path("/tmp") / name
    host_secret.write_text("HOST-SECRET\n")
    try:
        sandbox.exec(f"mkdir real && echo inside > real/{name}")
        sandbox.exec("(while :; do ln -sfn /tmp d; ln -sfn real d; done) >/dev/null 2>&1 &", timeout_s=5)
        seen = set()
        stop = threading.Event()

        def reader():
            while not stop.is_set():
                try:
                    seen.add(sandbox.read_bytes(f"d/{name}"))
                except PathOutsideWorkspace:
                    seen.add(b"<refused>")
                except Exception as exc:  # noqa: BLE001 - transient ENOENT while the link is replaced
                    seen.add(type(exc).__name__.encode())

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for thread in threads:
            thread.start()
        stop.wait(1.5)
        stop.set()
        for thread in threads:
            thread.join()
        assert b"HOST-SECRET\n" not in seen
        assert b"inside\n" in seen or b"<refused>" in seen
    finally:
        host_secret.unlink()
        sandbox.exec("pkill -f 'ln -sfn' ; true")
    host_is_healthy()
