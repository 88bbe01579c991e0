"""Unified diffs from real git: which paths a fork changed, and reversing edits to the snapshot text."""

from __future__ import annotations

import subprocess

from sandboxes.semantic.diffs import changed_paths, original_text, parse_unified_diff


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def test_reversing_a_git_diff_recovers_every_snapshot_file(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    original = {
        "a.py": "".join(f"line {i}\n" for i in range(1, 41)),
        "b.py": "def gone():\n    return 1\n",
        "c.py": "first\nsecond\nthird\n",
        "old name.py": "x = 1\ny = 2\n",
    }
    for name, text in original.items():
        (repo / name).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")

    lines = original["a.py"].splitlines()
    lines[2] = "changed 3"
    del lines[10:13]
    lines.insert(30, "inserted")
    lines.append("appended")
    (repo / "a.py").write_text("\n".join(lines) + "\n")
    (repo / "b.py").unlink()
    (repo / "c.py").write_text("first\nthird\n")
    (repo / "new.py").write_text("def added():\n    pass\n")
    (repo / "old name.py").rename(repo / "renamed.py")
    _git(repo, "add", "-A")
    diff = _git(repo, "diff", "--cached", "-M")

    patches = parse_unified_diff(diff)
    assert changed_paths(patches) == {"a.py", "b.py", "c.py", "new.py", "old name.py", "renamed.py"}
    by_old = {patch.old_path: patch for patch in patches if patch.old_path}
    for name in ("a.py", "c.py"):
        current = (repo / name).read_text()
        assert original_text(patch=by_old[name], current=current) == original[name]
    assert original_text(patch=by_old["b.py"], current=None) == original["b.py"]
    renamed = by_old["old name.py"]
    assert renamed.new_path == "renamed.py"
    assert original_text(patch=renamed, current=(repo / "renamed.py").read_text()) == original["old name.py"]
    added = next(patch for patch in patches if patch.new_path == "new.py")
    assert added.old_path is None and original_text(patch=added, current="anything") is None


def test_removed_line_that_looks_like_a_header_stays_in_the_hunk():
    diff = (
        "diff --git a/x.md b/x.md\n--- a/x.md\n+++ b/x.md\n@@ -1,3 +1,2 @@\n keep\n--- not a header\n last\n"
    )
    (patch,) = parse_unified_diff(diff)
    assert patch.old_path == patch.new_path == "x.md"
    assert original_text(patch=patch, current="keep\nlast\n") == "keep\n-- not a header\nlast\n"
