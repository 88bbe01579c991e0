"""Local sandbox backend: Linux namespaces, rlimits and overlayfs, no daemon needed.

Each sandbox is one init process (``sandboxes/_holder.py``) living in fresh user, mount, pid, net,
ipc and uts namespaces. Its root is a tmpfs holding read-only binds of the host's ``/usr`` and
``/etc`` (secrets masked), a private ``/dev``, ``/proc`` of its own pid namespace, and the workspace:
an overlay whose lower layer is the snapshot directory and whose upper layer lives on a tmpfs of
``disk_mb`` (shared with ``/tmp``), which is the disk quota. Commands enter those namespaces with
``nsenter``, get rlimits from ``prlimit`` and drop to the unprivileged sandbox user with ``setpriv``
(no capabilities, ``no_new_privs``). The host reaches the workspace through
``/proc/<init>/root/workspace`` with ``openat2(RESOLVE_BENEATH)`` (see ``sandboxes.safe_fs``).

Run as root, the user namespace maps sandbox uids 0..65535 onto an unprivileged host range
(``uid_base``), and commands run as uid 1000. Run rootless, only the caller's uid can be mapped, so
commands run as namespace-root with every capability dropped and ``no_new_privs`` set.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import secrets
import select
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, cast

from sandboxes import extract_server, netguard, paths, proc, safe_tree
from sandboxes.archives import ArchiveLimits
from sandboxes.backend_core import (
    COMMAND_ENV,
    SANDBOX_PATH,
    CappedOutput,
    CoreBackend,
    CoreSandbox,
    setup_result_check,
)
from sandboxes.base import WORKSPACE_DIR, BackendUnavailable, ExecResult, SandboxError, SandboxLimits
from sandboxes.cgroups import SandboxCgroup
from sandboxes.local_holder import HolderProcess as _Holder
from sandboxes.settings import current as current_settings

if TYPE_CHECKING:
    from sandboxes.base import Snapshot

HOLDER_SCRIPT = Path(__file__).with_name("_holder.py")
AGENT_UID_INSIDE = 1000
SLIRP_DNS = "10.0.2.3"
"""The DNS forwarder slirp4netns provides inside a networked sandbox."""
logger = logging.getLogger(__name__)


def default_sandbox_root() -> Path:
    """The configured sandbox state directory (``sandboxes.settings``)."""
    return current_settings().root


@dataclass(frozen=True)
class LocalBackendConfig:
    """Settings of the local namespace backend."""

    root: Path | None = None
    """State directory (snapshots, sandbox mount points, registry); default: the configured
    ``SANDBOX_ROOT`` (``sandboxes.settings``)."""
    uid_base: int = 100_000
    """Running as root: host uid/gid that sandbox uid 0 maps to; sandbox uids 0..65535 map above it."""
    readonly_paths: tuple[str, ...] = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/lib32")
    """Host paths exposed read-only at the same place in every sandbox (symlinks are recreated)."""
    extra_readonly_paths: tuple[str, ...] = ()
    """More host paths to expose read-only, e.g. a Python prefix with test tools installed."""
    masked_paths: tuple[str, ...] = (
        "/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/ssh", "/etc/sudoers",
        "/etc/sudoers.d", "/etc/ssl/private", "/etc/docker", "/etc/postgresql", "/etc/redis",
        "/etc/machine-id",
    )
    """Paths inside the read-only binds hidden behind empty files/directories (host secrets)."""
    warm_pool_size: int = 0
    """Pre-started sandboxes kept per (snapshot, limits) once that pair has been used or prewarmed."""
    warm_max_idle_s: float = 300.0
    """A warm sandbox unclaimed this long is replaced, bounding how long its holder outlives lifetime_s."""
    setup_limits: SandboxLimits = field(
        default_factory=lambda: SandboxLimits(command_timeout_s=600.0, lifetime_s=1800.0, disk_mb=4096)
    )
    """Limits of the sandbox that runs a snapshot's setup commands."""
    archive_limits: ArchiveLimits = field(default_factory=ArchiveLimits)
    """Bounds on archives accepted as snapshot sources."""
    max_output_bytes: int = 16 * 1024 * 1024
    """Per-stream cap on command output kept in memory; the rest is dropped with a note."""
    start_timeout_s: float = 20.0
    """How long a sandbox's init process may take to build its namespaces before start fails."""
    use_cgroups: bool = True
    """Also cap each whole sandbox with v1 memory (memory_mb + disk_mb) and pids cgroups when the host
    allows it (root with cgroup v1 memory/pids); rlimits apply either way."""
    network_unguarded: bool = False
    """Let network=True sandboxes run without their egress firewall when it cannot be installed (no
    nft on the host): their commands then reach every address the host reaches (the host's own
    services on non-loopback addresses, the LAN, cloud metadata). Off: such sandboxes are refused."""

    def __post_init__(self) -> None:
        if not 1 <= self.uid_base <= 2**32 - 65536 - 1:
            raise ValueError(f"LocalBackendConfig.uid_base={self.uid_base} must leave room for 65536 uids")
        if self.warm_pool_size < 0 or self.warm_pool_size > 64:
            raise ValueError("LocalBackendConfig.warm_pool_size must be between 0 and 64")
        if self.warm_max_idle_s <= 0:
            raise ValueError("LocalBackendConfig.warm_max_idle_s must be positive")
        for path in (*self.readonly_paths, *self.extra_readonly_paths, *self.masked_paths):
            if not path.startswith("/") or ".." in path.split("/"):
                raise ValueError(f"LocalBackendConfig path {path!r} must be absolute without '..'")
            if path in ("/", "/proc", "/dev", "/tmp", WORKSPACE_DIR):
                raise ValueError(f"LocalBackendConfig path {path!r} would shadow a sandbox mount; remove it")


