"""Extraction of repository archives (.tar, .tar.gz, .tgz, .zip) into a snapshot directory.

One code path for zip and tar and for every backend. Nothing here reasons about paths as strings
to decide where a write lands: every member is created relative to a directory file descriptor,
each component opened with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` (``safe_fs``), so the
kernel refuses any lookup that would pass through a symlink or leave the destination. Symlink
members are written as links and never followed during extraction; hard-link members may only point
at a regular file extracted earlier from the same archive (same inode as recorded). Devices, fifos,
too many members (the directories their paths imply included), members deeper than
``ArchiveLimits.max_depth`` path components (deeper trees are what broke recursive walks of
snapshots) and too many bytes (declared or actual) raise ``ArchiveRejected`` naming the member; a
corrupt or truncated archive raises ``ArchiveRejected`` too, never a library exception.
``inspect_archive`` runs the same member checks without writing anything: the web app's check of
an upload at submission, so what extraction would refuse is refused there first.

When the caller runs as root and names an unprivileged ``run_as`` owner, extraction happens in a
process under that uid (no capabilities, no new privileges, bounded address space and CPU time)
that receives the archive and the destination as open file descriptors, so a bug in the extractor
cannot write as root: a child of the worker's unprivileged fork server (``extract_server``).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import posixpath
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO

from sandboxes.base import ArchiveRejected, PathOutsideWorkspace
from sandboxes.extract_server import extract_unprivileged
from sandboxes.safe_fs import open_beneath

logger = logging.getLogger(__name__)
MAX_LINK_TARGET = 4096


def _configured_depth() -> int:
    from sandboxes.settings import current

    return current().archive_max_depth


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds on what an archive may contain."""

    max_members: int = 50_000
    """Most entries (files, dirs, links) accepted."""
    max_total_bytes: int = 1024 * 1024 * 1024
    """Most uncompressed bytes across all members."""
    max_member_bytes: int = 256 * 1024 * 1024
    """Most uncompressed bytes in one member."""
    max_depth: int = field(default_factory=_configured_depth)
    """Most path components in a member's name (``a/b/c.py`` has 3); the deployment's
    ``FLOWSTATE_ARCHIVE_MAX_DEPTH`` (``sandboxes.settings``), 64 unless set."""

    def __post_init__(self) -> None:
        if min(self.max_members, self.max_total_bytes, self.max_member_bytes, self.max_depth) <= 0:
            raise ValueError("ArchiveLimits fields must all be positive")
        if self.max_member_bytes > self.max_total_bytes:
            raise ValueError("ArchiveLimits.max_member_bytes cannot exceed max_total_bytes; lower it")


@dataclass
class _Member:
    name: str
    kind: str
    """'file', 'dir', 'symlink', 'hardlink' or 'special'."""
    size: int
    mode: int
    link: str = ""
    opener: Callable[[], IO[bytes]] | None = None


def _shown(name: str) -> str:
    """A member name for a message: hostile names can be kilobytes long."""
    return repr(name) if len(name) <= 160 else repr(f"{name[:80]}...{name[-60:]}")


def _check_name(name: str) -> str:
    if not name or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise ArchiveRejected(f"archive member {_shown(name)} has an absolute path")
    if "\x00" in name:
        raise ArchiveRejected(f"archive member {_shown(name)} contains a NUL byte")
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ArchiveRejected(f"archive member {_shown(name)} contains '..', which escapes the archive")
    return "/".join(parts)


def _check_link(member: str, target: str) -> None:
    # Not the defence (links are never followed while extracting); it keeps obviously hostile
    # links out of the workspace the agent later reads.
    if not target or target.startswith("/") or "\x00" in target:
        raise ArchiveRejected(f"archive link {_shown(member)} points outside the archive: {_shown(target)} is an "
                              "absolute path")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(member), target))
    if resolved == ".." or resolved.startswith("../"):
        raise ArchiveRejected(f"archive link {_shown(member)} -> {_shown(target)} points outside the archive")


# --- Reading members ---------------------------------------------------------------------------

def _zip_members(zf: zipfile.ZipFile) -> Iterator[_Member]:
    for info in zf.infolist():
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            with zf.open(info) as src:
                target = src.read(MAX_LINK_TARGET + 1)
            if len(target) > MAX_LINK_TARGET:
                raise ArchiveRejected(f"archive link {info.filename!r} has a target over {MAX_LINK_TARGET} bytes")
            yield _Member(info.filename, "symlink", 0, 0, target.decode("utf-8", "replace"))
        elif info.is_dir() or stat.S_ISDIR(mode):
            yield _Member(info.filename, "dir", 0, mode & 0o777)
        elif stat.S_IFMT(mode) and not stat.S_ISREG(mode):
            yield _Member(info.filename, "special", 0, 0)
        else:
            yield _Member(info.filename, "file", info.file_size, mode & 0o777, opener=functools.partial(zf.open, info))


