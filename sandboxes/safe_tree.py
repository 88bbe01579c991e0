"""Walking, re-owning and deleting whole untrusted trees: iterative and descriptor-relative.

Trees written by sandboxes, setup commands or archives are untrusted: any depth (each level can be
created relative to its parent, so PATH_MAX does not bound it), symlinks anywhere, entries swapped
while we work. Every walk here is a loop over an explicit stack of directory descriptors (no
recursion, so no RecursionError at any depth), each level opened with ``O_NOFOLLOW | O_DIRECTORY``
relative to its parent and checked to be on the tree's filesystem (a mount inside is never
entered); every change is an ``*at()`` call on one name (``unlinkat``, ``fchownat`` with
``AT_SYMLINK_NOFOLLOW``), never a path and never through a link. ``os.walk``, ``os.fwalk`` and
``shutil.rmtree`` of this Python recurse, and a walk holding one descriptor per level would run out
of descriptors: both failures stopped retention for good.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Iterator

logger = logging.getLogger(__name__)

WINDOW_DIRS = 24
"""Deepest levels of a walk kept open."""
CHECKPOINT_EVERY = 24
"""Every this many levels one more stays open (at most MAX_CHECKPOINTS), so a level that was closed
is reopened from a near ancestor: a walk holds at most 1 + WINDOW_DIRS + MAX_CHECKPOINTS descriptors
whatever the depth, and reopening stays cheap."""
MAX_CHECKPOINTS = 24


class _Level:
    __slots__ = ("name", "ident", "fd", "pending", "failed")

    def __init__(self, name: str, ident: tuple[int, int], fd: int) -> None:
        self.name = name
        self.ident = ident
        self.fd = fd
        self.pending: list[str] | None = None
        """Names of this directory still to visit, last first; None until listed."""
        self.failed = False
        """Something below could not be removed (so this directory cannot be either)."""


def _open_subdir(parent_fd: int, name: str) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=parent_fd)


class _DirStack:
    """The directories from a walk's top to where it is; few of them open (see WINDOW_DIRS)."""

    def __init__(self, top_fd: int) -> None:
        info = os.fstat(top_fd)
        self.dev = info.st_dev
        self.levels = [_Level("", (info.st_dev, info.st_ino), top_fd)]
        self.checkpoints: list[int] = []
        """Indices of open checkpoint levels, shallowest first."""
        self.prefix = ""
        """Path of the deepest level relative to the top ('' or ending in '/')."""

    def close(self) -> None:
        for level in self.levels:
            self._close(level)
        self.levels.clear()

    @staticmethod
    def _close(level: _Level) -> None:
        if level.fd >= 0:
            os.close(level.fd)
            level.fd = -1

    def relative(self, name: str) -> str:
        return self.prefix + name

    def fd(self) -> int:
        """Descriptor of the deepest level, reopened by name from the nearest open ancestor if closed."""
        deepest = len(self.levels) - 1
        if self.levels[deepest].fd >= 0:
            return self.levels[deepest].fd
        start = next((i for i in reversed(self.checkpoints) if i < deepest), 0)
        for index in range(start + 1, deepest + 1):
            level, parent = self.levels[index], self.levels[index - 1]
            if level.fd >= 0:
                continue
            fd = _open_subdir(parent.fd, level.name)
            info = os.fstat(fd)
            level.fd = fd
            if (info.st_dev, info.st_ino) != level.ident:
                raise OSError(errno.ESTALE, "the directory was replaced while the tree was walked",
                              self.relative_of(index))
            if index % CHECKPOINT_EVERY == 0:
                self.checkpoints.append(index)
                self._trim_checkpoints()
            self._trim(index)
        return self.levels[deepest].fd

    def relative_of(self, index: int) -> str:
        return "/".join(level.name for level in self.levels[1:index + 1])

    def descend(self, name: str) -> None:
        fd = _open_subdir(self.fd(), name)
        info = os.fstat(fd)
        if info.st_dev != self.dev:
            os.close(fd)
            raise OSError(errno.EXDEV, "is a mount point (another filesystem); not entered", self.relative(name))
        self.levels.append(_Level(name, (info.st_dev, info.st_ino), fd))
        index = len(self.levels) - 1
        self.prefix += name + "/"
        if index % CHECKPOINT_EVERY == 0:
            self.checkpoints.append(index)
            self._trim_checkpoints()
        self._trim(index)

    def ascend(self) -> _Level:
        level = self.levels.pop()
        self._close(level)
        index = len(self.levels)
        if self.checkpoints and self.checkpoints[-1] == index:
            self.checkpoints.pop()
        if level.name:
            self.prefix = self.prefix[: -(len(level.name) + 1)]
        return level

    def _trim(self, deepest: int) -> None:
        """Close the level that just left the window (unless it is a checkpoint or the top)."""
        leaving = deepest - WINDOW_DIRS
        if leaving >= 1 and leaving not in self.checkpoints:
            self._close(self.levels[leaving])

    def _trim_checkpoints(self) -> None:
        while len(self.checkpoints) > MAX_CHECKPOINTS:
            index = self.checkpoints.pop(0)
            if index < len(self.levels) - WINDOW_DIRS:
                self._close(self.levels[index])

    def next_name(self, *, sort: bool) -> str | None:
        """The next name in the deepest level's listing, or None when it is exhausted."""
        level = self.levels[-1]
        if level.pending is None:
            names = os.listdir(self.fd())
            names.sort(reverse=True) if sort else names.reverse()
            level.pending = names
        return level.pending.pop() if level.pending else None


