"""Unprivileged archive extraction for a root worker: one pre-started fork server per worker process.

Running as root, the worker never parses an archive itself. It hands the archive and the destination
directory, as open file descriptors, to an extraction server that already runs as the sandbox's
unprivileged uid (no groups, empty capability sets and bounding set, ``no_new_privs``, rlimits on
address space, CPU time and core files, not dumpable). The server forks one child per archive; the
child extracts from the fds it received and answers on a reply socket that came with them.

Why this shape, in a threaded Celery/ASGI worker:

* Not ``fork()`` of the worker itself. A fork copies locks other threads hold (logging handlers,
  library at-fork handlers such as the local backend's, which deadlocked in the test suite when it
  was tried), and the child would inherit the worker's open database/Redis connections, its secrets in
  memory and a multi-GiB address space that ``RLIMIT_AS`` could not bound. A compromised extractor
  would hold all of that.
* Not a fresh interpreter per archive: correct, but one interpreter start per snapshot doubles
  extraction time (docs/notebook/sandboxes.md).
* The server is started once with ``subprocess`` (``fork_exec``: no Python at-fork handlers run in
  the worker), already unprivileged (``setpriv``) or dropping privileges itself before it reads its
  socket when no interpreter can import this package as that uid. It is single-threaded, so its own
  ``fork()`` per archive is safe and costs about a millisecond. The per-archive child closes the
  server's socket before reading a byte, so a hostile archive that subverts its child gets neither
  later requests nor other archives' descriptors; non-dumpable processes of the same uid cannot
  ptrace each other or open each other's ``/proc/<pid>/fd``.
* No ``PR_SET_PDEATHSIG``: it fires when the *thread* that started the server exits. The server
  exits instead when its socket reports EOF, i.e. when every copy of the worker's end is closed.

Requests are independent (a new reply socket each), so threads extract concurrently; a server that
died is restarted on the next request; a forked worker (prefork pool) starts its own server.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

from sandboxes.base import ArchiveRejected

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
CHILD_MEMORY_BYTES = 1024 * 1024 * 1024
"""Address-space limit of the extraction server and of each per-archive child."""
CHILD_CPU_SECONDS = 300
"""CPU-time limit of each per-archive child (RLIMIT_CPU counts per process, so each starts at zero)."""
CHILD_WALL_SECONDS = 600
"""Wall-clock limit of one extraction: the child's alarm() and the worker's wait for the answer."""
_HEADER_BYTES = 64 * 1024
_REPLY_BYTES = 8 * 1024


# --- Privilege drop ------------------------------------------------------------------------------

def unprivileged_prefix(run_as: tuple[int, int], *, memory_bytes: int, cpu_seconds: int) -> list[str]:
    """argv prefix that runs a command as ``run_as`` with no capabilities, no new privileges and rlimits."""
    uid, gid = run_as
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--no-new-privs",
            "--inh-caps=-all", "--bounding-set=-all",
            "prlimit", f"--as={memory_bytes}", f"--cpu={cpu_seconds}", "--core=0", "--"]


def _reachable_by_anyone(path: str) -> bool:
    """Whether a user with no privileges can reach (o+x on every directory) and read/execute ``path``."""
    real = os.path.realpath(path)
    if any(not os.stat(parent).st_mode & stat.S_IXOTH for parent in Path(real).parents):
        return False
    return bool(os.stat(real).st_mode & (stat.S_IROTH | stat.S_IXOTH))


def child_python() -> str | None:
    """An interpreter an unprivileged uid can run with this package importable, or None."""
    if not _reachable_by_anyone(_REPO_ROOT):
        return None
    for candidate in (sys.executable, "/usr/bin/python3"):
        if os.path.exists(candidate) and _reachable_by_anyone(candidate):
            return candidate
    return None


def privileges_drop(uid: int, gid: int) -> None:
    """In a server started as root: what ``unprivileged_prefix`` does, from inside.

    Modules that extraction imports lazily are imported first (the interpreter's own files may be out
    of ``uid``'s reach); then rlimits, an empty capability bounding set, the ids, and no new privileges.
    Changing every uid away from 0 clears the permitted and effective capabilities."""
    import ctypes
    import importlib
    import resource

    for module in ("gzip", "bz2", "lzma", "encodings.cp437", "encodings.utf_8", "encodings.latin_1"):
        with contextlib.suppress(ImportError):  # an interpreter without it cannot open such archives anyway
            importlib.import_module(module)
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (CHILD_CPU_SECONDS, CHILD_CPU_SECONDS))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop, pr_set_no_new_privs = 24, 38
    for capability in range(64):
        if libc.prctl(pr_capbset_drop, capability, 0, 0, 0) != 0:
            break  # EINVAL: past the last capability this kernel knows
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0 or 0 in os.getresuid():
        raise SystemExit("could not drop privileges")


# --- Worker side -----------------------------------------------------------------------------------

class ExtractionServer:
    """Handle on one running server (worker side)."""

    def __init__(self, run_as: tuple[int, int]) -> None:
        self.run_as = run_as
        self.owner_pid = os.getpid()
        python = child_python()
        if python is not None:  # setpriv drops privileges before the interpreter starts
            prefix = unprivileged_prefix(run_as, memory_bytes=CHILD_MEMORY_BYTES, cpu_seconds=CHILD_CPU_SECONDS)
            drop = "-"
        else:
            # The checkout (or every interpreter) is out of the uid's reach, e.g. a clone in /root:
            # start as root, import what extraction needs, then drop before reading the socket.
            prefix, python, drop = [], sys.executable, f"{run_as[0]}:{run_as[1]}"
        self.mode = "setpriv" if drop == "-" else "self-drop"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        code = (f"import sys; sys.path.insert(0, {_REPO_ROOT!r}); "
                "from sandboxes.extract_server import serve; raise SystemExit(serve())")
        try:
            self.process = subprocess.Popen(
                [*prefix, python, "-I", "-c", code, str(theirs.fileno()), drop], pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                cwd="/")
        finally:
            theirs.close()
        self.sock = ours
        self.send_lock = threading.Lock()

    def alive(self) -> bool:
        return self.owner_pid == os.getpid() and self.process.poll() is None

    def close(self) -> None:
        """Close the worker's end: the server sees EOF and exits; children in flight finish."""
        self.sock.close()
        if self.owner_pid == os.getpid():
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)

    def extract(self, archive_fd: int, dest_fd: int, header: dict) -> dict:
        """Send one request; returns the child's answer, or raises ArchiveRejected/ConnectionError."""
        reply, remote = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with reply:
            try:
                with self.send_lock:
                    socket.send_fds(self.sock, [json.dumps(header).encode()], [archive_fd, dest_fd, remote.fileno()])
            finally:
                remote.close()
            reply.settimeout(CHILD_WALL_SECONDS + 30)
            chunks = []
            try:
                while chunk := reply.recv(_REPLY_BYTES):
                    chunks.append(chunk)
            except TimeoutError:
                raise ArchiveRejected(f"{header['label']} took more than {CHILD_WALL_SECONDS} s to extract") from None
        if not chunks:
            raise ArchiveRejected(f"{header['label']} could not be extracted (the extractor died: out of memory or "
                                  "CPU time)")
        return json.loads(b"".join(chunks)[:_REPLY_BYTES * 4])