def _tar_member_stream(tar: tarfile.TarFile, info: tarfile.TarInfo) -> IO[bytes]:
    stream = tar.extractfile(info)
    if stream is None:  # only for members that are not regular files, which never get an opener
        raise ArchiveRejected(f"archive member {info.name!r} has no data")
    return stream


def _tar_members(tar: tarfile.TarFile) -> Iterator[_Member]:
    for info in tar:
        if info.issym():
            yield _Member(info.name, "symlink", 0, 0, info.linkname)
        elif info.islnk():
            yield _Member(info.name, "hardlink", 0, 0, info.linkname)
        elif info.isdir():
            yield _Member(info.name, "dir", 0, info.mode & 0o777)
        elif info.isfile():
            yield _Member(info.name, "file", info.size, info.mode & 0o777,
                          opener=functools.partial(_tar_member_stream, tar, info))
        else:
            yield _Member(info.name, "special", 0, 0)


# --- Writing members relative to a directory fd ------------------------------------------------

def _open_dir(root_fd: int, relative: str, *, create: bool, member: str) -> int:
    """Open (creating if asked) directory ``relative`` below root_fd; no component may be a symlink."""
    current = os.dup(root_fd)
    try:
        for part in [p for p in relative.split("/") if p]:
            try:
                child = open_beneath(current, part, os.O_RDONLY | os.O_DIRECTORY, follow_symlinks=False)
            except FileNotFoundError:
                if not create:
                    raise ArchiveRejected(f"archive member {member!r} refers to {relative!r}, which was not extracted") from None
                os.mkdir(part, 0o755, dir_fd=current)
                child = open_beneath(current, part, os.O_RDONLY | os.O_DIRECTORY, follow_symlinks=False)
            os.close(current)
            current = child
        return current
    except PathOutsideWorkspace:
        os.close(current)
        raise ArchiveRejected(f"archive member {member!r} would be written through a symlink; refused") from None
    except NotADirectoryError:
        os.close(current)
        raise ArchiveRejected(f"archive member {member!r} needs {relative!r} to be a directory") from None
    except BaseException:
        os.close(current)
        raise


