"""Hostile archives extracted on the host never write outside the snapshot directory.

Each archive is built the way an attacker would: link chains whose lexical normalisation stays
inside while the kernel's resolution leaves, names long enough that ``os.path.realpath`` gives up
(the tarfile ``data`` filter relies on it), hard links to files that were never in the archive, and
corrupt zips. Every payload runs through ``snapshot_create`` on each backend and through
``extract_archive`` directly; afterwards nothing may exist outside the destination.
"""

from __future__ import annotations

import io
import os
import secrets
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from sandboxes.archives import ArchiveLimits, extract_archive
from sandboxes.base import ArchiveRejected, RepoSource
from tests.sandboxes.conftest import TEST_LIMITS


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]], mode: str = "w") -> Path:
    with tarfile.open(path, mode) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", data: bytes | None = None):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info, data


def _zip(path: Path, members: list[tuple[str, str | None, bytes]]) -> Path:
    """members: (name, 'link' or None, data); links are stored the way Info-ZIP stores them."""
    with zipfile.ZipFile(path, "w") as zf:
        for name, kind, data in members:
            info = zipfile.ZipInfo(name)
            info.external_attr = ((0o120777 if kind == "link" else 0o100644) << 16)
            zf.writestr(info, data)
    return path


def _outside_marker(tmp_path: Path) -> str:
    return f"pwned-{secrets.token_hex(4)}"


def zip_dot_chain(tmp_path: Path, marker: str) -> Path:
    # sub/lnk -> ../ (lexically '.'), sub/lnk2 -> lnk/.. (lexically 'sub'); the kernel resolves
    # sub/lnk2 to the destination's parent. A later member is created through it (before the fix:
    # a directory and a link appeared next to the destination).
    return _zip(tmp_path / "chain.zip", [
        ("sub/lnk", "link", b"../"),
        ("sub/lnk2", "link", b"lnk/.."),
        (f"sub/lnk2/{marker}/inner", "link", b"x"),
    ])


def tar_dot_chain(tmp_path: Path, marker: str) -> Path:
    return _tar(tmp_path / "chain.tar", [
        _entry("sub", tarfile.DIRTYPE),
        _entry("sub/lnk", tarfile.SYMTYPE, "../"),
        _entry("sub/lnk2", tarfile.SYMTYPE, "lnk/.."),
        _entry(f"sub/lnk2/{marker}.txt", data=b"owned\n"),
    ])


def tar_realpath_overflow(tmp_path: Path, marker: str) -> Path:
    # Names long enough that os.path.realpath stops resolving (PATH_MAX), so tarfile's data filter
    # reasons about a lexical path while the kernel follows the links (CVE-2025-4517's shape).
    comp, steps, members, path = "d" * 247, "abcdefghijklmnop", [], ""
    for step in steps:
        members.append(_entry(os.path.join(path, comp), tarfile.DIRTYPE))
        members.append(_entry(os.path.join(path, step), tarfile.SYMTYPE, comp))
        path = os.path.join(path, comp)
    linkpath = os.path.join(*steps, "l" * 254)
    members.append(_entry(linkpath, tarfile.SYMTYPE, "../" * len(steps)))
    members.append(_entry("escape", tarfile.SYMTYPE, linkpath + "/../"))
    members.append(_entry(f"escape/{marker}.txt", data=b"owned\n"))
    return _tar(tmp_path / "overflow.tar", members)


PAYLOADS = {"zip-dot-chain": zip_dot_chain, "tar-dot-chain": tar_dot_chain,
            "tar-realpath-overflow": tar_realpath_overflow}


