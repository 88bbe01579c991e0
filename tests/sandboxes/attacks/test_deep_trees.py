"""Trees deeper than Python's recursion limit never break snapshot creation, deletion or retention.

An attacker's archive of a few kilobytes holds one member 1,500 directories deep; a setup command
or an agent can build deeper trees still. The extractor refuses an archive by its depth, and every
walk or delete of such a tree (the ownership change after extraction, the clean-up of a failed
snapshot, the garbage collector, a workspace diff) is iterative over directory descriptors. Before,
``os.walk`` raised RecursionError, the clean-up's ``shutil.rmtree`` raised it again, a
``.snap-*.partial`` stayed behind and every later gc pass aborted on it, so the disk filled.
"""

from __future__ import annotations

import io
import os
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from sandboxes.archives import extract_archive
from sandboxes.base import ArchiveRejected, RepoSource
from sandboxes.safe_tree import remove_tree
from tests.sandboxes.conftest import TEST_LIMITS

DEPTH = 1500
DAY = 24 * 3600


def deep_zip(path: Path, depth: int = DEPTH) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("/".join(["d"] * depth) + "/f.txt", "x\n")
    return path


def deep_tar(path: Path, depth: int = DEPTH) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        info = tarfile.TarInfo("/".join(["d"] * depth) + "/f.txt")
        info.size = 2
        archive.addfile(info, io.BytesIO(b"x\n"))
    return path


ARCHIVES = {"zip": deep_zip, "tar.gz": deep_tar}


def build_deep(parent: Path, name: str, depth: int) -> None:
    """``name/d/d/.../leaf`` with ``depth`` levels, each created relative to its parent's fd (no path
    is ever longer than one component, so PATH_MAX does not stop it: nor does it stop an attacker)."""
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for component in [name] + ["d"] * depth:
            os.mkdir(component, dir_fd=fd)
            child = os.open(component, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        leaf = os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(leaf, b"deep\n")
        os.close(leaf)
    finally:
        os.close(fd)


def age(path: Path, days: float = 10) -> None:
    old = time.time() - days * DAY
    os.utime(path, (old, old), follow_symlinks=False)


def _partials(backend) -> list[str]:
    snapshots = backend.root / "snapshots"
    return sorted(name for name in os.listdir(snapshots) if name.endswith(".partial")) if snapshots.is_dir() else []


@pytest.mark.parametrize("kind", sorted(ARCHIVES))
def test_deep_archive_is_refused_by_the_backend_and_gc_keeps_working(sandbox_backend, make_snapshot, tmp_path, kind):
    archive = ARCHIVES[kind](tmp_path / f"deep.{kind}")
    assert archive.stat().st_size < 16 * 1024  # a few kilobytes is all it takes
    stale = make_snapshot({"old.txt": "old\n"})
    age(Path(stale.location).parent)
    before = _partials(sandbox_backend)
    with pytest.raises(ArchiveRejected, match=r"1501 path components deep.*limit is 64"):
        sandbox_backend.snapshot_create(source=RepoSource(kind="archive", location=str(archive)))
    assert _partials(sandbox_backend) == before
    sandbox_backend.gc(max_age_s=3 * DAY)
    assert not Path(stale.location).parent.exists()


@pytest.mark.parametrize("kind", sorted(ARCHIVES))
def test_deep_archive_fed_to_the_extractor_is_refused(tmp_path, kind):
    archive = ARCHIVES[kind](tmp_path / f"deep.{kind}")
    owners = [None, (54321, 54321)] if os.geteuid() == 0 else [None]
    for index, run_as in enumerate(owners):
        destination = tmp_path / f"out-{index}"
        try:
            with pytest.raises(ArchiveRejected, match="path components deep"):
                extract_archive(archive, destination, run_as=run_as)
            assert list(destination.iterdir()) == []  # refused before the first directory was made
        finally:
            remove_tree(destination)  # pytest's own clean-up of tmp_path recurses


def test_gc_removes_trees_deeper_than_the_recursion_limit(sandbox_backend, make_snapshot):
    snapshots = sandbox_backend.root / "snapshots"
    snapshots.mkdir(exist_ok=True)
    partial = snapshots / ".snap-deadbeefdeadbeef.partial"
    build_deep(snapshots, partial.name, 3000)
    stale = make_snapshot({"old.txt": "old\n"})
    for path in (partial, Path(stale.location).parent):
        age(path)
    sandbox_backend.gc(max_age_s=3 * DAY)
    assert not partial.exists()
    assert not Path(stale.location).parent.exists()


DEEP_SHELL = ("python3 -c \"import os\nfor _ in range({depth}): os.mkdir('{name}'); os.chdir('{name}')\n"
              "open('leaf', 'w').write('deep')\"")


def test_deep_trees_from_setup_commands_and_agents_are_diffed_and_deleted(sandbox_backend, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "a.txt").write_text("a\n")
    snapshot = sandbox_backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)),
                                               setup_commands=(DEEP_SHELL.format(depth=1200, name="s"),))
    tree = Path(snapshot.location)
    try:
        with sandbox_backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS) as box:
            done = box.exec(DEEP_SHELL.format(depth=1100, name="w"), timeout_s=20)
            assert done.exit_code == 0, done.stderr
            diff = box.diff()
            assert "/".join(["w"] * 1100) + "/leaf" in diff and "/s/s/" not in diff
    finally:
        sandbox_backend.snapshot_delete(snapshot=snapshot)
    assert not tree.parent.exists()


def test_the_depth_cap_is_a_validated_setting(settings, monkeypatch, tmp_path):
    from sandboxes.archives import ArchiveLimits
    from sandboxes.settings import SandboxSettings

    assert ArchiveLimits().max_depth == 64
    settings.ARCHIVE_MAX_DEPTH = 5  # pushed to the sandbox layer like every setting it reads
    assert ArchiveLimits().max_depth == 5
    with pytest.raises(ArchiveRejected, match="6 path components deep; the limit is 5"):
        extract_archive(deep_zip(tmp_path / "six.zip", depth=5), tmp_path / "out")
    monkeypatch.setenv("FLOWSTATE_ARCHIVE_MAX_DEPTH", "12")
    assert SandboxSettings.from_environment().archive_max_depth == 12
    for bad in ("deep", "0", "5000"):
        monkeypatch.setenv("FLOWSTATE_ARCHIVE_MAX_DEPTH", bad)
        with pytest.raises(ValueError, match="FLOWSTATE_ARCHIVE_MAX_DEPTH"):
            SandboxSettings.from_environment()


def test_semantic_indexing_reads_a_snapshot_tree_deeper_than_the_recursion_limit(tmp_path):
    from sandboxes.semantic.index import iter_directory_files

    (tmp_path / "top.py").write_text("x = 1\n")
    build_deep(tmp_path, "deep", 1200)
    deep_file = tmp_path.joinpath(*(["deep"] + ["d"] * 1200)) / "mod.py"
    try:
        fd = os.open(deep_file.parent, os.O_RDONLY | os.O_DIRECTORY)
        leaf = os.open("mod.py", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(leaf, b"y = 2\n")
        os.close(leaf)
        os.close(fd)
        files = dict(iter_directory_files(tmp_path, max_file_bytes=1 << 20))
        assert files["top.py"] == b"x = 1\n" and files[str(deep_file.relative_to(tmp_path))] == b"y = 2\n"
    finally:
        remove_tree(tmp_path / "deep")
