"""Init process of one local sandbox: builds its namespaces and root filesystem, then reaps.

``sandboxes.local_backend`` runs it once as a factory (``python -I -S _holder.py``): each JSON config
line on stdin forks a sandbox (saving an interpreter start-up per sandbox) and is answered with
``OK <pid-1 host pid>`` or ``E<message>``. The config travels on stdin, not argv, which sandboxes
could read. It imports only the standard library (it runs before and after
``pivot_root``), and each forked sandbox reports to the factory over a pipe:

* ``U``: the user namespace exists; the factory writes ``uid_map``/``gid_map`` and answers ``M``.
* ``P<pid>``: host pid of the sandbox's pid-1 (the child forks into the new pid namespace).
* ``R``: root filesystem is ready; ``E<message>``: setup failed (the process then exits).

After ``R`` pid 1 keeps the namespaces alive, reaps orphaned children and exits at the lifetime
deadline, which makes the kernel kill every process left in the sandbox. It exits earlier when the
backend process dies: the factory's only argument is the read end of a "lifeline" pipe whose write
end only the backend process holds, inherited by every sandbox's pid 1, which reads EOF from it as
soon as the backend is gone (however it died). The factory itself exits on EOF on stdin.
"""

import contextlib
import ctypes
import fcntl
import json
import os
import select
import signal
import socket
import struct
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2

AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
SYS_MOUNT_SETATTR = 442
SYS_PIVOT_ROOT = 155
PR_SET_DUMPABLE = 4
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
IFF_LOOPBACK = 0x8
IFF_RUNNING = 0x40

libc = ctypes.CDLL(None, use_errno=True)
LIFELINE_FD = -1


class MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None):
    check(
        libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {fstype or 'bind'} {source} on {target}",
    )


def make_readonly(target):
    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
    check(
        libc.syscall(
            SYS_MOUNT_SETATTR, -100, target.encode(), AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)
        ),
        f"mount_setattr read-only {target}",
    )


def bind(source, target, *, readonly):
    mount(source, target, None, MS_BIND | MS_REC)
    if readonly:
        make_readonly(target)


def send(line):
    os.write(1, (line + "\n").encode())


def read_line():
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(0, 1)
        if not chunk:
            raise RuntimeError("backend closed the control pipe during setup")
        data += chunk
    return data.decode().strip()


