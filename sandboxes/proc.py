"""Process lifetime helpers: die with the parent, find and stop what one `make run` started.

Standard library only and no Django, so that ``scripts/run.py`` (before Django is configured) and
the sandbox backend can both import it.

Every process `make run` starts (directly or through any depth of children that keep the
environment) carries ``RUN_OWNER_ENV=<absolute state directory>`` in its environment. That names
the run precisely: a crashed run's leftovers are found by reading ``/proc/<pid>/environ`` of this
user's processes, never by matching names, so another checkout's run (another state directory) or
an unrelated process of the same name is never touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

RUN_OWNER_ENV = "FLOWSTATE_RUN_OWNER"
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)


def set_parent_death_signal(sig: int = signal.SIGKILL, *, expected_parent: int | None = None) -> None:
    """Have the kernel send ``sig`` to this process when its parent (thread) dies; survives exec.

    With ``expected_parent``, a parent that already died before the call (this process was then
    reparented) delivers ``sig`` at once instead of never.
    """
    if _libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen`` in a single-threaded parent (preexec_fn is not
    safe in a threaded one: let the child call ``set_parent_death_signal`` itself there)."""
    parent = os.getpid()
    return lambda: set_parent_death_signal(sig, expected_parent=parent)


def become_subreaper() -> None:
    """Orphaned descendants are reparented to this process instead of init, so it can stop them."""
    if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    pgid: int
    state: str
    start_time: int


def proc_info(pid: int) -> ProcInfo | None:
    """``/proc/<pid>/stat`` fields we need, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return ProcInfo(pid=pid, state=fields[0].decode(), ppid=int(fields[1]), pgid=int(fields[2]),
                    start_time=int(fields[19]))


def alive(pid: int, start_time: int | None = None) -> bool:
    """Running (not a zombie) and, given ``start_time``, still the same process (no pid reuse).

    The one liveness check of the code base: sandbox holders, container owners, exec'd commands and
    experiment drivers are all tested with it."""
    info = proc_info(pid)
    return (info is not None and info.state not in ("Z", "X")
            and (start_time is None or info.start_time == start_time))


def start_time(pid: int) -> int | None:
    """Kernel start time of a live process (clock ticks after boot; None if gone or a zombie): with
    the pid, it names one process across pid reuse (pass it to ``alive``)."""
    info = proc_info(pid)
    return info.start_time if info is not None and info.state not in ("Z", "X") else None


def environ_value(pid: int, name: str) -> str | None:
    """The value of ``name`` in the environment ``pid`` was started with (None if unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for entry in data.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix):].decode(errors="replace")
    return None


def own_pids() -> list[int]:
    """Pids of this user's processes (the only ones whose environment we can read or signal)."""
    uid = os.getuid()
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def ancestors(pid: int) -> set[int]:
    found = set()
    while pid > 1 and pid not in found:
        found.add(pid)
        info = proc_info(pid)
        if info is None:
            break
        pid = info.ppid
    return found


def run_processes(owner: str | None, *, pgids: Iterable[int] = (), spare_pgids: Iterable[int] = ()) -> list[int]:
    """Live processes of the run ``owner`` names (its environment marker) or in one of ``pgids``,
    except those in ``spare_pgids``; never this process or its ancestors (a shell that exported
    the marker)."""
    groups = set(pgids)
    spared_groups = set(spare_pgids)
    spared = ancestors(os.getpid())
    found = []
    for pid in own_pids():
        if pid in spared:
            continue
        info = proc_info(pid)
        if info is None or info.state in ("Z", "X") or info.pgid in spared_groups:
            continue
        if info.pgid in groups or (owner is not None and environ_value(pid, RUN_OWNER_ENV) == owner):
            found.append(pid)
    return found


def signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def reap_zombie_children(skip: Iterable[int] = ()) -> None:
    """Reap exited children that no ``Popen`` owns (orphans handed to a subreaper)."""
    skipped = set(skip)
    me = os.getpid()
    for pid in own_pids():
        if pid in skipped:
            continue
        info = proc_info(pid)
        if info is not None and info.ppid == me and info.state == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def stop_run_processes(owner: str | None, *, pgids: Iterable[int] = (), spare_pgids: Iterable[int] = (),
                       grace_s: float = 2.0, interrupted: Callable[[], bool] = lambda: False) -> int:
    """SIGTERM every process of the run, SIGKILL what is left after ``grace_s`` (or as soon as
    ``interrupted()``); returns how many there were. Keeps searching, so children forked while
    stopping are caught too. Zombies count as gone; reaping them is their parent's business."""
    groups, spared = list(pgids), list(spare_pgids)
    pids = run_processes(owner, pgids=groups, spare_pgids=spared)
    total = set(pids)
    signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline and not interrupted():
        time.sleep(0.1)
        pids = run_processes(owner, pgids=groups, spare_pgids=spared)
        total.update(pids)
    for _ in range(50):
        if not pids:
            break
        signal_all(pids, signal.SIGKILL)
        time.sleep(0.1)
        pids = run_processes(owner, pgids=groups, spare_pgids=spared)
        total.update(pids)
    return len(total)