def _assert_nothing_outside(root: Path, marker: str) -> None:
    # walk_tree, not rglob or os.walk: /tmp is shared, a directory vanishing mid-walk must not fail
    # the test, and another test's tree deeper than the recursion limit must not either.
    from sandboxes.safe_tree import walk_tree

    found = [relative for relative, _ in walk_tree(root) if relative.rpartition("/")[2].startswith(marker)]
    assert found == [], f"archive wrote outside its destination: {found}"


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_link_chains_never_write_outside(tmp_path, payload):
    marker = _outside_marker(tmp_path)
    archive = PAYLOADS[payload](tmp_path, marker)
    work = tmp_path / "work"
    work.mkdir()
    destination = work / "dest"
    with pytest.raises(ArchiveRejected, match="symlink"):
        extract_archive(archive, destination)
    _assert_nothing_outside(tmp_path, marker)
    _assert_nothing_outside(Path("/tmp"), marker)


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_link_chains_rejected_by_every_backend(sandbox_backend, tmp_path, payload):
    marker = _outside_marker(tmp_path)
    archive = PAYLOADS[payload](tmp_path, marker)
    with pytest.raises(ArchiveRejected, match="symlink"):
        sandbox_backend.snapshot_create(source=RepoSource(kind="archive", location=str(archive)))
    _assert_nothing_outside(sandbox_backend.root, marker)
    _assert_nothing_outside(tmp_path, marker)


def test_hard_link_to_a_host_file_is_refused_and_the_file_untouched(sandbox_backend, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    victim = work / "victim.conf"
    victim.write_text("secret\n")
    victim.chmod(0o600)
    before = victim.stat()
    # The hard link names a host file reachable only through a link chain, then one never in the
    # archive; a later regular member of the same name would write through the link.
    payloads = [
        [_entry("sub", tarfile.DIRTYPE), _entry("sub/lnk", tarfile.SYMTYPE, "../"),
         _entry("sub/up", tarfile.SYMTYPE, "lnk/.."), _entry("h", tarfile.LNKTYPE, "sub/up/victim.conf"),
         _entry("h", data=b"owned\n")],
        [_entry("h", tarfile.LNKTYPE, "victim.conf"), _entry("h", data=b"owned\n")],
        [_entry("l", tarfile.SYMTYPE, "a"), _entry("h", tarfile.LNKTYPE, "l")],
    ]
    for index, members in enumerate(payloads):
        archive = _tar(tmp_path / f"hard-{index}.tar", members)
        for run_as in (None, (54321, 54321)):
            with pytest.raises(ArchiveRejected, match="regular file extracted earlier|through a symlink"):
                extract_archive(archive, work / f"dest-{index}-{run_as is None}", run_as=run_as)
        with pytest.raises(ArchiveRejected, match="regular file extracted earlier|through a symlink"):
            sandbox_backend.snapshot_create(source=RepoSource(kind="archive", location=str(archive)))
    after = victim.stat()
    assert (after.st_mode, after.st_mtime_ns, after.st_nlink, victim.read_text()) == \
        (before.st_mode, before.st_mtime_ns, 1, "secret\n")


def test_safe_links_and_hard_links_within_the_archive_still_work(sandbox_backend, tmp_path):
    archive = _tar(tmp_path / "ok.tar", [
        _entry("src", tarfile.DIRTYPE), _entry("src/a.py", data=b"A = 1\n"),
        _entry("src/alias.py", tarfile.SYMTYPE, "a.py"), _entry("copy.py", tarfile.LNKTYPE, "src/a.py"),
        _entry("src/a.py", data=b"A = 2\n"),  # a later member of the same name wins, as with tar(1)
    ])
    snapshot = sandbox_backend.snapshot_create(source=RepoSource(kind="archive", location=str(archive)))
    with sandbox_backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS) as box:
        assert box.exec("cat src/alias.py copy.py; readlink src/alias.py").stdout == "A = 2\nA = 1\na.py\n"
    tree = Path(snapshot.location)
    assert stat.S_ISLNK(os.lstat(tree / "src/alias.py").st_mode)
    sandbox_backend.snapshot_delete(snapshot=snapshot)


