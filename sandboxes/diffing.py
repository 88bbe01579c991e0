"""Deterministic git-style unified diff between two file trees (snapshot vs workspace)."""

from __future__ import annotations

import difflib
import os
import stat
from collections.abc import Callable, Mapping

from sandboxes import safe_fs

DIFF_MAX_FILE_BYTES = 2 * 1024 * 1024
"""Files larger than this (either side) get a one-line "Large files differ" entry, not hunks: difflib
holds every line as an object, so a 30 MB file of 2-byte lines would cost gigabytes on the host."""
DIFF_MAX_BYTES = 32 * 1024 * 1024
"""Most bytes of diff text; later files are listed by name only, so host memory follows this bound."""

UNCHANGED = (-1, -1)
"""What ``large`` returns for a big file whose content and mode did not change."""

Entry = tuple[int, bytes | None]
"""(st_mode, content) of one path; content is None for entries that are neither files nor symlinks."""


def _git_mode(mode: int | None) -> str:
    if mode is None:
        raise ValueError("a file that is absent on one side has no mode there")
    if stat.S_ISLNK(mode):
        return "120000"
    return "100755" if mode & 0o111 else "100644"


def _is_binary(content: bytes) -> bool:
    if b"\x00" in content[:8192]:
        return True
    try:
        content.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _hunks(path: str, old: bytes, new: bytes, old_label: str, new_label: str) -> list[str]:
    old_lines = old.decode("utf-8").splitlines(keepends=True)
    new_lines = new.decode("utf-8").splitlines(keepends=True)
    out: list[str] = []
    for line in difflib.unified_diff(old_lines, new_lines, old_label, new_label, n=3, lineterm=""):
        if line.startswith(("---", "+++")) and not line.endswith("\n") or line.startswith("@@"):
            out.append(line + "\n")
        elif line.endswith("\n"):
            out.append(line)
        else:
            out.append(line + "\n\\ No newline at end of file\n")
    return out


def tree_diff(
    old_paths: Mapping[str, int],
    new_paths: Mapping[str, int],
    *,
    read_old: Callable[[str], bytes | None],
    read_new: Callable[[str], bytes | None],
    maybe_same: Callable[[str], bool],
    large: Callable[[str], tuple[int, int] | None] = lambda path: None,
) -> str:
    """Unified diff of two trees given {path: st_mode} listings and content readers.

    ``maybe_same(path)`` lets the caller skip reading files whose metadata proves them unchanged.
    ``large(path)`` returns (old size, new size) for a file too big to diff line by line (its
    contents are then never read here), else None.
    """
    chunks: list[str] = []
    size = 0
    omitted: list[str] = []
    for path in sorted(set(old_paths) | set(new_paths)):
        old_mode, new_mode = old_paths.get(path), new_paths.get(path)
        if old_mode is not None and new_mode is not None and maybe_same(path):
            continue
        if size > DIFF_MAX_BYTES:
            omitted.append(path)
            continue
        sizes = large(path)
        if sizes == UNCHANGED:
            continue
        if sizes is not None:
            chunks.append(_large_entry(path, old_mode, new_mode, sizes))
            size += len(chunks[-1])
            continue
        start = len(chunks)
        old = read_old(path) if old_mode is not None else None
        new = read_new(path) if new_mode is not None else None
        if old_mode is not None and new_mode is not None and old == new and _git_mode(old_mode) == _git_mode(new_mode):
            continue
        header = [f"diff --git a/{path} b/{path}\n"]
        if old_mode is None:
            header.append(f"new file mode {_git_mode(new_mode)}\n")
        elif new_mode is None:
            header.append(f"deleted file mode {_git_mode(old_mode)}\n")
        elif _git_mode(old_mode) != _git_mode(new_mode):
            header.append(f"old mode {_git_mode(old_mode)}\nnew mode {_git_mode(new_mode)}\n")
        old_label = f"a/{path}" if old_mode is not None else "/dev/null"
        new_label = f"b/{path}" if new_mode is not None else "/dev/null"
        old_bytes, new_bytes = old or b"", new or b""
        if old_bytes == new_bytes:
            chunks.extend(header)
        elif _is_binary(old_bytes) or _is_binary(new_bytes):
            chunks.extend(header)
            chunks.append(f"Binary files {old_label} and {new_label} differ\n")
        else:
            chunks.extend(header)
            chunks.extend(_hunks(path, old_bytes, new_bytes, old_label, new_label))
        size += sum(len(chunk) for chunk in chunks[start:])
    if omitted:
        chunks.append(f"[diff stopped at {DIFF_MAX_BYTES} bytes; {len(omitted)} more changed path(s): "
                      + ", ".join(omitted[:200]) + ("..." if len(omitted) > 200 else "") + "]\n")
    return "".join(chunks)