_servers: dict[tuple[tuple[int, int], str | None], ExtractionServer] = {}
_servers_lock = threading.Lock()


def server_for(run_as: tuple[int, int]) -> ExtractionServer:
    """This process's running server for ``run_as`` (started if missing, dead or inherited by a fork)."""
    key = (run_as, child_python())
    with _servers_lock:
        server = _servers.get(key)
        if server is not None and server.owner_pid != os.getpid():
            server.sock.close()  # a fork's copy: let the parent's server see EOF when the parent exits
            server = None
        if server is not None and not server.alive():
            server.sock.close()
            server = None
        if server is None:
            server = _servers[key] = ExtractionServer(run_as)
        return server


def prestart(run_as: tuple[int, int]) -> None:
    """Start the server now (a backend does, when it starts as root), so the first snapshot does not wait."""
    if os.geteuid() == 0:
        server_for(run_as)


def extract_unprivileged(archive_fd: int, dest_fd: int, *, limits, run_as: tuple[int, int], label: str) -> None:
    """Extract the archive open at ``archive_fd`` into ``dest_fd`` as ``run_as``; raises ArchiveRejected."""
    header = {"limits": asdict(limits), "label": label}
    for attempt in (1, 2):
        server = server_for(run_as)
        try:
            answer = server.extract(archive_fd, dest_fd, header)
            break
        except OSError:
            if attempt == 2:
                raise
            server.process.poll()  # died between requests (killed, out of memory): the next call starts one
    if "rejected" in answer:
        raise ArchiveRejected(str(answer["rejected"])[:2000])