class LocalSandbox(CoreSandbox):
    """A sandbox run by ``LocalBackend``."""

    _backend: LocalBackend

    def __init__(self, *, backend: LocalBackend, sandbox_id: str, snapshot: Snapshot, limits: SandboxLimits,
                 holder: _Holder, workspace_bind: str | None) -> None:
        super().__init__(backend=backend, sandbox_id=sandbox_id, snapshot=snapshot, limits=limits)
        self._holder: _Holder | None = holder
        self._workspace_bind = workspace_bind

    @property
    def holder_pid(self) -> int | None:
        return self._holder.pid if self._holder else None

    @property
    def cgroup(self) -> SandboxCgroup | None:
        """The whole-sandbox memory/pids cgroup, when the host supports one."""
        return self._holder.cgroup if self._holder else None

    def _handle(self) -> _Holder | None:
        return self._holder

    def _check_running(self, handle: _Holder) -> None:
        if not handle.alive():
            self._gone("is no longer running (its init process exited)")

    def _workspace_fd_of(self, handle: _Holder) -> int:
        return handle.workspace_fd

    def _warm_usable(self) -> bool:
        return self._holder is not None and self._holder.alive()

    def _restart_clock(self) -> None:
        super()._restart_clock()
        self._backend._registry_write(self)

    def _run(self, handle: _Holder, command: str, timeout_s: float) -> ExecResult:
        argv = self._backend._command_argv(handle, self.limits, command)
        result = self._backend._run_bounded(argv, timeout_s)
        if not handle.alive():
            # The sandbox ended under the command (lifetime, destroy, host kill): not the command's doing.
            self._gone("ended while a command was running")
        return result

    # Lifecycle ----------------------------------------------------------------------------------

    def reset(self) -> None:
        with self._lock:
            self._live()
            old = self._holder
            self._holder = self._backend._start_holder(
                sandbox_id=self.id, snapshot=self.snapshot, limits=self.limits,
                workspace_bind=self._workspace_bind,
            )
            if old is not None:
                old.kill()
            self._restart_clock()

    def destroy(self) -> None:
        with self._lock:
            holder, self._holder = self._holder, None
        if holder is not None:
            holder.kill()
            self._backend._forget(self.id)