def _open_top(path: os.PathLike[str] | str) -> tuple[int, str, int] | None:
    """(parent fd, name, tree fd) of the directory at ``path`` (its parent is the caller's own path,
    trusted); None when nothing is there. A non-directory there raises NotADirectoryError."""
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    if not name:
        raise ValueError("refusing to walk the filesystem root")
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
        if info.st_dev != os.fstat(parent_fd).st_dev:
            raise OSError(errno.EXDEV, "is a mount point (another filesystem); not entered", path)
        return parent_fd, name, _open_subdir(parent_fd, name)
    except FileNotFoundError:
        os.close(parent_fd)
        return None
    except BaseException:
        os.close(parent_fd)
        raise


def walk_entries(top_fd: int, *, skip_top: frozenset[str] = frozenset()) -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, lstat) of every entry below ``top_fd`` (which this closes), names sorted,
    each directory before its contents; a directory that cannot be entered is listed, not entered."""
    walk = _DirStack(top_fd)
    try:
        while walk.levels:
            try:
                name = walk.next_name(sort=True)
            except OSError:  # gone or replaced meanwhile: nothing more to list here
                name = None
            if name is None:
                walk.ascend()
                continue
            try:
                info = os.stat(name, dir_fd=walk.fd(), follow_symlinks=False)
            except OSError:
                continue
            yield walk.relative(name), info
            if stat.S_ISDIR(info.st_mode) and not (len(walk.levels) == 1 and name in skip_top):
                with contextlib.suppress(OSError):
                    walk.descend(name)
    finally:
        walk.close()


def walk_tree(path: os.PathLike[str] | str) -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, lstat) of every entry below the directory ``path``; nothing when it is absent."""
    opened = _open_top(path)
    if opened is None:
        return
    parent_fd, _, top_fd = opened
    os.close(parent_fd)
    yield from walk_entries(top_fd)


def chown_tree(path: os.PathLike[str] | str, owner: tuple[int, int]) -> None:
    """Give ``path`` and everything below it to ``owner`` (uid, gid); links are changed, never followed."""
    opened = _open_top(path)
    if opened is None:
        raise FileNotFoundError(errno.ENOENT, "no such directory", os.fspath(path))
    parent_fd, name, top_fd = opened
    try:
        os.chown(name, *owner, dir_fd=parent_fd, follow_symlinks=False)
    finally:
        os.close(parent_fd)
    walk = _DirStack(top_fd)
    try:
        while walk.levels:
            entry = walk.next_name(sort=False)
            if entry is None:
                walk.ascend()
                continue
            fd = walk.fd()
            try:
                os.chown(entry, *owner, dir_fd=fd, follow_symlinks=False)
                is_dir = stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode)
            except FileNotFoundError:
                continue
            if is_dir:
                walk.descend(entry)
    finally:
        walk.close()


