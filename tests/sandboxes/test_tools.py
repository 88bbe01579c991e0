"""The agent tools against real sandboxes on every available backend."""

from __future__ import annotations

import json
import time

import pytest

from sandboxes.tools import TOOL_NAMES, ToolCall, execute_tool_calls, openai_tool_schemas, todo_list


def call(sandbox, name, **arguments):
    return execute_tool_calls(sandbox=sandbox, calls=[ToolCall(id="c1", name=name, arguments=arguments)])[0]


def test_openai_schemas_cover_every_tool_and_are_json():
    schemas = openai_tool_schemas()
    assert [s["function"]["name"] for s in schemas] == list(TOOL_NAMES)
    assert set(TOOL_NAMES) == {"read_file", "list_dir", "edit_file", "replace_lines", "create_file", "grep",
                               "semantic_search", "read_lints", "run_terminal", "todo_write"}
    for schema in schemas:
        assert schema["type"] == "function"
        assert schema["function"]["parameters"]["type"] == "object"
        assert schema["function"]["description"]
    json.dumps(schemas)


def test_read_file_numbers_lines_and_honours_ranges(sandbox):
    full = call(sandbox, "read_file", path="app/calc.py")
    assert full.ok
    assert full.output == ("app/calc.py (lines 1-5 of 5)\n     1\timport os\n     2\t\n     3\t\n"
                           "     4\tdef add(a, b):\n     5\t    return a + b\n")
    part = call(sandbox, "read_file", path="/workspace/app/calc.py", start_line=4, end_line=4)
    assert part.output == "app/calc.py (lines 4-4 of 5)\n     4\tdef add(a, b):\n"
    past = call(sandbox, "read_file", path="app/calc.py", start_line=50)
    assert not past.ok and "past the end" in past.output and "5 lines" in past.output
    missing = call(sandbox, "read_file", path="nope.py")
    assert not missing.ok and "no such file" in missing.output


def test_read_file_refuses_binary_and_directories(sandbox):
    sandbox.write_bytes("blob.bin", b"\x00\x01\x02binary")
    assert "binary file" in call(sandbox, "read_file", path="blob.bin").output
    assert "is a directory" in call(sandbox, "read_file", path="app").output


def test_list_dir_is_sorted_and_typed(sandbox):
    sandbox.exec("ln -s app link && mkdir -p empty")
    result = call(sandbox, "list_dir")
    assert result.output == "./\n  README.md (5 bytes)\n  app/\n  empty/\n  link@\n"
    assert call(sandbox, "list_dir", path="empty").output == "empty/ is empty\n"


def test_edit_file_requires_a_unique_exact_match(sandbox):
    sandbox.write_bytes("dup.py", b"x = 1\ny = 2\nx = 1\n")
    several = call(sandbox, "edit_file", path="dup.py", old_str="x = 1", new_str="x = 3")
    assert not several.ok and "found 2 times" in several.output and "lines 1, 3" in several.output
    none = call(sandbox, "edit_file", path="dup.py", old_str="z = 9", new_str="z = 1")
    assert not none.ok and "found 0 times" in none.output
    assert sandbox.read_bytes("dup.py") == b"x = 1\ny = 2\nx = 1\n"
    done = call(sandbox, "edit_file", path="dup.py", old_str="y = 2\nx = 1", new_str="y = 5\nx = 1")
    assert done.ok and "line 2" in done.output
    assert sandbox.read_bytes("dup.py") == b"x = 1\ny = 5\nx = 1\n"
    same = call(sandbox, "edit_file", path="dup.py", old_str="y = 5", new_str="y = 5")
    assert not same.ok and "identical" in same.output


def test_replace_lines_rewrites_a_numbered_range(sandbox):
    sandbox.write_bytes("lines.py", b"a = 1\nb = 2\nc = 3\nd = 4\n")
    one = call(sandbox, "replace_lines", path="lines.py", start_line=2, end_line=2, new_text="b = 20")
    assert one.ok and "replaced line 2-2 with 1 line" in one.output
    assert "     2\tb = 20\n" in one.output  # the snippet is numbered the way read_file numbers lines
    assert sandbox.read_bytes("lines.py") == b"a = 1\nb = 20\nc = 3\nd = 4\n"
    grow = call(sandbox, "replace_lines", path="lines.py", start_line=3, end_line=4, new_text="c = 3\nx = 0\nd = 4\n")
    assert grow.ok and "with 3 lines" in grow.output
    assert sandbox.read_bytes("lines.py") == b"a = 1\nb = 20\nc = 3\nx = 0\nd = 4\n"
    deleted = call(sandbox, "replace_lines", path="lines.py", start_line=4, end_line=4, new_text="")
    assert deleted.ok and sandbox.read_bytes("lines.py") == b"a = 1\nb = 20\nc = 3\nd = 4\n"


