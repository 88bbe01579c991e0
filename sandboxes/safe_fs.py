"""File access confined to a directory, safe against symlink swaps by code running in the sandbox.

Every lookup goes through ``openat2(2)`` with ``RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`` relative
to a directory fd of the workspace root, so the kernel refuses, atomically, any resolution that
leaves the workspace (``..``, absolute symlinks, symlinks pointing out, ``/proc`` magic links). A
sandboxed process swapping a path component for a symlink between our check and our use cannot
redirect the access: there is no separate check. Regular files with more than one hard link are
refused because the other link may live outside the workspace.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Iterator
from typing import Literal

from sandboxes.base import DirEntry, PathOutsideWorkspace, SandboxError, SandboxLimitExceeded
from sandboxes.safe_tree import walk_entries

SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08

_libc = ctypes.CDLL(None, use_errno=True)

PATH_CHUNK_BYTES = 2048
"""Longest path one openat2 call is given. A tree can be deeper than PATH_MAX lets one path name
(every level is created relative to its parent), so longer paths are resolved in parts."""
MAX_FILE_BYTES = 64 * 1024 * 1024
"""Largest file read_bytes returns; bigger reads raise SandboxLimitExceeded instead of exhausting memory."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def normalize_relative(path: object) -> str:
    """Validate a workspace path lexically and return it without ``./`` noise ('' means the root).

    Accepts ``/workspace/...`` (the in-sandbox absolute spelling) as the relative path below it.
    """
    if not isinstance(path, str):
        raise PathOutsideWorkspace(f"path must be a string, got {type(path).__name__}")
    if "\x00" in path:
        raise PathOutsideWorkspace("path contains a NUL byte")
    cleaned = path.strip()
    if cleaned == "/workspace" or cleaned.startswith("/workspace/"):
        cleaned = cleaned[len("/workspace") :]
        cleaned = cleaned.lstrip("/")
    elif cleaned.startswith(("/", "~")):
        raise PathOutsideWorkspace(
            f"{path!r} is absolute; use a path relative to the workspace root (/workspace)"
        )
    parts = [part for part in cleaned.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise PathOutsideWorkspace(f"{path!r} contains '..'; paths must stay inside the workspace")
    return "/".join(parts)


def open_beneath(root_fd: int, relative: str, flags: int, mode: int = 0o644, *, follow_symlinks: bool = True) -> int:
    """openat2 ``relative`` below ``root_fd``; a resolution leaving the root raises PathOutsideWorkspace.

    ``follow_symlinks=False`` adds ``RESOLVE_NO_SYMLINKS``: any symlink in any component is refused,
    even one that would stay inside (archive extraction writes links but never goes through them).
    """
    if len(relative.encode()) > PATH_CHUNK_BYTES:
        return _open_long(root_fd, relative, flags, mode, follow_symlinks=follow_symlinks)
    resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
    if not follow_symlinks:
        resolve |= RESOLVE_NO_SYMLINKS
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, resolve)
    fd = _libc.syscall(SYS_OPENAT2, root_fd, (relative or ".").encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd >= 0:
        return fd
    err = ctypes.get_errno()
    if err == errno.EXDEV:
        raise PathOutsideWorkspace(
            f"{relative!r} resolves outside the workspace (a symlink or mount leads out); access refused"
        )
    if err == errno.ELOOP:
        raise PathOutsideWorkspace(f"{relative!r} is a symlink; tools do not follow it")
    raise OSError(err, os.strerror(err), relative)


def _open_long(root_fd: int, relative: str, flags: int, mode: int, *, follow_symlinks: bool) -> int:
    """open_beneath for a path longer than one openat2 call takes: a part at a time, each part
    resolved beneath the directory the previous part opened (stricter than beneath the root)."""
    parts = [part for part in relative.split("/") if part]
    chunks: list[list[str]] = [[]]
    for part in parts:
        if chunks[-1] and sum(len(p.encode()) + 1 for p in chunks[-1]) + len(part.encode()) > PATH_CHUNK_BYTES:
            chunks.append([])
        chunks[-1].append(part)
    current = os.dup(root_fd)
    try:
        for chunk in chunks[:-1]:
            child = open_beneath(current, "/".join(chunk), os.O_PATH | os.O_DIRECTORY, follow_symlinks=follow_symlinks)
            os.close(current)
            current = child
        return open_beneath(current, "/".join(chunks[-1]), flags, mode, follow_symlinks=follow_symlinks)
    finally:
        os.close(current)


def _describe(err: OSError, relative: str) -> SandboxError:
    if err.errno == errno.ENOENT:
        return SandboxError(f"{relative or '.'}: no such file or directory")
    if err.errno == errno.ENOTDIR:
        return SandboxError(f"{relative}: a parent component is not a directory")
    if err.errno == errno.EISDIR:
        return SandboxError(f"{relative}: is a directory")
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return SandboxLimitExceeded(f"{relative}: the sandbox disk quota is full")
    if err.errno == errno.EACCES:
        return SandboxError(f"{relative}: permission denied")
    return SandboxError(f"{relative}: {err.strerror}")


def _refuse_multiply_linked(fd: int, relative: str) -> os.stat_result:
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
        raise PathOutsideWorkspace(
            f"{relative!r} has {info.st_nlink} hard links; tools refuse multiply-linked files because "
            "another link may live outside the workspace"
        )
    return info


def read_bytes(root_fd: int, path: str, *, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    relative = normalize_relative(path)
    try:
        # Symlinks are followed only while they stay inside the workspace (RESOLVE_BENEATH).
        fd = open_beneath(root_fd, relative, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise _describe(err, relative) from None
    try:
        info = _refuse_multiply_linked(fd, relative)
        if stat.S_ISDIR(info.st_mode):
            raise SandboxError(f"{relative or '.'}: is a directory; use list_dir")
        if not stat.S_ISREG(info.st_mode):
            raise SandboxError(f"{relative}: not a regular file")
        if info.st_size > max_bytes:
            raise SandboxLimitExceeded(f"{relative}: {info.st_size} bytes is over the {max_bytes}-byte read limit")
        chunks = []
        total = 0
        while chunk := os.read(fd, 1 << 20):
            total += len(chunk)
            if total > max_bytes:
                raise SandboxLimitExceeded(f"{relative}: grew past the {max_bytes}-byte read limit while reading")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _filesystem_identity(owner: tuple[int, int] | None) -> Iterator[None]:
    """Create files as ``owner`` (this thread only): a sandbox's overlay refuses owners it cannot map."""
    if owner is None or os.geteuid() != 0:
        yield
        return
    previous_gid = _libc.setfsgid(owner[1])
    previous_uid = _libc.setfsuid(owner[0])
    try:
        yield
    finally:
        _libc.setfsuid(previous_uid)
        _libc.setfsgid(previous_gid)


def _open_dir_creating(root_fd: int, relative: str) -> int:
    """Open directory ``relative`` below root_fd, creating missing components."""
    current = os.dup(root_fd)
    try:
        for part in [p for p in relative.split("/") if p]:
            # Each step resolves below the previous directory, so a symlink may only lead further down.
            try:
                child = open_beneath(current, part, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=current)
                child = open_beneath(current, part, os.O_RDONLY | os.O_DIRECTORY)
            os.close(current)
            current = child
        return current
    except BaseException:
        os.close(current)
        raise


def write_bytes(root_fd: int, path: str, data: bytes, *, owner: tuple[int, int] | None) -> None:
    relative = normalize_relative(path)
    if not relative:
        raise SandboxError("cannot write to the workspace root; give a file path")
    parent, _, name = relative.rpartition("/")
    with _filesystem_identity(owner):
        _write_below(root_fd, relative, parent, name, data)


def _write_below(root_fd: int, relative: str, parent: str, name: str, data: bytes) -> None:
    try:
        parent_fd = _open_dir_creating(root_fd, parent)
    except OSError as err:
        raise _describe(err, parent or ".") from None
    try:
        try:
            fd = open_beneath(parent_fd, name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as err:
            raise _describe(err, relative) from None
        try:
            info = _refuse_multiply_linked(fd, relative)
            if not stat.S_ISREG(info.st_mode):
                raise SandboxError(f"{relative}: not a regular file")
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
        except OSError as err:
            raise _describe(err, relative) from None
        finally:
            os.close(fd)
    finally:
        os.close(parent_fd)


def _kind(mode: int) -> Literal["file", "dir", "symlink", "other"]:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    return "other"


def list_dir(root_fd: int, path: str) -> list[DirEntry]:
    relative = normalize_relative(path)
    try:
        fd = open_beneath(root_fd, relative, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as err:
        raise _describe(err, relative) from None
    try:
        entries = []
        for name in sorted(os.listdir(fd)):
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            kind = _kind(info.st_mode)
            entries.append(DirEntry(name=name, kind=kind, size=0 if kind == "dir" else info.st_size))
        return entries
    finally:
        os.close(fd)


def walk_files(root_fd: int, *, skip_dirs: frozenset[str] = frozenset()) -> Iterator[tuple[str, os.stat_result]]:
    """Yield (relative path, lstat) for every non-directory entry below root_fd, sorted, no symlink following."""
    top = open_beneath(root_fd, "", os.O_RDONLY | os.O_DIRECTORY)
    for relative, info in walk_entries(top, skip_top=skip_dirs):
        if not stat.S_ISDIR(info.st_mode):
            yield relative, info


def read_entry(root_fd: int, relative: str, info: os.stat_result) -> bytes | None:
    """Content used for diffs: file bytes, symlink target, or None for other entry kinds."""
    if stat.S_ISLNK(info.st_mode):
        parent, _, name = relative.rpartition("/")
        dir_fd = open_beneath(root_fd, parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW) if parent else None
        try:
            return os.readlink(name, dir_fd=dir_fd if dir_fd is not None else root_fd).encode()
        finally:
            if dir_fd is not None:
                os.close(dir_fd)
    if stat.S_ISREG(info.st_mode):
        fd = open_beneath(root_fd, relative, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)
    return None