def _large_entry(path: str, old_mode: int | None, new_mode: int | None, sizes: tuple[int, int]) -> str:
    header = f"diff --git a/{path} b/{path}\n"
    if old_mode is None:
        header += f"new file mode {_git_mode(new_mode)}\n"
    elif new_mode is None:
        header += f"deleted file mode {_git_mode(old_mode)}\n"
    elif _git_mode(old_mode) != _git_mode(new_mode):
        header += f"old mode {_git_mode(old_mode)}\nnew mode {_git_mode(new_mode)}\n"
    old_label = f"a/{path}" if old_mode is not None else "/dev/null"
    new_label = f"b/{path}" if new_mode is not None else "/dev/null"
    return (header + f"Large files {old_label} and {new_label} differ ({sizes[0]} -> {sizes[1]} bytes; "
            f"line diffs are shown for files up to {DIFF_MAX_FILE_BYTES} bytes)\n")


def _same_content(old_fd: int, new_fd: int, path: str, a: os.stat_result, b: os.stat_result) -> bool:
    """Compare two regular files chunk by chunk (constant memory)."""
    if not (stat.S_ISREG(a.st_mode) and stat.S_ISREG(b.st_mode)) or a.st_size != b.st_size:
        return False
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    left = safe_fs.open_beneath(old_fd, path, flags)
    try:
        right = safe_fs.open_beneath(new_fd, path, flags)
        try:
            while True:
                x, y = os.read(left, 1 << 20), os.read(right, 1 << 20)
                if x != y:
                    return False
                if not x:
                    return True
        finally:
            os.close(right)
    finally:
        os.close(left)


def workspace_diff(*, snapshot_dir: str, workspace_fd: int) -> str:
    """Unified git-style diff of a sandbox workspace (an open directory fd) against its snapshot."""
    lower_fd = os.open(snapshot_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        skip = frozenset({".git"})
        old = dict(safe_fs.walk_files(lower_fd, skip_dirs=skip))
        new = dict(safe_fs.walk_files(workspace_fd, skip_dirs=skip))

        def maybe_same(path: str) -> bool:
            a, b = old[path], new[path]
            return (a.st_mode, a.st_size, a.st_mtime_ns) == (b.st_mode, b.st_size, b.st_mtime_ns)

        def large(path: str) -> tuple[int, int] | None:
            a, b = old.get(path), new.get(path)
            if not any(s is not None and stat.S_ISREG(s.st_mode) and s.st_size > DIFF_MAX_FILE_BYTES for s in (a, b)):
                return None
            if a is not None and b is not None and _same_content(lower_fd, workspace_fd, path, a, b):
                return UNCHANGED if _git_mode(a.st_mode) == _git_mode(b.st_mode) else (a.st_size, b.st_size)
            return (a.st_size if a else 0, b.st_size if b else 0)

        return tree_diff(
            {p: s.st_mode for p, s in old.items()},
            {p: s.st_mode for p, s in new.items()},
            read_old=lambda p: safe_fs.read_entry(lower_fd, p, old[p]),
            read_new=lambda p: safe_fs.read_entry(workspace_fd, p, new[p]),
            maybe_same=maybe_same,
            large=large,
        )
    finally:
        os.close(lower_fd)