def test_replace_lines_refuses_ranges_that_do_not_exist_and_no_ops(sandbox):
    sandbox.write_bytes("lines.py", b"a = 1\nb = 2\n")
    past = call(sandbox, "replace_lines", path="lines.py", start_line=2, end_line=3, new_text="b = 3\n")
    assert not past.ok and "has 2 lines" in past.output
    backwards = call(sandbox, "replace_lines", path="lines.py", start_line=2, end_line=1, new_text="x\n")
    assert not backwards.ok and "before start_line" in backwards.output
    same = call(sandbox, "replace_lines", path="lines.py", start_line=1, end_line=1, new_text="a = 1\n")
    assert not same.ok and "nothing would change" in same.output
    zero = call(sandbox, "replace_lines", path="lines.py", start_line=0, end_line=1, new_text="x\n")
    assert not zero.ok and "invalid arguments" in zero.output
    outside = call(sandbox, "replace_lines", path="../escape.py", start_line=1, end_line=1, new_text="x\n")
    assert not outside.ok
    assert sandbox.read_bytes("lines.py") == b"a = 1\nb = 2\n"


def test_create_file_refuses_to_clobber_unless_asked(sandbox):
    created = call(sandbox, "create_file", path="pkg/new/mod.py", content="A = 1\n")
    assert created.ok and sandbox.read_bytes("pkg/new/mod.py") == b"A = 1\n"
    again = call(sandbox, "create_file", path="pkg/new/mod.py", content="A = 2\n")
    assert not again.ok and "already exists" in again.output
    assert call(sandbox, "create_file", path="pkg/new/mod.py", content="A = 2\n", overwrite=True).ok
    assert sandbox.exec("cat pkg/new/mod.py && stat -c %U pkg/new/mod.py").stdout.splitlines()[0] == "A = 2"
    # The sandbox user owns what the tools create, so commands can modify it.
    assert sandbox.exec("echo B = 3 >> pkg/new/mod.py").exit_code == 0


def test_grep_uses_ripgrep_regex_globs_and_caps(sandbox):
    for index in range(30):
        sandbox.write_bytes(f"many/f{index:02d}.txt", b"needle here\n")
    result = call(sandbox, "grep", pattern=r"def \w+\(", globs=["*.py"])
    assert result.output == "app/calc.py:4:def add(a, b):\n"
    capped = call(sandbox, "grep", pattern="needle", path="many", max_results=5)
    assert capped.meta["capped"] and capped.output.count("needle") == 5
    assert "results capped at 5" in capped.output
    assert call(sandbox, "grep", pattern="NEEDLE", case_sensitive=False, path="many").meta["matches"] == 30
    assert call(sandbox, "grep", pattern="absent-string").output.startswith("No matches")
    assert call(sandbox, "grep", pattern="return", path="app/calc.py").output == "app/calc.py:5:    return a + b\n"
    bad = call(sandbox, "grep", pattern="(")
    assert not bad.ok and "regex parse error" in bad.output


def test_read_lints_reports_only_introduced_diagnostics(sandbox):
    clean = call(sandbox, "read_lints")
    assert clean.output == "No changed Python files to lint.\n"
    # calc.py already has an unused import: the baseline. Adding an undefined name is new.
    edit = call(sandbox, "edit_file", path="app/calc.py", old_str="return a + b", new_str="return a + c")
    assert edit.ok
    result = call(sandbox, "read_lints")
    assert result.output == "1 new lint error(s):\napp/calc.py:5:16: F821 Undefined name `c`\n"
    sandbox.write_bytes("app/broken.py", b"def f(:\n")
    both = call(sandbox, "read_lints", paths=["app/broken.py", "README.md"])
    assert "app/broken.py:1" in both.output and "README.md: not a Python file" in both.output


def test_run_terminal_reports_exit_code_and_truncates_display_only(sandbox):
    result = call(sandbox, "run_terminal", command="seq 1 5000; echo oops >&2; exit 3")
    assert not result.ok and result.meta["exit_code"] == 3
    assert result.output.startswith("$ seq 1 5000")
    assert "\n5000\n" in result.output and "[stderr]\noops\n" in result.output
    assert result.output.endswith("[exit code 3]\n")
    assert result.meta["truncated"]
    assert "lines (" in result.display and "cut from the middle" in result.display
    assert len(result.display) < len(result.output)
    assert result.display.endswith("[exit code 3]\n")
    timed = call(sandbox, "run_terminal", command="sleep 30", timeout_s=1)
    assert not timed.ok and timed.meta["timed_out"] and "timed out after 1s" in timed.output