# --- Server side ---------------------------------------------------------------------------------------

def serve() -> int:
    """Main loop of the server process: argv = [socket fd, '-' or 'uid:gid' to drop to]."""
    import ctypes
    import importlib

    sock_fd, drop = int(sys.argv[1]), sys.argv[2]
    # Imported once here, before any privilege drop (the interpreter's own files may be out of the
    # uid's reach) and not again in every child: tarfile opens compressed archives lazily.
    for module in ("sandboxes.archives", "gzip", "bz2", "lzma", "encodings.cp437"):
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    if drop != "-":
        uid, gid = (int(part) for part in drop.split(":"))
        privileges_drop(uid, gid)
    if os.geteuid() == 0 or 0 in os.getresuid():
        return 2  # never serve as root
    pr_set_dumpable = 4
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 0, 0, 0, 0)  # inherited by every child
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    import gc

    gc.freeze()  # a child's collections skip the server's objects instead of copying every page they sit on
    sock = socket.socket(fileno=sock_fd)
    while True:
        try:
            message, fds, _flags, _address = socket.recv_fds(sock, _HEADER_BYTES, 3)
        except InterruptedError:
            continue
        if not message:
            return 0  # EOF: the worker is gone
        try:
            if len(fds) == 3 and _fork() == 0:
                status = 1
                try:
                    sock.close()  # later requests and their descriptors stay out of this child's reach
                    status = _serve_one(message, *fds)
                finally:
                    os._exit(status)
        finally:
            for fd in fds:
                os.close(fd)


def _fork() -> int:
    try:
        return os.fork()
    except OSError:
        return -1  # no child: closing the reply socket tells the worker the extraction failed


def _serve_one(message: bytes, archive_fd: int, dest_fd: int, reply_fd: int) -> int:
    """In the per-archive child: extract, write a JSON answer to reply_fd, return the exit status."""
    from sandboxes.archives import ArchiveLimits, _extract_stream

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.alarm(CHILD_WALL_SECONDS)
    label = "archive"
    try:
        header = json.loads(message)
        label = str(header["label"])[:200]
        with os.fdopen(archive_fd, "rb", closefd=False) as stream:
            _extract_stream(stream, dest_fd, ArchiveLimits(**header["limits"]), label)
        answer: dict[str, object] = {"ok": True}
    except ArchiveRejected as exc:
        answer = {"rejected": str(exc)[:2000]}
    except MemoryError:
        answer = {"rejected": f"{label} needs more than {CHILD_MEMORY_BYTES >> 20} MiB to extract"}
    except Exception as exc:  # noqa: BLE001 - any other failure is reported, never a traceback to the user
        answer = {"rejected": f"{label} could not be extracted ({type(exc).__name__})"}
    data = json.dumps(answer).encode()
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(reply_fd, data):]
    return 0
