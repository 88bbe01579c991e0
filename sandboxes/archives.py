"""Validated extraction of repository archives (.tar, .tar.gz, .tgz, .zip) into a snapshot directory.

Every member is checked before anything is written: absolute names, ``..`` components, symlinks or
hard links whose target leaves the archive root, device/fifo members, too many members and too
many bytes are rejected with ``ArchiveRejected`` naming the offending member.
"""

from __future__ import annotations

import posixpath
import stat
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from sandboxes.base import ArchiveRejected


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds on what an archive may contain."""

    max_members: int = 50_000
    """Most entries (files, dirs, links) accepted."""
    max_total_bytes: int = 1024 * 1024 * 1024
    """Most uncompressed bytes across all members."""
    max_member_bytes: int = 256 * 1024 * 1024
    """Most uncompressed bytes in one member."""

    def __post_init__(self) -> None:
        if min(self.max_members, self.max_total_bytes, self.max_member_bytes) <= 0:
            raise ValueError("ArchiveLimits fields must all be positive")
        if self.max_member_bytes > self.max_total_bytes:
            raise ValueError("ArchiveLimits.max_member_bytes cannot exceed max_total_bytes; lower it")


def _check_name(name: str) -> str:
    if not name or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise ArchiveRejected(f"archive member {name!r} has an absolute path")
    if "\x00" in name:
        raise ArchiveRejected(f"archive member {name!r} contains a NUL byte")
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ArchiveRejected(f"archive member {name!r} contains '..'")
    return "/".join(parts)


def _check_link(member: str, target: str, *, relative_to_member: bool) -> None:
    if not target or target.startswith("/"):
        raise ArchiveRejected(f"archive link {member!r} points to absolute path {target!r}")
    base = posixpath.dirname(member) if relative_to_member else ""
    resolved = posixpath.normpath(posixpath.join(base, target))
    if resolved == ".." or resolved.startswith("../"):
        raise ArchiveRejected(f"archive link {member!r} -> {target!r} points outside the archive")


def _check_budget(name: str, size: int, count: int, total: int, limits: ArchiveLimits) -> None:
    if count > limits.max_members:
        raise ArchiveRejected(f"archive has more than {limits.max_members} members")
    if size > limits.max_member_bytes:
        raise ArchiveRejected(f"archive member {name!r} is {size} bytes, over the {limits.max_member_bytes}-byte limit")
    if total > limits.max_total_bytes:
        raise ArchiveRejected(f"archive unpacks to more than {limits.max_total_bytes} bytes")


def extract_archive(archive: Path, destination: Path, *, limits: ArchiveLimits | None = None) -> None:
    """Validate every member of ``archive``, then extract it into the empty directory ``destination``."""
    limits = limits or ArchiveLimits()
    if not archive.is_file():
        raise ArchiveRejected(f"archive {archive} does not exist or is not a file")
    if zipfile.is_zipfile(archive):
        _extract_zip(archive, destination, limits)
        return
    try:
        tar = tarfile.open(archive, "r:*")  # noqa: SIM115 - closed by the with block below
    except (tarfile.TarError, OSError) as exc:
        raise ArchiveRejected(f"{archive.name} is neither a zip nor a readable tar archive: {exc}") from None
    with tar:
        total = 0
        members = []
        for count, member in enumerate(tar, start=1):
            name = _check_name(member.name)
            total += max(member.size, 0)
            _check_budget(member.name, member.size, count, total, limits)
            if member.issym():
                _check_link(name, member.linkname, relative_to_member=True)
            elif member.islnk():
                _check_link(name, _check_name(member.linkname), relative_to_member=False)
            elif not (member.isfile() or member.isdir()):
                raise ArchiveRejected(f"archive member {member.name!r} is a device, fifo or other special file")
            members.append(member)
        # The standard library's data filter is a second, independent line of defence.
        tar.extractall(destination, members=members, filter="data")


def _extract_zip(archive: Path, destination: Path, limits: ArchiveLimits) -> None:
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        total = 0
        symlinks: list[tuple[str, str]] = []
        for count, info in enumerate(infos, start=1):
            name = _check_name(info.filename)
            total += info.file_size
            _check_budget(info.filename, info.file_size, count, total, limits)
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                target = zf.read(info).decode("utf-8", "replace")
                _check_link(name, target, relative_to_member=True)
                symlinks.append((name, target))
            elif stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ArchiveRejected(f"archive member {info.filename!r} is a device, fifo or other special file")
        link_names = {name for name, _ in symlinks}
        for info in infos:
            name = _check_name(info.filename)
            if name in link_names or not name:
                continue
            target = destination / name
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as dst:
                remaining = limits.max_member_bytes + 1
                while chunk := src.read(1 << 20):
                    remaining -= len(chunk)
                    if remaining <= 0:
                        raise ArchiveRejected(f"archive member {info.filename!r} inflates past its declared size")
                    dst.write(chunk)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                target.chmod(mode & 0o755 | 0o600)
        for name, link_target in symlinks:
            path = destination / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.symlink_to(link_target)