def test_corrupt_and_lying_zips_raise_archive_rejected(sandbox_backend, tmp_path):
    good = _zip(tmp_path / "good.zip", [("a.txt", None, b"hello world " * 1000)])
    raw = bytearray(good.read_bytes())
    corrupt = tmp_path / "corrupt.zip"
    middle = len(raw) // 3
    raw[middle:middle + 40] = b"\xff" * 40
    corrupt.write_bytes(bytes(raw))
    truncated = tmp_path / "truncated.zip"
    truncated.write_bytes(good.read_bytes()[:-30])
    for archive in (corrupt, truncated):
        with pytest.raises(ArchiveRejected, match="corrupt|truncated|neither a zip"):
            sandbox_backend.snapshot_create(source=RepoSource(kind="archive", location=str(archive)))
    with pytest.raises(ArchiveRejected, match="declared size|over the"):
        bomb = _zip(tmp_path / "bomb.zip", [("z", None, b"\0" * 200_000)])
        extract_archive(bomb, tmp_path / "out", limits=ArchiveLimits(max_member_bytes=1000, max_total_bytes=4000))


def _identity(pid: int) -> dict[str, str]:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: status[key].split() if key in ("Uid", "Gid") else status[key].strip()
            for key in ("Uid", "Gid", "Groups", "CapEff", "CapPrm", "CapBnd", "NoNewPrivs")}


def _assert_unprivileged(pid: int, uid: int) -> None:
    identity = _identity(pid)
    assert identity["Uid"] == [str(uid)] * 4 and identity["Gid"] == [str(uid)] * 4, identity
    assert identity["Groups"] == "" and identity["NoNewPrivs"] == "1", identity
    assert int(identity["CapEff"], 16) == int(identity["CapPrm"], 16) == int(identity["CapBnd"], 16) == 0, identity


def _server_is_unprivileged(uid: int) -> None:
    from sandboxes import extract_server

    server = extract_server.server_for((uid, uid))
    _assert_unprivileged(server.process.pid, uid)
    assert Path(f"/proc/{server.process.pid}/status").stat().st_uid == 0  # not dumpable: /proc owned by root