class LocalBackend(CoreBackend):
    """Namespace + overlayfs sandboxes on this machine (root or rootless)."""

    name = "local"
    config: LocalBackendConfig
    snapshot_prefix = "snap-"
    remember_claimed_pairs = True

    def __init__(self, config: LocalBackendConfig | None = None) -> None:
        self.config = config or LocalBackendConfig()
        self.root = (self.config.root or default_sandbox_root()).absolute()
        self.rootless = os.geteuid() != 0
        for tool in ("nsenter", "prlimit", "setpriv"):
            if shutil.which(tool) is None:
                raise BackendUnavailable(f"the local sandbox backend needs {tool!r} (util-linux) on PATH")
        if not self.rootless and self.root.is_relative_to(paths.SHARED_STATE_DIR):
            paths.ensure_shared_state_dir()
        for sub in ("snapshots", "sandboxes", "registry"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        if self.rootless:
            self._agent_owner = (os.geteuid(), os.getegid())
            self._agent_uid_inside = 0
        else:
            agent = self.config.uid_base + AGENT_UID_INSIDE
            self._agent_owner = (agent, agent)
            self._agent_uid_inside = AGENT_UID_INSIDE
            # Sandboxes reach their mount points through these directories as the mapped root.
            for sub in ("snapshots", "sandboxes"):
                os.chmod(self.root / sub, 0o711)
            os.chmod(self.root, 0o711)
            if (ancestor := paths.untraversable_ancestor(self.root)) is not None:
                raise BackendUnavailable(
                    f"sandbox root {self.root} is below {ancestor}, which other users cannot traverse; "
                    "sandbox init processes run as an unprivileged host uid, so give it o+x "
                    "(chmod o+x) or set SANDBOX_ROOT elsewhere (unset, it defaults to a traversable place)"
                )
        if not self.rootless:
            extract_server.prestart(self._agent_owner)  # the first archive snapshot need not wait for it
        # Sandboxes left behind by crashed owners would otherwise live until their lifetime ends.
        self.reap_orphans()
        self._reset_process_state()
        # A forked child (e.g. a prefork Celery worker) must not share the parent's factory pipes or pool.
        reference = weakref.WeakMethod(self._after_fork_in_child)
        os.register_at_fork(after_in_child=lambda: (method := reference()) and method())

    def _after_fork_in_child(self) -> None:
        # The parent's lifeline must not be kept open by this child, or the parent's sandboxes
        # would outlive the parent.
        for fd in (self._lifeline_read, self._lifeline_write):
            with contextlib.suppress(OSError):
                os.close(fd)
        inherited = self._factory
        if inherited is not None:
            # Close only this process's copies, so the parent's factory still sees EOF when it exits.
            for stream in (inherited.stdin, inherited.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        # Write end held only by this process (not inheritable): every sandbox's init process reads
        # EOF from the read end, and exits, when this process dies (sandboxes/_holder.py).
        self._lifeline_read, self._lifeline_write = os.pipe()
        self._factory: subprocess.Popen[bytes] | None = None
        self._factory_buffer = b""
        self._factory_lock = threading.Lock()
        self._warm_pool_start()

    # Snapshots ----------------------------------------------------------------------------------

    def _snapshot_setup(self, snapshot: Snapshot, tree: Path, commands: tuple[str, ...],
                        limits: SandboxLimits) -> None:
        self._run_setup(snapshot, tree, commands, limits)

    def _run_setup(self, snapshot: Snapshot, tree: Path, commands: tuple[str, ...], limits: SandboxLimits) -> None:
        # The overlay's work directory (beside the tree, same filesystem), owned by the sandbox's root.
        workdir = tree.parent / "setup-work"
        workdir.mkdir()
        os.chown(workdir, *((self.config.uid_base,) * 2 if not self.rootless else (os.geteuid(), os.getegid())))
        sandbox = self._new_sandbox(snapshot=snapshot, limits=limits, workspace_bind=str(tree))
        try:
            for command in commands:
                setup_result_check(command, sandbox.exec(command))
        finally:
            sandbox.destroy()
            for leftover in workdir.iterdir():  # overlay leaves an empty, mode-000 "work" directory
                with contextlib.suppress(OSError):
                    leftover.chmod(0o700)
            safe_tree.discard_tree(workdir, what="setup overlay work directory")

    # Sandboxes ----------------------------------------------------------------------------------

    def _new_sandbox(self, *, snapshot: Snapshot, limits: SandboxLimits, workspace_bind: str | None = None,
                     extra_lifetime_s: float = 0.0) -> LocalSandbox:
        sandbox_id = "lsb-" + secrets.token_hex(8)
        holder = self._start_holder(sandbox_id=sandbox_id, snapshot=snapshot, limits=limits,
                                    workspace_bind=workspace_bind, extra_lifetime_s=extra_lifetime_s)
        sandbox = LocalSandbox(backend=self, sandbox_id=sandbox_id, snapshot=snapshot, limits=limits,
                               holder=holder, workspace_bind=workspace_bind)
        self._registry_write(sandbox)
        return sandbox

    def _start_holder(self, *, sandbox_id: str, snapshot: Snapshot, limits: SandboxLimits,
                      workspace_bind: str | None, extra_lifetime_s: float = 0.0) -> _Holder:
        sandbox_dir = self.root / "sandboxes" / sandbox_id
        for sub in ("root", "disk"):
            (sandbox_dir / sub).mkdir(parents=True, exist_ok=True)
        resolv_conf = sandbox_dir / "resolv.conf"
        if limits.network:
            if shutil.which("slirp4netns") is None:
                raise BackendUnavailable(
                    "SandboxLimits.network=True needs slirp4netns on the host (apt-get install slirp4netns); "
                    "the local backend never shares the host network namespace"
                )
            resolv_conf.write_text(f"nameserver {SLIRP_DNS}\n")
            resolv_conf.chmod(0o644)
        if self.rootless:
            uid_map, gid_map = f"0 {os.geteuid()} 1\n", f"0 {os.getegid()} 1\n"
        else:
            uid_map = gid_map = f"0 {self.config.uid_base} 65536\n"
        config = {
            "sandbox_dir": str(sandbox_dir),
            "lower": snapshot.location,
            "workspace_bind": workspace_bind,
            "workspace_workdir": str(Path(workspace_bind).parent / "setup-work") if workspace_bind else None,
            "disk_mb": limits.disk_mb,
            "resolv_conf": str(resolv_conf) if limits.network else None,
            "readonly_paths": list(self.config.readonly_paths + self.config.extra_readonly_paths),
            "masked_paths": list(self.config.masked_paths),
            "agent_uid": self._agent_uid_inside,
            "agent_gid": self._agent_uid_inside,
            "user_namespace": True,
            "setgroups_allowed": not self.rootless,
            "uid_map": uid_map,
            "gid_map": gid_map,
            "deadline": time.time() + limits.lifetime_s + extra_lifetime_s,
        }
        answer = self._factory_request(json.dumps(config))
        if not answer.startswith("OK "):
            raise BackendUnavailable(f"sandbox {sandbox_id} could not be built: {answer[1:]}")
        pid = int(answer.split()[1])
        try:
            start_time = proc.start_time(pid)
            workspace_fd = os.open(f"/proc/{pid}/root{WORKSPACE_DIR}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            network = None
            if limits.network:
                # The firewall is in place before slirp4netns gives the namespace a route out.
                self._egress_guard(sandbox_id, pid)
                network = self._network_attach(pid, sandbox_dir / "network.log")
            cgroup = None
            if self.config.use_cgroups:
                cgroup = SandboxCgroup.create(
                    name=f"{sandbox_id}-{pid}", memory_bytes=(limits.memory_mb + limits.disk_mb) * 1024 * 1024,
                    max_processes=limits.max_processes + 4,
                )
                if cgroup is not None:
                    cgroup.add(pid)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            raise
        return _Holder(pid, start_time, workspace_fd, network, cgroup)

    def _egress_guard(self, sandbox_id: str, pid: int) -> None:
        """Hold the namespace's egress to public addresses that are not the host's (``sandboxes.netguard``)."""
        try:
            netguard.install(pid, dns=[ipaddress.ip_address(SLIRP_DNS)], enter_user_namespace=self.rootless)
        except netguard.EgressGuardUnavailable as exc:
            if not self.config.network_unguarded:
                raise BackendUnavailable(
                    f"SandboxLimits.network=True is refused: {exc} (without the firewall the sandbox would reach "
                    "the host's services and internal networks; LocalBackendConfig.network_unguarded allows "
                    "that explicitly)") from exc
            logger.warning("sandbox %s has network without its egress firewall: %s", sandbox_id, exc)

    def _network_attach(self, pid: int, log_path: Path) -> subprocess.Popen[bytes]:
        """User-mode NAT (slirp4netns) into the sandbox's network namespace, host loopback excluded."""
        ready_read, ready_write = os.pipe()
        try:
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    # --exit-fd: it exits when the lifeline reports EOF, i.e. when this process dies.
                    ["slirp4netns", "--configure", "--mtu=65520", "--disable-host-loopback",
                     f"--ready-fd={ready_write}", f"--exit-fd={self._lifeline_read}", str(pid), "tap0"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    pass_fds=(ready_write, self._lifeline_read), start_new_session=True,
                )
            os.close(ready_write)
            ready_write = -1
            ready, _, _ = select.select([ready_read], [], [], 10.0)
            if not ready or os.read(ready_read, 1) != b"1":
                process.kill()
                process.wait()
                error = log_path.read_text(errors="replace").strip()
                raise BackendUnavailable(f"slirp4netns did not connect the sandbox network: {error[-500:]}")
            return process
        finally:
            os.close(ready_read)
            if ready_write >= 0:
                os.close(ready_write)


    def _factory_request(self, line: str) -> str:
        """Ask the holder factory for one sandbox; (re)start the factory if it is not running."""
        with self._factory_lock:
            factory = self._factory
            if factory is None or factory.poll() is not None:
                factory = subprocess.Popen(
                    [sys.executable, "-I", "-S", str(HOLDER_SCRIPT), str(self._lifeline_read)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                    pass_fds=(self._lifeline_read,),
                    env={"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"}, start_new_session=True, close_fds=True,
                )
                self._factory = factory
                self._factory_buffer = b""
            assert factory.stdin is not None and factory.stdout is not None
            try:
                factory.stdin.write(line.encode() + b"\n")
                factory.stdin.flush()
                deadline = time.monotonic() + self.config.start_timeout_s
                while b"\n" not in self._factory_buffer:
                    remaining = deadline - time.monotonic()
                    ready, _, _ = select.select([factory.stdout], [], [], max(remaining, 0))
                    if not ready:
                        raise SandboxError(f"sandbox init did not start within {self.config.start_timeout_s}s")
                    chunk = os.read(factory.stdout.fileno(), 65536)
                    if not chunk:
                        raise BackendUnavailable(f"the sandbox factory exited (status {factory.wait()})")
                    self._factory_buffer += chunk
            except BaseException:
                self._factory_stop()
                raise
            answer, _, self._factory_buffer = self._factory_buffer.partition(b"\n")
            return answer.decode()

    def _factory_stop(self) -> None:
        factory, self._factory = self._factory, None
        if factory is None:
            return
        for stream in (factory.stdin, factory.stdout):
            if stream is not None:
                stream.close()
        try:
            factory.wait(timeout=5)
        except subprocess.TimeoutExpired:
            factory.kill()
            factory.wait()

    def _command_argv(self, holder: _Holder, limits: SandboxLimits, command: str) -> list[str]:
        namespaces = ["--user", "--mount", "--pid", "--ipc", "--uts", "--net"]
        if self.rootless:
            # Only the caller's uid is mapped and setgroups is denied: keep the identity, drop every capability.
            credentials, identity = ["--preserve-credentials"], []
        else:
            uid = str(self._agent_uid_inside)
            credentials, identity = [], [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        return [
            *(holder.cgroup.command_prefix() if holder.cgroup else []),
            "nsenter", f"--target={holder.pid}", *namespaces, "--root", "--wd", *credentials,
            "prlimit", f"--cpu={limits.cpu_seconds}", f"--as={limits.memory_mb * 1024 * 1024}",
            f"--nproc={limits.max_processes}", f"--fsize={limits.disk_mb * 1024 * 1024}", "--nofile=1024",
            "--core=0",
            "setpriv", *identity, "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
            "/bin/sh", "-c", command,
        ]

    def _run_bounded(self, argv: list[str], timeout_s: float) -> ExecResult:
        started = time.monotonic()
        # cwd "/": a shell on the way in (the cgroup prefix) exports its working directory as PWD,
        # which would show the sandbox this process's (the checkout's) directory.
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env=dict(COMMAND_ENV), start_new_session=True, close_fds=True, cwd="/")
        stdout, stderr = process.stdout, process.stderr
        assert stdout is not None and stderr is not None  # both are pipes
        buffers: dict[IO[bytes], CappedOutput] = {stdout: CappedOutput(self.config.max_output_bytes),
                                                  stderr: CappedOutput(self.config.max_output_bytes)}
        timed_out = False
        exited_at: float | None = None
        with selectors.DefaultSelector() as selector:
            for stream in buffers:
                os.set_blocking(stream.fileno(), False)
                selector.register(stream, selectors.EVENT_READ)
            while selector.get_map():
                now = time.monotonic()
                if not timed_out and now - started > timeout_s:
                    timed_out = True
                    self._kill_group(process.pid)
                if exited_at is None and process.poll() is not None:
                    exited_at = now
                # Background children may keep the pipes open after the command exits; stop reading soon.
                if exited_at is not None and now - exited_at > 0.2:
                    break
                if timed_out and now - started > timeout_s + 2.0:
                    break
                for key, _ in selector.select(timeout=0.05):
                    readable = cast(IO[bytes], key.fileobj)
                    try:
                        chunk = os.read(readable.fileno(), 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        selector.unregister(readable)
                        continue
                    buffers[readable].add(chunk)
        if not timed_out:
            # Both pipes can close before nsenter has reaped its child; only the timeout may kill.
            try:
                process.wait(timeout=max(timeout_s - (time.monotonic() - started), 0.001))
            except subprocess.TimeoutExpired:
                timed_out = True
        if timed_out:
            self._kill_group(process.pid)
        exit_code = process.wait()
        for stream in buffers:
            stream.close()
        duration = time.monotonic() - started
        return ExecResult(exit_code=-9 if timed_out else exit_code, stdout=buffers[stdout].text(),
                          stderr=buffers[stderr].text(), timed_out=timed_out, duration_s=duration)

    @staticmethod
    def _kill_group(pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    def close(self) -> None:
        """Stop the warm pool and destroy its idle sandboxes (claimed sandboxes are left alone)."""
        super().close()
        with self._factory_lock:
            self._factory_stop()

    # Registry and reaping -----------------------------------------------------------------------

    def _registry_path(self, sandbox_id: str) -> Path:
        return self.root / "registry" / f"{sandbox_id}.json"

    def _registry_write(self, sandbox: LocalSandbox) -> None:
        holder = sandbox._holder
        if holder is None:
            return
        record = {
            "id": sandbox.id, "holder_pid": holder.pid, "holder_start": holder.start_time,
            "owner_pid": os.getpid(), "owner_start": proc.start_time(os.getpid()),
            "deadline": sandbox.deadline, "snapshot": sandbox.snapshot.id,
            "cgroups": [str(p) for p in holder.cgroup.paths.values()] if holder.cgroup else [],
        }
        path = self._registry_path(sandbox.id)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(record))
        temporary.rename(path)

    def _forget(self, sandbox_id: str) -> None:
        self._registry_path(sandbox_id).unlink(missing_ok=True)
        sandbox_dir = self.root / "sandboxes" / sandbox_id
        for sub in ("root", "disk"):
            with contextlib.suppress(FileNotFoundError):
                (sandbox_dir / sub).rmdir()
        try:
            sandbox_dir.rmdir()
        except OSError:
            safe_tree.discard_tree(sandbox_dir, what="sandbox directory")

    def snapshots_in_use(self) -> set[str]:
        in_use = set()
        for path in (self.root / "registry").glob("*.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if proc.alive(record["holder_pid"], record.get("holder_start")):
                # A record without its snapshot id (written before it was recorded) pins every snapshot.
                in_use.add(record.get("snapshot", "*"))
        if "*" in in_use:
            in_use |= {p.name for p in (self.root / "snapshots").glob("snap-*")}
        return in_use

    def reap_orphans(self) -> int:
        reaped = 0
        now = time.time()
        for path in sorted((self.root / "registry").glob("*.json")):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
                continue
            owner_alive = proc.alive(record["owner_pid"], record.get("owner_start"))
            holder_alive = proc.alive(record["holder_pid"], record.get("holder_start"))
            if owner_alive and holder_alive and record["deadline"] > now:
                continue
            if holder_alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(record["holder_pid"], signal.SIGKILL)
            SandboxCgroup({str(i): Path(p) for i, p in enumerate(record.get("cgroups", []))}).remove()
            self._forget(record["id"])
            reaped += 1
        return reaped
