"""Snapshots, forks, diffs, reset, destroy and lifetime on every available backend."""

from __future__ import annotations

import io
import subprocess
import tarfile
import time
import zipfile

import pytest

from sandboxes.base import ArchiveRejected, RepoSource, SandboxGone, SandboxLimits, SnapshotError
from tests.sandboxes.conftest import TEST_LIMITS


def test_forks_are_copy_on_write_and_isolated(sandbox_backend, make_snapshot):
    snapshot = make_snapshot({"shared.txt": "base\n"})
    forks = sandbox_backend.sandbox_fork(snapshot=snapshot, count=3, limits=TEST_LIMITS)
    try:
        assert len({f.id for f in forks}) == 3
        forks[0].exec("echo changed > shared.txt && echo mine > only0.txt")
        forks[1].write_bytes("only1.txt", b"one\n")
        assert forks[0].read_bytes("shared.txt") == b"changed\n"
        assert forks[1].read_bytes("shared.txt") == b"base\n"
        assert forks[2].exec("cat shared.txt; ls").stdout == "base\nshared.txt\n"
        assert "only1.txt" not in [e.name for e in forks[0].list_dir(".")]
        assert forks[2].diff() == ""
        # A new sandbox on the same snapshot still sees the pristine files.
        with sandbox_backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS) as fresh:
            assert fresh.read_bytes("shared.txt") == b"base\n"
    finally:
        for fork in forks:
            fork.destroy()


def test_diff_is_a_deterministic_git_style_patch(sandbox_backend, make_snapshot):
    snapshot = make_snapshot({"keep.txt": "a\nb\nc\n", "gone.txt": "bye\n", "tail.txt": "no newline"})
    changes = ("printf 'a\\nB\\nc\\n' > keep.txt && rm gone.txt && mkdir -p sub && echo new > sub/new.txt"
               " && printf 'no newline!' > tail.txt && printf '\\000\\001' > blob.bin"
               " && mkdir -p .git && echo ignored > .git/HEAD")
    first, second = sandbox_backend.sandbox_fork(snapshot=snapshot, count=2, limits=TEST_LIMITS)
    try:
        first.exec(changes)
        second.exec(changes)
        expected = (
            "diff --git a/blob.bin b/blob.bin\nnew file mode 100644\n"
            "Binary files /dev/null and b/blob.bin differ\n"
            "diff --git a/gone.txt b/gone.txt\ndeleted file mode 100644\n--- a/gone.txt\n+++ /dev/null\n"
            "@@ -1 +0,0 @@\n-bye\n"
            "diff --git a/keep.txt b/keep.txt\n--- a/keep.txt\n+++ b/keep.txt\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"
            "diff --git a/sub/new.txt b/sub/new.txt\nnew file mode 100644\n--- /dev/null\n+++ b/sub/new.txt\n"
            "@@ -0,0 +1 @@\n+new\n"
            "diff --git a/tail.txt b/tail.txt\n--- a/tail.txt\n+++ b/tail.txt\n@@ -1 +1 @@\n"
            "-no newline\n\\ No newline at end of file\n+no newline!\n\\ No newline at end of file\n"
        )
        assert first.diff() == expected
        assert second.diff() == expected
    finally:
        first.destroy()
        second.destroy()


def test_diff_applies_back_onto_the_snapshot_with_git(sandbox_backend, make_snapshot, tmp_path):
    files = {"m.py": "".join(f"line {i}\n" for i in range(40))}
    snapshot = make_snapshot(files)
    with sandbox_backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS) as box:
        box.exec("sed -i 's/line 3$/LINE three/; s/line 30$/LINE thirty/' m.py && echo extra > x.txt")
        patch = box.diff()
        final = box.read_bytes("m.py")
    work = tmp_path / "apply"
    work.mkdir()
    (work / "m.py").write_text(files["m.py"])
    (work / "change.patch").write_text(patch)
    subprocess.run(["git", "apply", "change.patch"], cwd=work, check=True, capture_output=True)
    assert (work / "m.py").read_bytes() == final
    assert (work / "x.txt").read_text() == "extra\n"