def test_todo_write_replaces_and_merges_per_sandbox(sandbox):
    first = call(sandbox, "todo_write", todos=[{"id": "1", "content": "read", "status": "completed"},
                                               {"id": "2", "content": "fix", "status": "in_progress"}])
    assert first.output == "Todo list (1/2 completed):\n[x] 1. read\n[~] 2. fix\n"
    merged = call(sandbox, "todo_write", merge=True, todos=[{"id": "2", "content": "fix", "status": "completed"},
                                                            {"id": "3", "content": "test", "status": "pending"}])
    assert merged.output == "Todo list (2/3 completed):\n[x] 1. read\n[x] 2. fix\n[ ] 3. test\n"
    assert [t["id"] for t in todo_list(sandbox)] == ["1", "2", "3"]
    bad = call(sandbox, "todo_write", todos=[{"id": "1", "content": "x", "status": "done"}])
    assert not bad.ok and "invalid arguments" in bad.output


def test_invalid_arguments_and_unknown_tools_are_clear_errors(sandbox):
    assert "'path' is a required property" in call(sandbox, "read_file").output
    assert "unknown tool 'rm_rf'" in call(sandbox, "rm_rf", path=".").output
    extra = call(sandbox, "read_file", path="README.md", colour="red")
    assert not extra.ok and "colour" in extra.output
    wrong_type = call(sandbox, "read_file", path="README.md", start_line="1")
    assert not wrong_type.ok and "start_line" in wrong_type.output


def test_semantic_search_tool_returns_ranked_text_or_a_clear_error(sandbox):
    result = call(sandbox, "semantic_search", query="add two numbers", k=3)
    if result.ok:
        assert "app/calc.py" in result.output
    else:
        assert result.output.startswith("Error:") and "semantic" in result.output.lower()


def test_batch_runs_in_call_order_and_orders_dependent_calls(sandbox):
    calls = [
        ToolCall("a", "create_file", {"path": "x.txt", "content": "one\n"}),
        ToolCall("b", "read_file", {"path": "x.txt"}),
        ToolCall("c", "edit_file", {"path": "x.txt", "old_str": "one", "new_str": "two"}),
        ToolCall("d", "read_file", {"path": "x.txt"}),
        ToolCall("e", "read_file", {"path": "README.md"}),
        ToolCall("f", "run_terminal", {"command": "cat x.txt"}),
        ToolCall("g", "list_dir", {"path": "app"}),
    ]
    results = execute_tool_calls(sandbox=sandbox, calls=calls)
    assert [r.call_id for r in results] == list("abcdefg")
    assert "one" in results[1].output and "two" in results[3].output
    assert "two" in results[5].output
    assert all(r.ok for r in results)


@pytest.mark.parametrize("count", [10])
def test_parallel_reads_return_the_same_text_as_sequential(sandbox, count):
    for index in range(count):
        sandbox.write_bytes(f"r/{index}.txt", f"file {index}\n".encode())
    calls = [ToolCall(str(i), "read_file", {"path": f"r/{i}.txt"}) for i in range(count)]
    batch = execute_tool_calls(sandbox=sandbox, calls=calls)
    one_by_one = [execute_tool_calls(sandbox=sandbox, calls=[c])[0] for c in calls]
    assert [r.output for r in batch] == [r.output for r in one_by_one]