def _clear(parent_fd: int, base: str, member: str) -> None:
    """Remove an earlier member of the same name (tar lets later members win); never a directory."""
    try:
        info = os.stat(base, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        raise ArchiveRejected(f"archive member {member!r} would replace a directory")
    os.unlink(base, dir_fd=parent_fd)


MAX_NAME_BYTES = 4096
"""Longest member name accepted (PATH_MAX): no tool that made a real repository writes longer."""


def _name_id(parts: list[str]) -> int:
    """A fixed-size key for a path (kept per member, where names can be kilobytes long)."""
    key = 0
    for part in parts:
        key = hash((key, part))
    return key


class _MemberCheck:
    """What an archive may hold, checked member by member before anything of it is written.

    The same checks run at submission (``inspect_archive``, which writes nothing) and in the
    extractor, where the kernel-level checks (``openat2`` without symlinks, hard links by inode)
    back them up. Every directory a member's path implies counts as a member too: that bounds what
    extraction creates and what this remembers (one small key per path, ``kinds``).
    """

    def __init__(self, limits: ArchiveLimits) -> None:
        self.limits = limits
        self.count = 0
        self.declared = 0
        self.kinds: dict[int, str] = {}
        """Path key -> 'dir', 'file' (regular files and hard links to them) or 'symlink'."""

    def _counted(self) -> None:
        self.count += 1
        if self.count > self.limits.max_members:
            raise ArchiveRejected(f"archive has more than {self.limits.max_members} members (the directories "
                                  "their paths imply included)")

    def check(self, member: _Member) -> str:
        """The member's normalised name ('' for the archive's root directory), or ArchiveRejected."""
        self._counted()
        if member.kind == "special":
            raise ArchiveRejected(f"archive member {_shown(member.name)} is a device, fifo or other special file")
        name = _check_name(member.name)
        if not name:
            return ""
        parts = name.split("/")
        if len(parts) > self.limits.max_depth:
            raise ArchiveRejected(f"archive member {_shown(member.name)} is {len(parts)} path components deep; "
                                  f"the limit is {self.limits.max_depth}")
        if len(name.encode()) > MAX_NAME_BYTES:
            raise ArchiveRejected(f"archive member {_shown(member.name)} has a name over {MAX_NAME_BYTES} bytes")
        if member.size > self.limits.max_member_bytes:
            raise ArchiveRejected(f"archive member {_shown(member.name)} is {member.size} bytes, over the "
                                  f"{self.limits.max_member_bytes}-byte limit")
        self.declared += member.size
        if self.declared > self.limits.max_total_bytes:
            raise ArchiveRejected(f"archive unpacks to more than {self.limits.max_total_bytes} bytes")
        if member.kind == "symlink":
            _check_link(name, member.link)
        self._place(parts, member)
        return name

    def _place(self, parts: list[str], member: _Member) -> None:
        key = 0
        for index, part in enumerate(parts[:-1]):
            key = hash((key, part))
            kind = self.kinds.get(key)
            if kind is None:
                self._counted()
                self.kinds[key] = "dir"
            elif kind == "symlink":
                raise ArchiveRejected(f"archive member {_shown(member.name)} would be written through a symlink; refused")
            elif kind != "dir":
                raise ArchiveRejected(f"archive member {_shown(member.name)} needs "
                                      f"{_shown('/'.join(parts[:index + 1]))} to be a directory")
        key = hash((key, parts[-1]))
        existing = self.kinds.get(key)
        if member.kind == "dir":
            if existing not in (None, "dir"):
                raise ArchiveRejected(f"archive member {_shown(member.name)} is a directory over an existing file or link")
            self.kinds[key] = "dir"
            return
        if existing == "dir":
            raise ArchiveRejected(f"archive member {_shown(member.name)} would replace a directory")
        if member.kind == "hardlink":
            target = _check_name(member.link)
            if not target or self.kinds.get(_name_id(target.split("/"))) != "file":
                raise ArchiveRejected(f"archive hard link {_shown(member.name)} -> {_shown(member.link)} does not point "
                                      "at a regular file extracted earlier from the same archive")
        self.kinds[key] = "symlink" if member.kind == "symlink" else "file"


class _Extractor:
    def __init__(self, dest_fd: int, limits: ArchiveLimits) -> None:
        self.dest_fd = dest_fd
        self.limits = limits
        self.check = _MemberCheck(limits)
        self.total = 0
        self.files: dict[str, tuple[int, int]] = {}
        """Regular files this archive created: name -> (st_dev, st_ino), the only hard-link targets."""

    def add(self, member: _Member) -> None:
        name = self.check.check(member)
        if not name:
            return
        parent, _, base = name.rpartition("/")
        parent_fd = _open_dir(self.dest_fd, parent, create=True, member=member.name)
        try:
            if member.kind == "dir":
                self._mkdir(parent_fd, base, member)
            else:
                _clear(parent_fd, base, member.name)
                self.files.pop(name, None)
                if member.kind == "symlink":
                    os.symlink(member.link, base, dir_fd=parent_fd)
                elif member.kind == "hardlink":
                    self._hardlink(parent_fd, base, name, member)
                else:
                    self._write(parent_fd, base, name, member)
        finally:
            os.close(parent_fd)

    def _mkdir(self, parent_fd: int, base: str, member: _Member) -> None:
        try:
            os.mkdir(base, 0o755, dir_fd=parent_fd)
        except FileExistsError:
            if not stat.S_ISDIR(os.stat(base, dir_fd=parent_fd, follow_symlinks=False).st_mode):
                raise ArchiveRejected(f"archive member {member.name!r} is a directory over an existing file or link") from None

    def _write(self, parent_fd: int, base: str, name: str, member: _Member) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = open_beneath(parent_fd, base, flags, 0o600, follow_symlinks=False)
        try:
            written = 0
            if member.opener is None:
                raise ArchiveRejected(f"archive member {member.name!r} has no data")
            with member.opener() as src:
                while chunk := src.read(1 << 20):
                    written += len(chunk)
                    self.total += len(chunk)
                    if written > self.limits.max_member_bytes or written > member.size:
                        raise ArchiveRejected(f"archive member {member.name!r} inflates past its declared size")
                    if self.total > self.limits.max_total_bytes:
                        raise ArchiveRejected(f"archive unpacks to more than {self.limits.max_total_bytes} bytes")
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view):]
            os.fchmod(fd, (member.mode & 0o755) | 0o600 if member.mode else 0o644)
            info = os.fstat(fd)
            self.files[name] = (info.st_dev, info.st_ino)
        finally:
            os.close(fd)

    def _hardlink(self, parent_fd: int, base: str, name: str, member: _Member) -> None:
        target = _check_name(member.link)
        recorded = self.files.get(target)
        if recorded is None:
            raise ArchiveRejected(f"archive hard link {member.name!r} -> {member.link!r} does not point at a regular "
                                  "file extracted earlier from the same archive")
        target_parent, _, target_base = target.rpartition("/")
        source_fd = _open_dir(self.dest_fd, target_parent, create=False, member=member.name)
        try:
            info = os.stat(target_base, dir_fd=source_fd, follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != recorded:
                raise ArchiveRejected(f"archive hard link {member.name!r} -> {member.link!r}: the target changed")
            os.link(target_base, base, src_dir_fd=source_fd, dst_dir_fd=parent_fd, follow_symlinks=False)
        finally:
            os.close(source_fd)
        self.files[name] = recorded


def _each_member(archive: BinaryIO, label: str, visit: Callable[[_Member], object]) -> None:
    """Call ``visit`` on every member of a zip or tar (told apart by content, as extraction does)."""
    try:
        if zipfile.is_zipfile(archive):
            archive.seek(0)
            with zipfile.ZipFile(archive) as zf:
                for member in _zip_members(zf):
                    visit(member)
            return
        archive.seek(0)
        try:
            tar = tarfile.open(fileobj=archive, mode="r:*")  # noqa: SIM115 - closed by the with block below
        except tarfile.TarError as exc:
            raise ArchiveRejected(f"{label} is malformed or truncated: neither a zip nor a readable tar archive "
                                  f"({exc})") from None
        with tar:
            for member in _tar_members(tar):
                visit(member)
    except ArchiveRejected:
        raise
    except PathOutsideWorkspace as exc:
        raise ArchiveRejected(f"archive member refused: {exc}") from None
    except (zipfile.BadZipFile, zlib.error, tarfile.TarError, EOFError, NotImplementedError, RuntimeError) as exc:
        raise ArchiveRejected(f"{label} is corrupt: malformed or truncated, it cannot be read ({type(exc).__name__}: "
                              f"{str(exc)[:200]})") from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise ArchiveRejected(f"{label} does not fit on the disk") from None
        raise ArchiveRejected(f"{label} could not be extracted ({exc.strerror or exc})") from None


def _extract_stream(archive: BinaryIO, dest_fd: int, limits: ArchiveLimits, label: str) -> None:
    _each_member(archive, label, _Extractor(dest_fd, limits).add)


# --- Entry points --------------------------------------------------------------------------------

def inspect_archive(archive: Path, *, limits: ArchiveLimits | None = None, label: str | None = None) -> None:
    """Check every member of ``archive`` the way extraction will, writing nothing (the early check
    at submission); ArchiveRejected names the first problem. ``label`` names the archive in messages."""
    limits = limits or ArchiveLimits()
    check = _MemberCheck(limits)
    with open(archive, "rb") as stream:
        _each_member(stream, label or archive.name, check.check)


def extract_archive(archive: Path, destination: Path, *, limits: ArchiveLimits | None = None,
                    run_as: tuple[int, int] | None = None) -> None:
    """Extract ``archive`` into ``destination`` (created if missing; must be empty).

    ``run_as`` (uid, gid): when this process is root, extract in a child with that identity, no
    capabilities and bounded memory/CPU; the files end up owned by it.
    """
    limits = limits or ArchiveLimits()
    if not archive.is_file():
        raise ArchiveRejected(f"archive {archive.name} does not exist or is not a file")
    destination.mkdir(exist_ok=True)
    if any(destination.iterdir()):
        raise ArchiveRejected(f"extraction destination {destination} is not empty")
    dest_fd = os.open(destination, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with open(archive, "rb") as stream:
            if run_as is not None and os.geteuid() == 0:
                os.fchown(dest_fd, *run_as)
                _extract_in_child(stream, dest_fd, limits, run_as, archive.name)
            else:
                _extract_stream(stream, dest_fd, limits, archive.name)
    finally:
        os.close(dest_fd)


def _extract_in_child(stream: BinaryIO, dest_fd: int, limits: ArchiveLimits, run_as: tuple[int, int],
                      label: str) -> None:
    # The worker's pre-started unprivileged fork server extracts (sandboxes/extract_server.py says why
    # neither a fork of the worker nor an interpreter per archive).
    extract_unprivileged(stream.fileno(), dest_fd, limits=limits, run_as=run_as, label=label)