def mirror_path(newroot, host_path, *, readonly):
    """Expose host_path at the same place in the new root: symlink for symlinks, else a bind."""
    inside = newroot + host_path
    if os.path.islink(host_path):
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        os.symlink(os.readlink(host_path), inside)
        return
    if not os.path.exists(host_path):
        return
    if os.path.isdir(host_path):
        os.makedirs(inside, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        open(inside, "a").close()
    bind(host_path, inside, readonly=readonly)


def mask(newroot, path):
    inside = newroot + path
    if os.path.islink(inside) or not os.path.exists(inside):
        return
    if os.path.isdir(inside):
        mount("tmpfs", inside, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
    else:
        mount("/dev/null", inside, None, MS_BIND)


def build_root(cfg):
    base = cfg["sandbox_dir"]
    newroot = base + "/root"
    disk = base + "/disk"
    agent_uid, agent_gid = cfg["agent_uid"], cfg["agent_gid"]

    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", newroot, "tmpfs", MS_NOSUID | MS_NODEV, "size=8m,mode=0755")
    # The quota tmpfs holds the overlay upper dir and /tmp, so together they cannot exceed disk_mb.
    mount("tmpfs", disk, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_mb']}m,mode=0755")
    for name in ("upper", "work", "tmp"):
        os.mkdir(f"{disk}/{name}")
    os.chmod(f"{disk}/tmp", 0o1777)

    for path in cfg["readonly_paths"]:
        mirror_path(newroot, path, readonly=True)
    for path in cfg["masked_paths"]:
        mask(newroot, path)
    if cfg["resolv_conf"] and os.path.isfile(f"{newroot}/etc/resolv.conf"):
        mount(cfg["resolv_conf"], f"{newroot}/etc/resolv.conf", None, MS_BIND)

    for name in ("workspace", "tmp", "proc", "dev"):
        os.makedirs(f"{newroot}/{name}", exist_ok=True)
    if cfg["workspace_bind"]:
        # Setup commands write into the snapshot tree itself: it is the upper layer of an overlay over an
        # empty lower one (not a bind, whose source path /proc/self/mountinfo would show), mounted with
        # paths relative to the sandbox directory like the workspace overlay below.
        os.mkdir(f"{disk}/empty")
        os.chdir(base)
        upper = os.path.relpath(cfg["workspace_bind"], base)
        work = os.path.relpath(cfg["workspace_workdir"], base)
        mount("overlay", f"{newroot}/workspace", "overlay", MS_NOSUID | MS_NODEV,
              f"lowerdir=disk/empty,upperdir={upper},workdir={work}")
    else:
        os.chown(f"{disk}/upper", agent_uid, agent_gid)
        # Relative layer paths (resolved from the sandbox directory): the overlay's options appear in
        # the sandbox's /proc/self/mountinfo, and must not tell it where the host keeps snapshots.
        os.chdir(base)
        lower = os.path.relpath(cfg["lower"], base)
        mount(
            "overlay",
            f"{newroot}/workspace",
            "overlay",
            MS_NOSUID | MS_NODEV,
            f"lowerdir={lower},upperdir=disk/upper,workdir=disk/work",
        )
    bind(f"{disk}/tmp", f"{newroot}/tmp", readonly=False)

    mount("tmpfs", f"{newroot}/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for dev in ("null", "zero", "full", "random", "urandom"):
        open(f"{newroot}/dev/{dev}", "a").close()
        mount(f"/dev/{dev}", f"{newroot}/dev/{dev}", None, MS_BIND)
    for link, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{newroot}/dev/{link}")
    os.mkdir(f"{newroot}/dev/shm")
    bind(f"{disk}/tmp", f"{newroot}/dev/shm", readonly=False)

    # proc must be mounted while the host's proc is still visible, or the kernel refuses it in a userns.
    mount("proc", f"{newroot}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(f"{newroot}/.oldroot")
    check(libc.syscall(SYS_PIVOT_ROOT, newroot.encode(), f"{newroot}/.oldroot".encode()), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/.oldroot", MNT_DETACH), "umount old root")
    os.rmdir("/.oldroot")
    # nsenter --wd (no argument) starts commands in the init process's working directory.
    os.chdir("/workspace")


def blank_command_line(title=b"sandbox-init"):
    """Overwrite this process's argv in place with ``title``.

    ``/proc/<pid>/cmdline`` is readable by every process of the sandbox whatever the dumpable flag,
    and the inherited argv names the host's interpreter and this script's path in the checkout.
    The kernel reads it from the process's own memory between arg_start and arg_end (fields 48 and
    49 of /proc/self/stat), so zeroing that range leaves only the title (what setproctitle does).
    """
    with open("/proc/self/stat", "rb") as handle:
        after_name = handle.read().rsplit(b")", 1)[1].split()
    start, end = int(after_name[45]), int(after_name[46])  # after_name[0] is field 3
    if end <= start:
        return
    text = title[: end - start - 1]
    ctypes.memset(start, 0, end - start)
    ctypes.memmove(start, text, len(text))


def loopback_up():
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", IFF_UP | IFF_LOOPBACK | IFF_RUNNING))
    finally:
        sock.close()


def backend_gone():
    """EOF on the lifeline: the backend process that asked for this sandbox has exited."""
    if LIFELINE_FD < 0:
        return False
    readable, _, _ = select.select([LIFELINE_FD], [], [], 0)
    return bool(readable)


def reap_until(deadline):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT})
    while True:
        remaining = deadline - time.time()
        if remaining <= 0:
            return
        info = signal.sigtimedwait({signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}, min(remaining, 1.0))
        if info is not None and info.si_signo != signal.SIGCHLD:
            return
        if backend_gone():
            return
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


def start_sandbox(cfg):
    """Child of the factory: build the namespaces, fork pid 1 and serve until the deadline."""
    os.setsid()
    if cfg["user_namespace"]:
        check(libc.unshare(CLONE_NEWUSER), "unshare user namespace")
        send("U")
        if read_line() != "M":
            raise RuntimeError("factory did not confirm the uid/gid maps")
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        if cfg["setgroups_allowed"]:
            os.setgroups([])
    # Always a private network namespace; with network on, the backend attaches slirp4netns to it.
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET
    check(libc.unshare(flags), "unshare namespaces")
    child = os.fork()
    if child:
        send(f"P{child}")
        os._exit(0)
    try:
        blank_command_line()
        # Rootless, the owner reaches /proc/<pid>/root only while this process is dumpable; the agent
        # still cannot, because it lacks this process's capabilities (commoncap ptrace check).
        if cfg["setgroups_allowed"]:
            libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        socket.sethostname("sandbox")
        build_root(cfg)
        # Nested user namespaces would hand the agent a fresh set of capabilities to probe the kernel with.
        with open("/proc/sys/user/max_user_namespaces", "w") as handle:
            handle.write("0")
        loopback_up()
    except Exception as exc:  # noqa: BLE001 - reported to the backend, which raises a SandboxError
        send("E" + str(exc).replace("\n", " "))
        os._exit(1)
    send("R")
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    reap_until(cfg["deadline"])
    os._exit(0)


def write_id_maps(pid, cfg):
    if not cfg["setgroups_allowed"]:
        with open(f"/proc/{pid}/setgroups", "w") as handle:
            handle.write("deny")
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as handle:
            handle.write(cfg[name])


def fold_status(lines, on_user_namespace):
    """The backend's answer from one sandbox's status lines (read until every writer closed the pipe).

    ``P`` and ``R`` come from two processes (the forking child and the new pid 1) on one pipe, so
    under load ``R`` can arrive first: the answer waits for both. The first error wins.
    """
    error = None
    pid1 = None
    ready = False
    for line in lines:
        if line == "U":
            failure = on_user_namespace()
            error = error or failure
        elif line.startswith("P"):
            pid1 = int(line[1:])
        elif line == "R":
            ready = True
        elif line.startswith("E"):
            error = error or line
    if error is not None:
        return error
    if ready and pid1 is not None:
        return f"OK {pid1}"
    return "Esandbox init exited during setup"


def serve_one(cfg):
    """Fork one sandbox and return the answer line for the backend: ``OK <pid>`` or ``E<message>``."""
    status_r, status_w = os.pipe()
    control_r, control_w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(status_r)
            os.close(control_w)
            os.dup2(control_r, 0)
            os.dup2(status_w, 1)
            os.close(control_r)
            os.close(status_w)
            start_sandbox(cfg)
        except Exception as exc:  # noqa: BLE001 - any setup failure must reach the backend as a message
            with contextlib.suppress(OSError):
                send("E" + str(exc).replace("\n", " "))
        os._exit(1)
    os.close(status_w)
    os.close(control_r)

    def write_maps():
        try:
            write_id_maps(child, cfg)
        except OSError as exc:
            os.write(control_w, b"X\n")
            return f"Ewriting uid/gid maps failed: {exc}"
        os.write(control_w, b"M\n")
        return None

    with os.fdopen(status_r, "rb") as status:
        answer = fold_status((raw.decode().strip() for raw in status), on_user_namespace=write_maps)
    os.close(control_w)
    os.waitpid(child, 0)
    return answer


def factory():
    """Pre-initialised interpreter that forks sandboxes on request, saving an interpreter start each."""
    requests = os.fdopen(0, "rb", buffering=1 << 16, closefd=False)
    while True:
        line = requests.readline()
        if not line.endswith(b"\n"):
            os._exit(0)
        try:
            answer = serve_one(json.loads(line))
        except Exception as exc:  # noqa: BLE001 - the factory must keep serving after a bad request
            answer = "E" + str(exc)
        send(answer.replace("\n", " "))


if __name__ == "__main__":
    import sys

    LIFELINE_FD = int(sys.argv[1]) if len(sys.argv) > 1 else -1
    factory()