@pytest.mark.docker
def test_tool_results_are_byte_identical_across_backends(tmp_path):
    """The same calls on the same snapshot give the same text on the local and Docker backends."""
    import shutil
    import tempfile
    from pathlib import Path

    from sandboxes.base import BackendUnavailable, RepoSource
    from sandboxes.local_backend import LocalBackend, LocalBackendConfig
    from tests.sandboxes.conftest import TEST_LIMITS, _docker_skip_reason

    reason = _docker_skip_reason()
    if reason:
        pytest.skip(reason)
    from sandboxes.docker_backend import DockerBackend, DockerBackendConfig

    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "calc.py").write_text("import os\n\n\ndef add(a, b):\n    return a + b\n")
    (repo / "README.md").write_text("calc\n")
    calls = [
        ToolCall("1", "read_file", {"path": "pkg/calc.py"}),
        ToolCall("2", "list_dir", {}),
        ToolCall("3", "edit_file", {"path": "pkg/calc.py", "old_str": "a + b", "new_str": "a + c"}),
        ToolCall("4", "create_file", {"path": "pkg/util.py", "content": "def twice(x):\n    return 2 * x\n"}),
        ToolCall("5", "grep", {"pattern": r"def \w+", "globs": ["*.py"]}),
        ToolCall("6", "read_lints", {}),
        ToolCall("7", "run_terminal", {"command": "python3 -c 'print(sum(range(10)))'; exit 4"}),
        ToolCall("8", "read_file", {"path": "../etc/passwd"}),
        ToolCall("9", "todo_write", {"todos": [{"id": "1", "content": "fix", "status": "completed"}]}),
    ]
    outputs = {}
    for name in ("local", "docker"):
        root = Path(tempfile.mkdtemp(prefix=f"flowstate-identical-{name}-", dir="/tmp"))
        root.chmod(0o711)
        try:
            try:
                backend = (LocalBackend(LocalBackendConfig(root=root)) if name == "local"
                           else DockerBackend(DockerBackendConfig(root=root)))
            except BackendUnavailable as exc:
                pytest.skip(str(exc))
            snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
            with backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS) as box:
                results = [execute_tool_calls(sandbox=box, calls=[c])[0] for c in calls]
                outputs[name] = [(r.ok, r.output, r.display) for r in results] + [box.diff()]
            backend.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    for local, docker in zip(outputs["local"], outputs["docker"], strict=True):
        assert local == docker


def test_a_missed_edit_shows_the_most_similar_lines_numbered(sandbox):
    sandbox.write_bytes("calc.py", b"def total(values):\n    result = 1\n    for value in values:\n        result += value\n    return result\n")
    # a one-character miss (the constant the file really holds is 1): the hint shows that line as read_file numbers it
    near = call(sandbox, "edit_file", path="calc.py", old_str="    result = 0\n", new_str="    result = 2\n")
    assert not near.ok and "found 0 times" in near.output
    assert "The most similar text in calc.py is line 2:\n     2\t    result = 1\n" in near.output
    # a miss over two lines (indent lost) names the two-line window
    two = call(sandbox, "edit_file", path="calc.py", old_str="for value in values:\n    result += value\n", new_str="x")
    assert not two.ok and "is lines 3-4:\n     3\t    for value in values:\n     4\t        result += value\n" in two.output
    # nothing alike: no hint, the plain advice
    far = call(sandbox, "edit_file", path="calc.py", old_str="import os", new_str="import sys")
    assert not far.ok and "most similar" not in far.output and "Read the file again" in far.output
    # the search runs on the host: an old_str of a megabyte gets the plain advice at once, not a quadratic scan
    started = time.monotonic()
    huge = call(sandbox, "edit_file", path="calc.py", old_str="    result = 0" * 80_000, new_str="x")
    assert not huge.ok and "most similar" not in huge.output and time.monotonic() - started < 5
    assert sandbox.read_bytes("calc.py").startswith(b"def total(values):\n    result = 1\n")


def test_edit_file_works_on_bytes_and_refuses_big_files_by_size(sandbox):
    """A big file of short lines is refused before it is read (issue 42: an edit must not pull a whole
    big file into host memory); a file with invalid UTF-8 keeps every byte outside the edit."""
    from sandboxes.tool_impl.handlers import EDIT_MAX_FILE_BYTES

    lines = EDIT_MAX_FILE_BYTES // 2 + 1
    sandbox.exec(f"python3 -c \"open('big.txt', 'w').write('x\\\\n' * {lines})\"; "
                 "printf 'a\\377b\\nold line\\n\\376\\n' > raw.txt")
    for name in ("edit_file", "replace_lines"):
        arguments = {"old_str": "x\nx\n", "new_str": "y\n"} if name == "edit_file" else \
            {"start_line": 1, "end_line": 1, "new_text": "y"}
        refused = call(sandbox, name, path="big.txt", **arguments)
        assert not refused.ok
        assert f"big.txt is {2 * lines} bytes, over {name}'s 8 MiB limit; change it with run_terminal" in refused.output
    edited = call(sandbox, "edit_file", path="raw.txt", old_str="old line", new_str="new line")
    assert edited.ok and "replaced 1 occurrence at line 2" in edited.output
    assert sandbox.read_bytes("raw.txt") == b"a\xffb\nnew line\n\xfe\n"
    many = call(sandbox, "edit_file", path="raw.txt", old_str="\n", new_str="")
    assert not many.ok and "found 3 times in raw.txt (starting at lines 1, 2, 3)" in many.output