def _make_enterable(parent_fd: int, name: str) -> None:
    """Give the owner rwx on directory ``name`` (without following a link) so its contents can be
    removed: needed only without CAP_DAC_OVERRIDE, for directories a sandbox made unreadable."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent_fd)
    try:
        mode = os.fstat(fd).st_mode
        os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(mode) | stat.S_IRWXU)  # the inode itself, never a link
    finally:
        os.close(fd)


class _Removal:
    """State of one remove_tree: the first failure and how many entries were left behind."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.first: OSError | None = None
        self.left = 0

    def failed(self, walk: _DirStack, name: str, error: OSError) -> None:
        self.left += 1
        if self.first is None:
            where = walk.relative(name) if walk.levels else name
            where = where if len(where) <= 200 else f"{where[:100]}...{where[-100:]}"
            self.first = OSError(error.errno, f"{where}: {error.strerror}", self.path)
        for level in walk.levels:
            level.failed = True

    def enter(self, walk: _DirStack, name: str) -> None:
        try:
            walk.descend(name)
        except PermissionError:
            _make_enterable(walk.fd(), name)
            walk.descend(name)
        if os.geteuid() != 0:  # without CAP_DAC_OVERRIDE, removing entries needs write permission here
            fd = walk.fd()
            mode = os.fstat(fd).st_mode
            if mode & stat.S_IRWXU != stat.S_IRWXU:
                os.fchmod(fd, stat.S_IMODE(mode) | stat.S_IRWXU)


def remove_tree(path: os.PathLike[str] | str) -> None:
    """Delete ``path`` and everything below it, never following a link and never entering a mount.

    A link or file at ``path`` is unlinked; nothing there is not an error. Entries that cannot be
    removed are left (with their parents) while the rest goes, then OSError names the first of them.
    """
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.unlink(name, dir_fd=parent_fd)
            return
        except (FileNotFoundError, NotADirectoryError):
            return
        except IsADirectoryError:
            pass
        opened = _open_top(path)
        if opened is None:
            return
        os.close(opened[0])
        removal = _Removal(path)
        walk = _DirStack(opened[2])
        try:
            _remove_below(walk, removal)
        finally:
            walk.close()
        if removal.first is None:
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile by someone else
                os.rmdir(name, dir_fd=parent_fd)
            return
        raise OSError(removal.first.errno, f"{removal.left} entries under {path} could not be removed; first: "
                                           f"{removal.first.strerror}")
    finally:
        os.close(parent_fd)


def _remove_below(walk: _DirStack, removal: _Removal) -> None:
    """Empty the walk's top directory (post-order: each directory is removed once it is empty)."""
    while walk.levels:
        try:
            name = walk.next_name(sort=False)
        except OSError as error:
            walk.levels[-1].pending = []
            removal.failed(walk, "", error)
            continue
        if name is None:
            if len(walk.levels) == 1:
                return
            level = walk.ascend()
            if not level.failed:
                try:
                    os.rmdir(level.name, dir_fd=walk.fd())
                except FileNotFoundError:
                    pass
                except OSError as error:
                    removal.failed(walk, level.name, error)
            continue
        try:
            os.unlink(name, dir_fd=walk.fd())
            continue
        except FileNotFoundError:
            continue
        except IsADirectoryError:
            pass
        except OSError as error:
            removal.failed(walk, name, error)
            continue
        try:
            removal.enter(walk, name)
        except FileNotFoundError:
            continue
        except OSError as error:
            removal.failed(walk, name, error)


def discard_tree(path: os.PathLike[str] | str, *, what: str) -> bool:
    """remove_tree for clean-up paths (after a failure, on teardown): a failure is logged, not raised,
    so it never hides the error being handled; True when nothing is left."""
    try:
        remove_tree(path)
    except OSError as error:
        logger.warning("could not remove %s %s: %s", what, path, error)
        return False
    return True