def test_extraction_runs_unprivileged_when_root(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("privilege drop is only meaningful when the worker runs as root")
    archive = _tar(tmp_path / "who.tar", [_entry("f.txt", data=b"x\n")])
    destination = tmp_path / "dest"
    extract_archive(archive, destination, run_as=(54321, 54321))
    assert (destination / "f.txt").stat().st_uid == 54321
    _server_is_unprivileged(54321)


def test_extraction_children_are_unprivileged_and_isolated(tmp_path):
    """Each archive is extracted by a fork of the unprivileged server: same identity, no root, and the
    child cannot reach the server's socket (it would receive later requests' descriptors)."""
    if os.geteuid() != 0:
        pytest.skip("privilege drop is only meaningful when the worker runs as root")
    import threading
    import time

    from sandboxes import extract_server

    class Zeros(io.RawIOBase):
        def readable(self):
            return True

        def readinto(self, buffer):
            buffer[:] = bytes(len(buffer))
            return len(buffer)

    uid = 54322
    slow = tmp_path / "slow.tar.gz"
    with tarfile.open(slow, "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("zeros.bin")
        info.size = 64 << 20
        tar.addfile(info, io.BufferedReader(Zeros()))
    server = extract_server.server_for((uid, uid))
    socket_link = os.readlink(f"/proc/{server.process.pid}/fd/{server.process.args[-2]}")
    errors: list[BaseException] = []
    checked = 0

    def probe(pid: int) -> bool:
        """Check a child caught while it writes zeros.bin (so past its setup); False if not yet there."""
        try:
            held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            if not any(link.endswith("/zeros.bin") for link in held):
                return False
            _assert_unprivileged(pid, uid)
        except (FileNotFoundError, ProcessLookupError):
            return False  # exited meanwhile
        assert socket_link not in held, "the extraction child still holds the server's socket"
        return True

    for attempt in range(3):  # the child is caught mid-extraction; a very fast machine may need a retry
        def run(destination=tmp_path / f"slow-dest-{attempt}") -> None:
            try:
                extract_archive(slow, destination, run_as=(uid, uid))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        worker = threading.Thread(target=run)
        worker.start()
        deadline = time.monotonic() + 60
        while worker.is_alive() and not checked and time.monotonic() < deadline:
            children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children").read_text().split()
            checked += sum(probe(int(pid)) for pid in children)
        worker.join(60)
        if checked:
            break
    assert not errors, errors
    assert checked, "no extraction child was caught mid-extraction"


def test_concurrent_extractions_and_a_dead_server(tmp_path):
    """Threads extract at once (a threaded worker); a server that died is replaced on the next call."""
    if os.geteuid() != 0:
        pytest.skip("the extraction server is only used as root")
    from concurrent.futures import ThreadPoolExecutor

    from sandboxes import extract_server

    uid = 54323
    archives = [_tar(tmp_path / f"a{i}.tar", [_entry("d", tarfile.DIRTYPE), _entry("d/f.txt", data=f"{i}\n".encode())])
                for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: extract_archive(archives[i], tmp_path / f"out{i}", run_as=(uid, uid)), range(6)))
    assert [(tmp_path / f"out{i}/d/f.txt").read_text() for i in range(6)] == [f"{i}\n" for i in range(6)]
    first = extract_server.server_for((uid, uid))
    first.process.kill()
    first.process.wait()
    extract_archive(archives[0], tmp_path / "after-kill", run_as=(uid, uid))
    assert (tmp_path / "after-kill/d/f.txt").read_text() == "0\n"
    assert extract_server.server_for((uid, uid)).process.pid != first.process.pid


def test_extraction_drops_privileges_itself_when_the_checkout_is_out_of_reach(tmp_path, monkeypatch):
    """A clone in /root (0700): no interpreter can import the package as the sandbox uid, so the server
    starts as root and drops to it before reading its socket; never an extraction as root."""
    if os.geteuid() != 0:
        pytest.skip("privilege drop is only meaningful when the worker runs as root")
    from sandboxes import extract_server

    monkeypatch.setattr(extract_server, "child_python", lambda: None)
    archive = _tar(tmp_path / "who.tar.gz", [_entry("dir", tarfile.DIRTYPE), _entry("dir/f.txt", data=b"x\n")],
                   mode="w:gz")
    destination = tmp_path / "dest"
    extract_archive(archive, destination, run_as=(54321, 54321))
    assert (destination / "dir" / "f.txt").read_bytes() == b"x\n"
    assert (destination / "dir").stat().st_uid == (destination / "dir" / "f.txt").stat().st_uid == 54321
    server = extract_server.server_for((54321, 54321))
    assert server.mode == "self-drop"
    _assert_unprivileged(server.process.pid, 54321)


def test_a_forked_worker_starts_its_own_server(tmp_path):
    """A prefork pool forks the worker after its backend pre-started a server: the child must not share
    the parent's socket (it would mix requests), and the parent's server must keep working."""
    if os.geteuid() != 0:
        pytest.skip("the extraction server is only used as root")
    import subprocess
    import sys

    archive = _tar(tmp_path / "f.tar", [_entry("f.txt", data=b"x\n")])
    script = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r})
from pathlib import Path
from sandboxes import extract_server
from sandboxes.archives import extract_archive
run_as = (54324, 54324)
extract_archive(Path({str(archive)!r}), Path({str(tmp_path / 'parent-1')!r}), run_as=run_as)
parent_server = extract_server.server_for(run_as).process.pid
child = os.fork()
if child == 0:
    extract_archive(Path({str(archive)!r}), Path({str(tmp_path / 'child')!r}), run_as=run_as)
    os._exit(0 if extract_server.server_for(run_as).process.pid != parent_server else 3)
_, status = os.waitpid(child, 0)
extract_archive(Path({str(archive)!r}), Path({str(tmp_path / 'parent-2')!r}), run_as=run_as)
assert extract_server.server_for(run_as).process.pid == parent_server
print("exit", os.waitstatus_to_exitcode(status))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "exit 0", done.stderr[-2000:]
    for name in ("parent-1", "child", "parent-2"):
        assert (tmp_path / name / "f.txt").stat().st_uid == 54324