def test_reset_discards_files_and_processes(sandbox):
    sandbox.exec("echo scratch > scratch.txt && (sleep 287.5 >/dev/null 2>&1 &)")
    sandbox.write_bytes("app/calc.py", b"broken\n")
    sandbox.reset()
    assert sandbox.diff() == ""
    assert sandbox.read_bytes("app/calc.py").startswith(b"import os")
    assert "287.5" not in sandbox.exec("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").stdout
    assert sandbox.exec("echo ok").stdout == "ok\n"


def test_destroy_is_idempotent_and_final(sandbox_backend, make_snapshot):
    box = sandbox_backend.sandbox_create(snapshot=make_snapshot({"a": "a\n"}), limits=TEST_LIMITS)
    box.destroy()
    box.destroy()
    with pytest.raises(SandboxGone):
        box.exec("true")
    with pytest.raises(SandboxGone):
        box.read_bytes("a")


def test_lifetime_expiry_ends_the_sandbox(sandbox_backend, make_snapshot):
    limits = SandboxLimits(memory_mb=256, max_processes=32, disk_mb=16, command_timeout_s=2, lifetime_s=3)
    box = sandbox_backend.sandbox_create(snapshot=make_snapshot({"a": "a\n"}), limits=limits)
    try:
        assert box.exec("echo up").stdout == "up\n"
        time.sleep(3.5)
        with pytest.raises(SandboxGone, match="lifetime|no longer running|gone"):
            box.exec("echo still here?")
    finally:
        box.destroy()


def test_setup_commands_are_baked_into_the_snapshot(sandbox_backend, make_snapshot):
    snapshot = make_snapshot({"a.txt": "a\n"}, setup_commands=("echo built > built.txt", "mkdir -p out"))
    assert snapshot.setup_commands == ("echo built > built.txt", "mkdir -p out")
    with sandbox_backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS) as box:
        assert box.read_bytes("built.txt") == b"built\n"
        assert box.diff() == ""


def test_failing_setup_command_raises_with_its_output(sandbox_backend, make_snapshot):
    with pytest.raises(SnapshotError, match="exited with 7.*boom"):
        make_snapshot({"a.txt": "a\n"}, setup_commands=("echo boom; exit 7",))


def test_snapshot_from_git_at_a_ref(sandbox_backend, tmp_path):
    repo = tmp_path / "origin"
    repo.mkdir()
    env_git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    (repo / "v.txt").write_text("v1\n")
    subprocess.run([*env_git, "-C", str(repo), "add", "."], check=True)
    subprocess.run([*env_git, "-C", str(repo), "commit", "-qm", "v1"], check=True)
    first = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True,
                           text=True).stdout.strip()
    (repo / "v.txt").write_text("v2\n")
    subprocess.run([*env_git, "-C", str(repo), "commit", "-qam", "v2"], check=True)
    head = sandbox_backend.snapshot_create(source=RepoSource(kind="git", location=str(repo)))
    old = sandbox_backend.snapshot_create(source=RepoSource(kind="git", location=str(repo), ref=first))
    with sandbox_backend.sandbox_create(snapshot=head, limits=TEST_LIMITS) as box:
        assert box.read_bytes("v.txt") == b"v2\n"
    with sandbox_backend.sandbox_create(snapshot=old, limits=TEST_LIMITS) as box:
        assert box.read_bytes("v.txt") == b"v1\n"
    with pytest.raises(SnapshotError, match="git clone"):
        sandbox_backend.snapshot_create(source=RepoSource(kind="git", location=str(tmp_path / "missing")))


def _tar(tmp_path, name, members):
    path = tmp_path / name
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _file(name, data=b"x"):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name, target, kind=tarfile.SYMTYPE):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, None


