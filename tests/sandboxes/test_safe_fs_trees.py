"""Walking, chowning and deleting untrusted trees: iterative, descriptor-relative, never following links.

Trees are built as an attacker inside a sandbox would leave them: thousands of levels deep, with
symlinks and hard links pointing at host files, unreadable directories and a mount inside.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandboxes import safe_fs, safe_tree
from sandboxes.retention import snapshots_gc
from tests.sandboxes.attacks.test_deep_trees import build_deep

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _deep_trees_removed(tmp_path):
    """pytest's own clean-up of old tmp_path directories recurses: never leave a deep tree behind."""
    yield
    for entry in tmp_path.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            safe_tree.discard_tree(entry, what="test tree")


def _host_victims(tmp_path: Path) -> tuple[Path, Path]:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("host\n")
    return outside, outside / "keep.txt"


def _hostile_tree(tmp_path: Path, outside: Path, victim: Path) -> Path:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "up").symlink_to(outside)
    (tree / "abs").symlink_to(victim)
    os.link(victim, tree / "sub" / "hard")
    (tree / "locked").mkdir()
    (tree / "locked" / "f").write_text("x")
    (tree / "locked").chmod(0)
    build_deep(tree / "sub", "deep", 2500)
    return tree


def test_remove_tree_is_iterative_needs_few_descriptors_and_never_follows_links(tmp_path):
    outside, victim = _host_victims(tmp_path)
    tree = _hostile_tree(tmp_path, outside, victim)
    # A process with 64 descriptors and a recursion limit of 200 still removes 2,500 levels.
    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)); sys.setrecursionlimit(200); "
              f"from sandboxes.safe_tree import remove_tree; remove_tree({str(tree)!r})")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not tree.exists() and not os.path.lexists(tree)
    assert victim.read_text() == "host\n" and victim.stat().st_nlink == 1
    assert sorted(os.listdir(outside)) == ["keep.txt"]


def test_remove_tree_of_a_link_removes_the_link_only(tmp_path):
    outside, victim = _host_victims(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(outside)
    safe_tree.remove_tree(link)
    assert not os.path.lexists(link) and victim.read_text() == "host\n"
    safe_tree.remove_tree(tmp_path / "missing")  # nothing there: nothing to do


def test_remove_tree_does_not_descend_into_a_mount(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    tree = tmp_path / "tree"
    (tree / "mnt").mkdir(parents=True)
    (tree / "plain.txt").write_text("x")
    if subprocess.run(["mount", "-t", "tmpfs", "none", str(tree / "mnt")], check=False).returncode != 0:
        pytest.skip("this host does not allow mounting a tmpfs")
    try:
        (tree / "mnt" / "inside.txt").write_text("on another filesystem\n")
        with pytest.raises(OSError, match="mount point"):
            safe_tree.remove_tree(tree)
        assert (tree / "mnt" / "inside.txt").read_text() == "on another filesystem\n"
        assert not (tree / "plain.txt").exists()  # the rest of the tree still went
    finally:
        subprocess.run(["umount", str(tree / "mnt")], check=True)
    safe_tree.remove_tree(tree)
    assert not tree.exists()


def test_chown_tree_changes_every_entry_and_nothing_outside(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    outside, victim = _host_victims(tmp_path)
    tree = _hostile_tree(tmp_path, outside, victim)
    (tree / "locked").chmod(0o700)
    os.unlink(tree / "sub" / "hard")  # a hard link is the same inode: chown would reach the host file
    safe_tree.chown_tree(tree, (54321, 54322))
    owners = {(info.st_uid, info.st_gid) for info in _lstat_all(tree)}
    assert owners == {(54321, 54322)}
    assert (victim.stat().st_uid, outside.stat().st_uid) == (0, 0)
    safe_tree.remove_tree(tree)


def _lstat_all(tree: Path) -> list[os.stat_result]:
    found = [os.lstat(tree)]
    for relative, info in safe_tree.walk_tree(tree):
        assert not relative.startswith("/")
        found.append(info)
    return found


def test_walk_files_lists_paths_longer_than_path_max(tmp_path):
    build_deep(tmp_path, "w", 2500)
    fd = os.open(tmp_path / "w", os.O_RDONLY | os.O_DIRECTORY)
    try:
        listed = list(safe_fs.walk_files(fd))
        assert [relative for relative, _ in listed] == ["/".join(["d"] * 2500) + "/leaf"]
        relative, info = listed[0]
        assert len(relative) > 4096
        assert safe_fs.read_entry(fd, relative, info) == b"deep\n"
    finally:
        os.close(fd)
    safe_tree.remove_tree(tmp_path / "w")


def test_gc_logs_an_entry_it_cannot_remove_and_collects_the_rest(tmp_path, caplog):
    if os.geteuid() != 0:
        pytest.skip("marking a file immutable needs root")
    snapshots = tmp_path / "snapshots"
    stuck, gone = snapshots / "snap-0000stuck", snapshots / "snap-1111gone"
    for snapshot in (stuck, gone):
        (snapshot / "tree").mkdir(parents=True)
        (snapshot / "tree" / "f.txt").write_text("x")
    if subprocess.run(["chattr", "+i", str(stuck / "tree" / "f.txt")], check=False).returncode != 0:
        pytest.skip("this filesystem does not support immutable files")
    try:
        old = time.time() - 10 * 24 * 3600
        for snapshot in (stuck, gone):
            os.utime(snapshot, (old, old))
        with caplog.at_level(logging.WARNING, logger="sandboxes.retention"):
            removed = snapshots_gc(snapshots_dir=snapshots, max_age_s=3600, in_use=set())
        assert removed == ["snap-1111gone"]
        assert not gone.exists() and (stuck / "tree" / "f.txt").exists()
        assert any("snap-0000stuck" in record.getMessage() for record in caplog.records), caplog.text
    finally:
        subprocess.run(["chattr", "-i", str(stuck / "tree" / "f.txt")], check=True)
    assert snapshots_gc(snapshots_dir=snapshots, max_age_s=3600, in_use=set()) == ["snap-0000stuck"]