def test_archive_snapshots_extract_valid_archives(sandbox_backend, tmp_path):
    good_tar = _tar(tmp_path, "good.tar.gz", [_file("src/a.py", b"A = 1\n"), _link("src/alias.py", "a.py")])
    good_zip = tmp_path / "good.zip"
    with zipfile.ZipFile(good_zip, "w") as zf:
        zf.writestr("pkg/b.py", "B = 2\n")
    for archive, path, content in ((good_tar, "src/alias.py", b"A = 1\n"), (good_zip, "pkg/b.py", b"B = 2\n")):
        snapshot = sandbox_backend.snapshot_create(source=RepoSource(kind="archive", location=str(archive)))
        with sandbox_backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS) as box:
            assert box.read_bytes(path) == content


@pytest.mark.parametrize(("members", "message"), [
    ([_file("../evil.py")], "contains '..'"),
    ([_file("/etc/evil")], "absolute path"),
    ([_link("out", "/etc/passwd")], "absolute path"),
    ([_link("sub/out", "../../etc")], "outside the archive"),
    ([_file("a"), _link("hard", "../x", tarfile.LNKTYPE)], "contains '..'"),
    ([(tarfile.TarInfo("dev"), None)], None),
])
def test_archive_snapshots_reject_unsafe_members(sandbox_backend, tmp_path, members, message):
    if message is None:
        members[0][0].type = tarfile.CHRTYPE
        message = "device"
    archive = _tar(tmp_path, "bad.tar.gz", members)
    with pytest.raises(ArchiveRejected, match=message):
        sandbox_backend.snapshot_create(source=RepoSource(kind="archive", location=str(archive)))


def test_archive_limits_and_zip_escapes(tmp_path):
    from sandboxes.archives import ArchiveLimits, extract_archive

    many = _tar(tmp_path, "many.tar.gz", [_file(f"f{i}") for i in range(20)])
    with pytest.raises(ArchiveRejected, match="more than 10 members"):
        extract_archive(many, tmp_path / "o1", limits=ArchiveLimits(max_members=10))
    big = _tar(tmp_path, "big.tar.gz", [_file("big", b"x" * 5000)])
    with pytest.raises(ArchiveRejected, match="over the 1000-byte limit"):
        extract_archive(big, tmp_path / "o2", limits=ArchiveLimits(max_member_bytes=1000, max_total_bytes=4000))
    evil_zip = tmp_path / "evil.zip"
    with zipfile.ZipFile(evil_zip, "w") as zf:
        zf.writestr("../../escape.txt", "x")
    with pytest.raises(ArchiveRejected, match="contains '..'"):
        extract_archive(evil_zip, tmp_path / "o3")
    link_zip = tmp_path / "link.zip"
    with zipfile.ZipFile(link_zip, "w") as zf:
        info = zipfile.ZipInfo("ln")
        info.external_attr = (0o120777 << 16)
        zf.writestr(info, "/etc/passwd")
    with pytest.raises(ArchiveRejected, match="absolute path"):
        extract_archive(link_zip, tmp_path / "o4")
    not_archive = tmp_path / "plain.txt"
    not_archive.write_text("hello")
    with pytest.raises(ArchiveRejected, match="neither a zip nor"):
        extract_archive(not_archive, tmp_path / "o5")
    assert not (tmp_path.parent / "escape.txt").exists()


def test_limits_and_sources_reject_bad_values():
    with pytest.raises(ValueError, match="command_timeout_s=10 exceeds lifetime_s=5"):
        SandboxLimits(command_timeout_s=10, lifetime_s=5)
    with pytest.raises(ValueError, match="memory_mb must be a positive integer"):
        SandboxLimits(memory_mb=0)
    with pytest.raises(ValueError, match="kind must be"):
        RepoSource(kind="ftp", location="x")
    with pytest.raises(ValueError, match="ref only applies"):
        RepoSource(kind="path", location="/x", ref="main")
