"""Docker sandbox backend: one locked-down container per sandbox, the workspace an overlay on the host.

Workspaces use the same host-side mechanism as the local backend: the snapshot is a frozen
directory, and each sandbox's ``/workspace`` is an overlay whose upper layer lives on a tmpfs of
``disk_mb`` (the disk quota). The overlay is mounted on the host and bind-mounted into the
container, so the host reads and writes workspace files through ``sandboxes.safe_fs`` exactly as the
local backend does; file tools and diffs are byte-identical on both backends. Forking N sandboxes
copies nothing: N overlays share one lower directory.

Containers run the image named by ``settings.SANDBOX_IMAGE`` (``manage.py build_sandbox_image``) as
uid 1000 with every capability dropped, ``no-new-privileges``, a read-only root filesystem, a sized
tmpfs ``/tmp``, cgroup memory/CPU/pids limits and no network unless ``SandboxLimits.network``. The
container's main process is ``sleep <lifetime_s>`` under docker-init (both as ``nobody``, out of the
agent's reach), so the kernel ends every process when the lifetime runs out even if this process
died. Labels name the owning process and
deadline so ``reap_orphans`` finds containers whose owner is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from sandboxes import safe_fs
from sandboxes.archives import ArchiveLimits
from sandboxes.base import (
    WORKSPACE_DIR,
    BackendUnavailable,
    DirEntry,
    ExecResult,
    RepoSource,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxGone,
    SandboxLimits,
    Snapshot,
    SnapshotError,
)
from sandboxes.diffing import workspace_diff
from sandboxes.materialize import materialize_source

AGENT_UID = 1000
# The container's init and lifetime timer run as "nobody", so an agent's `kill -9 -1` (which reaches
# every process of its own uid) cannot end the sandbox from inside; agent commands run as AGENT_UID.
KEEPER_UID = 65534
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LABEL = "flowstate.sandbox"
MNT_DETACH = 0x2
RUNC_START_FAILURE = "OCI runtime exec failed"
# Same environment as the local backend, so commands see the same variables on both.
COMMAND_ENV = {
    "PATH": SANDBOX_PATH, "HOME": WORKSPACE_DIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
    "USER": "sandbox", "TERM": "dumb", "PYTHONDONTWRITEBYTECODE": "1",
}

_libc = ctypes.CDLL(None, use_errno=True)


def _configured(name: str, default):
    try:
        from django.conf import settings

        if settings.configured:
            return getattr(settings, name, default)
    except ImportError:
        pass
    return os.environ.get(name) or default


@dataclass(frozen=True)
class DockerBackendConfig:
    """Settings of the Docker backend."""

    image: str | None = None
    """Default container image; ``None`` uses ``settings.SANDBOX_IMAGE`` (``flowstate-sandbox:latest``)."""
    root: Path | None = None
    """Host state directory (snapshots, overlay mounts); default ``settings.SANDBOX_ROOT / "docker"``."""
    cpus: float = 1.0
    """CPU share of one sandbox (docker ``nano_cpus``), e.g. 0.5 for half a core."""
    tmp_mb: int = 256
    """Size of the in-memory ``/tmp`` of each container, MiB (capped by ``disk_mb``)."""
    max_output_bytes: int = 16 * 1024 * 1024
    """Per-stream cap on command output kept in memory; the rest is dropped with a note."""
    warm_pool_size: int = 0
    """Started sandboxes kept ready per (snapshot, limits) once ``prewarm`` named the pair; 0: no pool."""
    warm_max_idle_s: float = 300.0
    """A warm sandbox unclaimed this long is replaced; its container lives lifetime_s plus this."""
    setup_limits: SandboxLimits = field(
        default_factory=lambda: SandboxLimits(command_timeout_s=600.0, lifetime_s=1800.0, disk_mb=4096)
    )
    """Limits of the container that runs a snapshot's setup commands."""
    archive_limits: ArchiveLimits = field(default_factory=ArchiveLimits)
    """Bounds on archives accepted as snapshot sources."""
    start_workers: int = 8
    """Containers ``sandbox_fork`` starts concurrently."""

    def __post_init__(self) -> None:
        if not 0.01 <= self.cpus <= 64:
            raise ValueError(f"DockerBackendConfig.cpus={self.cpus} must be between 0.01 and 64 cores")
        if self.tmp_mb < 1:
            raise ValueError("DockerBackendConfig.tmp_mb must be at least 1")
        if not 0 <= self.warm_pool_size <= 64:
            raise ValueError("DockerBackendConfig.warm_pool_size must be between 0 and 64")
        if self.warm_max_idle_s <= 0:
            raise ValueError("DockerBackendConfig.warm_max_idle_s must be positive")
        if not 1 <= self.start_workers <= 64:
            raise ValueError("DockerBackendConfig.start_workers must be between 1 and 64")


def _process_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _pid_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _umount(path: Path) -> None:
    if os.path.ismount(path):
        # Lazy: a process still holding a file open must not keep the sandbox from being removed.
        _libc.umount2(str(path).encode(), MNT_DETACH)


def _mount(source: str, target: Path, fstype: str, options: str, cwd: Path | None = None) -> None:
    result = subprocess.run(["mount", "-t", fstype, "-o", options, source, str(target)],
                            capture_output=True, text=True, check=False, cwd=cwd)
    if result.returncode != 0:
        raise BackendUnavailable(f"mounting {fstype} on {target} failed: {result.stderr.strip()}")


class DockerSandbox(Sandbox):
    """A sandbox run by ``DockerBackend``: one container plus its host-side workspace overlay."""

    def __init__(self, *, backend: DockerBackend, sandbox_id: str, snapshot: Snapshot, limits: SandboxLimits,
                 container_id: str, workspace_fd: int) -> None:
        self.id = sandbox_id
        self.snapshot = snapshot
        self.limits = limits
        self._backend = backend
        self._container_id: str | None = container_id
        self._init_pid: int | None = None
        self._workspace_fd = workspace_fd
        self._deadline = time.time() + limits.lifetime_s
        self._lock = threading.RLock()

    @property
    def container_id(self) -> str | None:
        return self._container_id

    @property
    def holder_pid(self) -> int | None:
        """Host pid of the container's init (docker-init), like ``LocalSandbox.holder_pid``."""
        if self._container_id is None:
            return None
        if self._init_pid is None:
            self._init_pid = self._backend._container_pid(self._container_id)
        return self._init_pid

    @property
    def deadline(self) -> float:
        return self._deadline

    def _live(self) -> str:
        container_id = self._container_id
        if container_id is None:
            raise SandboxGone(f"sandbox {self.id} was destroyed")
        if time.time() >= self._deadline:
            self.destroy()
            raise SandboxGone(f"sandbox {self.id} reached its {self.limits.lifetime_s:g}s lifetime and was destroyed")
        return container_id

    def exec(self, command: str, *, timeout_s: float | None = None) -> ExecResult:
        if not isinstance(command, str) or not command.strip():
            raise ValueError("command must be a non-empty string")
        container_id = self._live()
        limit = self.limits.command_timeout_s if timeout_s is None else float(timeout_s)
        if limit <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        limit = min(limit, max(self._deadline - time.time(), 0.001))
        try:
            return self._backend._exec(container_id, command, limit)
        except SandboxGone:
            self.destroy()
            raise SandboxGone(f"sandbox {self.id} is no longer running (its container stopped)") from None

    def read_bytes(self, path: str) -> bytes:
        self._live()
        return safe_fs.read_bytes(self._workspace_fd, path)

    def write_bytes(self, path: str, data: bytes) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError("write_bytes needs bytes")
        self._live()
        safe_fs.write_bytes(self._workspace_fd, path, bytes(data), owner=(AGENT_UID, AGENT_UID))

    def list_dir(self, path: str) -> list[DirEntry]:
        self._live()
        return safe_fs.list_dir(self._workspace_fd, path)

    def diff(self) -> str:
        self._live()
        return workspace_diff(snapshot_dir=self.snapshot.location, workspace_fd=self._workspace_fd)

    def reset(self) -> None:
        with self._lock:
            self._live()
            old_container, old_fd = self._container_id, self._workspace_fd
            # Cleared first: if the restart fails, destroy() must not close an fd number reused since.
            self._container_id, self._workspace_fd = None, -1
            self._backend._teardown(self.id, old_container, old_fd)
            self._container_id, self._workspace_fd = self._backend._start(
                sandbox_id=self.id, snapshot=self.snapshot, limits=self.limits
            )
            self._init_pid = None
            self._deadline = time.time() + self.limits.lifetime_s

    def destroy(self) -> None:
        with self._lock:
            container_id, self._container_id = self._container_id, None
            fd, self._workspace_fd = self._workspace_fd, -1
        if container_id is not None:
            self._backend._teardown(self.id, container_id, fd)


class DockerBackend(SandboxBackend):
    """Sandboxes as Docker containers on the local engine (needs root for the host overlays)."""

    name = "docker"

    def __init__(self, config: DockerBackendConfig | None = None) -> None:
        import docker
        from docker.errors import DockerException, ImageNotFound

        self.config = config or DockerBackendConfig()
        self.image = self.config.image or str(_configured("SANDBOX_IMAGE", "flowstate-sandbox:latest"))
        base = self.config.root or Path(_configured("SANDBOX_ROOT", "var/sandboxes")) / "docker"
        self.root = Path(base).absolute()
        if os.geteuid() != 0:
            raise BackendUnavailable("the docker backend mounts workspace overlays on the host and needs root")
        try:
            self._client = docker.from_env(timeout=120, max_pool_size=64)
            self._client.ping()
        except DockerException as exc:
            raise BackendUnavailable(f"cannot reach the Docker engine: {exc}") from exc
        try:
            self._client.images.get(self.image)
        except ImageNotFound:
            raise BackendUnavailable(
                f"sandbox image {self.image} is missing; build it with `manage.py build_sandbox_image`"
            ) from None
        for sub in ("snapshots", "sandboxes"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._owner_pid = os.getpid()
        self._owner_start = _process_start_time(self._owner_pid)
        # (snapshot id, limits) -> [(started at, sandbox)], and how many each pool should hold.
        self._pool: dict[tuple[str, SandboxLimits], list[tuple[float, DockerSandbox]]] = {}
        self._pool_wanted: dict[tuple[str, SandboxLimits], tuple[Snapshot, int]] = {}
        self._pool_lock = threading.Lock()
        self._pool_wakeup = threading.Event()
        self._refill_lock = threading.Lock()  # one refill at a time, or two would both fill the gap
        self._pool_thread: threading.Thread | None = None
        self._closed = False

    # Snapshots ----------------------------------------------------------------------------------

    def snapshot_create(self, *, source: RepoSource, image: str | None = None,
                        setup_commands: tuple[str, ...] | list[str] = ()) -> Snapshot:
        if not isinstance(source, RepoSource):
            raise TypeError("source must be a RepoSource")
        commands = tuple(setup_commands)
        for command in commands:
            if not isinstance(command, str) or not command.strip():
                raise ValueError(f"setup commands must be non-empty strings, got {command!r}")
        chosen_image = image or self.image
        if chosen_image != self.image:
            self._require_image(chosen_image)
        snapshot_id = "dsnap-" + secrets.token_hex(8)
        staging = self.root / "snapshots" / f".{snapshot_id}.partial"
        final = self.root / "snapshots" / snapshot_id
        tree = staging / "tree"
        staging.mkdir(parents=True)
        try:
            self._materialize(source, tree)
            self._chown_tree(tree)
            if commands:
                self._run_setup(tree, chosen_image, commands)
            (staging / "snapshot.json").write_text(json.dumps({
                "id": snapshot_id, "source": [source.kind, source.location, source.ref],
                "image": chosen_image, "setup_commands": list(commands),
            }))
            staging.rename(final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return Snapshot(id=snapshot_id, backend=self.name, source=source, image=chosen_image,
                        setup_commands=commands, location=str(final / "tree"))

    def snapshot_delete(self, *, snapshot: Snapshot) -> None:
        """Delete a snapshot's files; sandboxes still running on it must be destroyed first."""
        with self._pool_lock:
            doomed = []
            for key in [k for k in self._pool_wanted if k[0] == snapshot.id]:
                self._pool_wanted.pop(key)
                doomed += [sandbox for _, sandbox in self._pool.pop(key, [])]
        for sandbox in doomed:
            sandbox.destroy()
        shutil.rmtree(self.root / "snapshots" / snapshot.id, ignore_errors=True)

    def _require_image(self, image: str) -> None:
        from docker.errors import ImageNotFound

        try:
            self._client.images.get(image)
        except ImageNotFound:
            raise SnapshotError(f"image {image} is not present on this Docker engine (no registry is reachable)") from None

    def _materialize(self, source: RepoSource, tree: Path) -> None:
        materialize_source(source=source, tree=tree, run_as=(AGENT_UID, AGENT_UID),
                           archive_limits=self.config.archive_limits)

    @staticmethod
    def _chown_tree(tree: Path) -> None:
        os.chown(tree, AGENT_UID, AGENT_UID, follow_symlinks=False)
        for dirpath, dirnames, filenames in os.walk(tree):
            for name in dirnames + filenames:
                os.chown(os.path.join(dirpath, name), AGENT_UID, AGENT_UID, follow_symlinks=False)
        os.chmod(tree, 0o755)

    def _run_setup(self, tree: Path, image: str, commands: tuple[str, ...]) -> None:
        limits = self.config.setup_limits
        sandbox_id = "dsetup-" + secrets.token_hex(6)
        container = self._container_start(sandbox_id=sandbox_id, image=image, limits=limits,
                                          workspace=tree, deadline=time.time() + limits.lifetime_s)
        try:
            for command in commands:
                result = self._exec(container, command, limits.command_timeout_s)
                if result.exit_code != 0 or result.timed_out:
                    why = "timed out" if result.timed_out else f"exited with {result.exit_code}"
                    tail = (result.stdout + result.stderr)[-2000:]
                    raise SnapshotError(f"setup command {command!r} {why}: {tail}")
        finally:
            self._container_remove(container)

    # Sandboxes ----------------------------------------------------------------------------------

    def sandbox_create(self, *, snapshot: Snapshot, limits: SandboxLimits) -> DockerSandbox:
        self._check_snapshot(snapshot)
        if not isinstance(limits, SandboxLimits):
            raise TypeError("limits must be a SandboxLimits")
        claimed = self._pool_claim(snapshot, limits)
        if claimed is not None:
            return claimed
        return self._new_sandbox(snapshot, limits)

    def sandbox_fork(self, *, snapshot: Snapshot, count: int, limits: SandboxLimits) -> list[DockerSandbox]:
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"count must be a positive integer, got {count!r}")
        self._check_snapshot(snapshot)
        workers = min(count, self.config.start_workers)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox-fork") as pool:
            futures = [pool.submit(self.sandbox_create, snapshot=snapshot, limits=limits) for _ in range(count)]
        created, errors = [], []
        for future in futures:
            try:
                created.append(future.result())
            except BaseException as exc:  # noqa: BLE001 - every started sandbox must be undone below
                errors.append(exc)
        if errors:
            for sandbox in created:
                sandbox.destroy()
            raise errors[0]
        return created

    def _check_snapshot(self, snapshot: Snapshot) -> None:
        if not isinstance(snapshot, Snapshot) or snapshot.backend != self.name:
            raise SandboxError(f"snapshot {getattr(snapshot, 'id', snapshot)!r} was not made by the docker backend")
        if not Path(snapshot.location).is_dir():
            raise SandboxError(f"snapshot {snapshot.id} no longer exists at {snapshot.location}")

    def _new_sandbox(self, snapshot: Snapshot, limits: SandboxLimits, extra_lifetime_s: float = 0.0) -> DockerSandbox:
        sandbox_id = "dsb-" + secrets.token_hex(8)
        container_id, workspace_fd = self._start(sandbox_id=sandbox_id, snapshot=snapshot, limits=limits,
                                                 extra_lifetime_s=extra_lifetime_s)
        return DockerSandbox(backend=self, sandbox_id=sandbox_id, snapshot=snapshot, limits=limits,
                             container_id=container_id, workspace_fd=workspace_fd)

    def _start(self, *, sandbox_id: str, snapshot: Snapshot, limits: SandboxLimits,
               extra_lifetime_s: float = 0.0) -> tuple[str, int]:
        """Mount the workspace overlay and start the container; returns (container id, workspace fd)."""
        sandbox_dir = self.root / "sandboxes" / sandbox_id
        disk, workspace = sandbox_dir / "disk", sandbox_dir / "workspace"
        for path in (disk, workspace):
            path.mkdir(parents=True, exist_ok=True)
        workspace_fd = -1
        try:
            # The quota tmpfs holds the overlay's upper layer, so workspace changes cannot exceed disk_mb.
            _mount("tmpfs", disk, "tmpfs", f"size={limits.disk_mb}m,mode=0755,nosuid,nodev")
            for name in ("upper", "work"):
                (disk / name).mkdir()
            os.chown(disk / "upper", AGENT_UID, AGENT_UID)
            # Layer paths relative to the sandbox directory: the options show in the container's mountinfo.
            lower = os.path.relpath(snapshot.location, sandbox_dir)
            _mount("overlay", workspace, "overlay", f"lowerdir={lower},upperdir=disk/upper,workdir=disk/work,nosuid,nodev",
                   cwd=sandbox_dir)
            workspace_fd = os.open(workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            container_id = self._container_start(
                sandbox_id=sandbox_id, image=snapshot.image or self.image, limits=limits, workspace=workspace,
                deadline=time.time() + limits.lifetime_s + extra_lifetime_s, snapshot_id=snapshot.id,
            )
            return container_id, workspace_fd
        except BaseException:
            if workspace_fd >= 0:
                os.close(workspace_fd)
            self._unmount_dir(sandbox_dir)
            raise

    def _container_start(self, *, sandbox_id: str, image: str, limits: SandboxLimits, workspace: Path,
                         deadline: float, snapshot_id: str = "") -> str:
        from docker.errors import APIError
        from docker.types import Mount, Ulimit

        labels = {
            LABEL: "1",
            "flowstate.sandbox-id": sandbox_id,
            "flowstate.root": str(self.root),
            "flowstate.owner-host": socket.gethostname(),
            "flowstate.owner-pid": str(self._owner_pid),
            "flowstate.owner-start": repr(self._owner_start),
            "flowstate.deadline": repr(deadline),
            "flowstate.snapshot-id": snapshot_id,
        }
        tmp_mb = min(self.config.tmp_mb, limits.disk_mb)
        try:
            container = self._client.containers.run(
                image,
                ["sleep", str(max(1, int(deadline - time.time()) + 1))],
                name=f"flowstate-{sandbox_id}",
                detach=True,
                init=True,
                user=f"{KEEPER_UID}:{KEEPER_UID}",
                working_dir=WORKSPACE_DIR,
                environment=COMMAND_ENV,
                hostname="sandbox",
                labels=labels,
                network_mode="bridge" if limits.network else "none",
                mem_limit=f"{limits.memory_mb}m",
                memswap_limit=f"{limits.memory_mb}m",
                nano_cpus=int(self.config.cpus * 1e9),
                pids_limit=limits.max_processes,
                read_only=True,
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                tmpfs={"/tmp": f"size={tmp_mb}m,mode=1777,nosuid,nodev"},
                shm_size=f"{min(64, tmp_mb)}m",
                mounts=[Mount(target=WORKSPACE_DIR, source=str(workspace), type="bind", read_only=False)],
                ulimits=[
                    Ulimit(name="cpu", soft=limits.cpu_seconds, hard=limits.cpu_seconds),
                    Ulimit(name="core", soft=0, hard=0),
                    Ulimit(name="nofile", soft=1024, hard=1024),
                    Ulimit(name="fsize", soft=limits.disk_mb * 2**20, hard=limits.disk_mb * 2**20),
                ],
            )
        except APIError as exc:
            raise SandboxError(f"starting the container of sandbox {sandbox_id} failed: {exc.explanation or exc}") from exc
        return container.id

    def _container_remove(self, container_id: str) -> None:
        from docker.errors import APIError, NotFound

        with contextlib.suppress(NotFound):
            try:
                self._client.api.remove_container(container_id, force=True)
            except APIError as exc:
                if "already in progress" not in str(exc):
                    raise

    def _unmount_dir(self, sandbox_dir: Path) -> None:
        _umount(sandbox_dir / "workspace")
        _umount(sandbox_dir / "disk")
        shutil.rmtree(sandbox_dir, ignore_errors=True)

    def _teardown(self, sandbox_id: str, container_id: str | None, workspace_fd: int) -> None:
        if workspace_fd >= 0:
            os.close(workspace_fd)
        if container_id is not None:
            self._container_remove(container_id)
        self._unmount_dir(self.root / "sandboxes" / sandbox_id)

    # Commands -----------------------------------------------------------------------------------

    def _exec(self, container_id: str, command: str, timeout_s: float) -> ExecResult:
        """Run one command; retried briefly when runc could not start it at all.

        runc fails to enter the container while its pids cgroup is full, e.g. for the moment after a
        fork bomb was killed and before init reaped the orphans. Only that start failure is retried.
        """
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            result = self._exec_once(container_id, command, max(deadline - time.monotonic(), 0.001))
            if not (result.exit_code == 126 and result.stdout.startswith(RUNC_START_FAILURE)):
                return result
            if time.monotonic() + delay >= deadline or delay > 2.0:
                return result
            time.sleep(delay)
            delay *= 2

    def _exec_once(self, container_id: str, command: str, timeout_s: float) -> ExecResult:
        from docker.errors import APIError, NotFound
        from docker.utils.socket import frames_iter

        started = time.monotonic()
        api = self._client.api
        try:
            exec_id = api.exec_create(container_id, ["/bin/sh", "-c", command], user=f"{AGENT_UID}:{AGENT_UID}",
                                      workdir=WORKSPACE_DIR, environment=COMMAND_ENV)["Id"]
            stream = api.exec_start(exec_id, socket=True)
        except NotFound:
            raise SandboxGone(f"container {container_id[:12]} is gone") from None
        except APIError as exc:
            if "is not running" in str(exc) or exc.response is not None and exc.response.status_code == 409:
                raise SandboxGone(f"container {container_id[:12]} is not running") from None
            raise SandboxError(f"docker exec failed: {exc}") from exc
        cap = self.config.max_output_bytes
        buffers = {1: bytearray(), 2: bytearray()}
        dropped = {1: 0, 2: 0}

        def pump() -> None:
            with contextlib.suppress(OSError, ValueError):
                for stream_id, data in frames_iter(stream, tty=False):
                    target = 2 if stream_id == 2 else 1
                    room = max(cap - len(buffers[target]), 0)
                    buffers[target] += data[:room]
                    dropped[target] += len(data) - min(len(data), room)

        reader = threading.Thread(target=pump, name="sandbox-exec-output", daemon=True)
        reader.start()
        timed_out = False
        exited_at: float | None = None
        pid = 0
        while reader.is_alive():
            reader.join(timeout=0.02)
            now = time.monotonic()
            if not timed_out and now - started > timeout_s:
                timed_out = True
                self._kill_exec(exec_id)
            if timed_out and now - started > timeout_s + 2.0:
                break
            # Background children may keep the output open after the command exits; stop reading soon.
            if exited_at is None and reader.is_alive() and now - started > 0.1:
                pid = pid or api.exec_inspect(exec_id).get("Pid") or 0
                if pid and not _pid_running(pid):
                    exited_at = now
            if exited_at is not None and now - exited_at > 0.2:
                break
        with contextlib.suppress(OSError):
            stream.close()
        reader.join(timeout=1.0)
        info = api.exec_inspect(exec_id)
        # dockerd reports the exit once it stops copying output, up to ~2 s after the process ended.
        while info["Running"] and time.monotonic() - started < timeout_s + 8.0:
            if timed_out:
                self._kill_exec(exec_id)
            time.sleep(0.05)
            info = api.exec_inspect(exec_id)
        exit_code = info["ExitCode"] if info["ExitCode"] is not None else -9
        if not timed_out and exit_code == 137 and not self._container_running(container_id):
            raise SandboxGone(f"container {container_id[:12]} stopped while the command ran")

        def decode(key: int) -> str:
            text = bytes(buffers[key]).decode("utf-8", "replace")
            if dropped[key]:
                text += f"\n[sandbox: {dropped[key]} more bytes of output were dropped]\n"
            return text

        return ExecResult(exit_code=-9 if timed_out else exit_code, stdout=decode(1), stderr=decode(2),
                          timed_out=timed_out, duration_s=time.monotonic() - started)

    def _kill_exec(self, exec_id: str) -> None:
        """Kill an exec'd command with its process group and every descendant (host pids)."""
        pid = self._client.api.exec_inspect(exec_id).get("Pid") or 0
        if pid <= 0:
            return
        try:
            victims = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            victims = []
        # docker exec makes the command a session leader, so its pid is also its process group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        for process in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()

    def _container_pid(self, container_id: str) -> int | None:
        from docker.errors import NotFound

        try:
            return int(self._client.api.inspect_container(container_id)["State"]["Pid"]) or None
        except NotFound:
            return None

    def _container_running(self, container_id: str) -> bool:
        from docker.errors import NotFound

        try:
            return bool(self._client.api.inspect_container(container_id)["State"]["Running"])
        except NotFound:
            return False

    # Warm pool ----------------------------------------------------------------------------------

    def prewarm(self, *, snapshot: Snapshot, limits: SandboxLimits, wait: bool = False,
                count: int | None = None) -> None:
        """Keep ``count`` (default ``config.warm_pool_size``) started sandboxes ready for (snapshot, limits).

        A background thread refills the pool after each claim; ``wait`` fills it before returning.
        """
        self._check_snapshot(snapshot)
        wanted = self.config.warm_pool_size if count is None else count
        if not isinstance(wanted, int) or not 0 <= wanted <= 64:
            raise ValueError(f"warm pool size must be between 0 and 64, got {wanted!r}")
        key = (snapshot.id, limits)
        with self._pool_lock:
            self._pool_wanted[key] = (snapshot, wanted)
            self._pool.setdefault(key, [])
        if wait:
            self._pool_refill_once()
        self._ensure_pool_thread()
        self._pool_wakeup.set()

    def warm_count(self, *, snapshot: Snapshot, limits: SandboxLimits) -> int:
        with self._pool_lock:
            return len(self._pool.get((snapshot.id, limits), ()))

    def _pool_claim(self, snapshot: Snapshot, limits: SandboxLimits) -> DockerSandbox | None:
        key = (snapshot.id, limits)
        claimed, stale = None, []
        with self._pool_lock:
            pool = self._pool.get(key)
            while pool:
                started, sandbox = pool.pop(0)
                # Warm containers live lifetime_s + warm_max_idle_s, so a claim within the idle
                # window still has the full lifetime ahead of it.
                if sandbox.container_id and time.time() - started < self.config.warm_max_idle_s:
                    claimed = sandbox
                    break
                stale.append(sandbox)
        for sandbox in stale:
            sandbox.destroy()
        if key in self._pool_wanted:
            self._pool_wakeup.set()
        if claimed is not None:
            claimed._deadline = time.time() + limits.lifetime_s
        return claimed

    def _ensure_pool_thread(self) -> None:
        with self._pool_lock:
            if self._pool_thread is None or not self._pool_thread.is_alive():
                self._pool_thread = threading.Thread(target=self._pool_loop, name="docker-warm-pool", daemon=True)
                self._pool_thread.start()

    def _pool_loop(self) -> None:
        while not self._closed:
            self._pool_wakeup.wait(timeout=5.0)
            self._pool_wakeup.clear()
            if self._closed:
                return
            try:
                self._pool_refill_once()
            except SandboxError:
                time.sleep(1.0)

    def _pool_refill_once(self) -> None:
        with self._refill_lock:
            self._pool_refill_locked()

    def _pool_refill_locked(self) -> None:
        with self._pool_lock:
            wanted = dict(self._pool_wanted)
        for key, (snapshot, size) in wanted.items():
            with self._pool_lock:
                now = time.time()
                pool = self._pool.setdefault(key, [])
                stale = [entry for entry in pool if now - entry[0] >= self.config.warm_max_idle_s]
                pool[:] = [entry for entry in pool if entry not in stale]
                missing = size - len(pool)
            for _, sandbox in stale:
                sandbox.destroy()
            if missing <= 0 or not Path(snapshot.location).is_dir():
                continue
            fresh = [self._new_sandbox(snapshot, key[1], extra_lifetime_s=self.config.warm_max_idle_s)
                     for _ in range(missing)]
            with self._pool_lock:
                if key in self._pool_wanted and not self._closed:
                    self._pool.setdefault(key, []).extend((time.time(), sandbox) for sandbox in fresh)
                    fresh = []
            for sandbox in fresh:
                sandbox.destroy()

    def close(self) -> None:
        """Stop the warm pool and destroy its idle sandboxes (claimed sandboxes are left alone)."""
        self._closed = True
        self._pool_wakeup.set()
        with self._pool_lock:
            pools, self._pool, self._pool_wanted = self._pool, {}, {}
        for pool in pools.values():
            for _, sandbox in pool:
                sandbox.destroy()

    # Reaping ------------------------------------------------------------------------------------

    def snapshots_in_use(self) -> set[str]:
        containers = self._client.api.containers(filters={"label": [LABEL, f"flowstate.root={self.root}"]})
        return {(c.get("Labels") or {}).get("flowstate.snapshot-id", "") for c in containers} - {""}

    def reap_orphans(self) -> int:
        """Remove containers of this state root whose owner process died, that expired, or that exited."""
        now = time.time()
        hostname = socket.gethostname()
        reaped = 0
        containers = self._client.api.containers(all=True, filters={"label": [LABEL, f"flowstate.root={self.root}"]})
        live_ids = set()
        for container in containers:
            labels = container.get("Labels") or {}
            sandbox_id = labels.get("flowstate.sandbox-id", "")
            owner_alive = False
            if labels.get("flowstate.owner-host") == hostname:
                try:
                    pid = int(labels.get("flowstate.owner-pid", "0"))
                    recorded = float(labels.get("flowstate.owner-start", "nan"))
                except ValueError:
                    pid, recorded = 0, float("nan")
                current = _process_start_time(pid) if pid > 0 else None
                owner_alive = current is not None and abs(current - recorded) < 0.01
            expired = float(labels.get("flowstate.deadline", "0") or 0) <= now
            running = container.get("State") == "running"
            if owner_alive and running and not expired:
                live_ids.add(sandbox_id)
                continue
            self._container_remove(container["Id"])
            self._unmount_dir(self.root / "sandboxes" / sandbox_id)
            reaped += 1
        # Overlays left behind by a process that died between mounting and starting its container.
        for sandbox_dir in (self.root / "sandboxes").iterdir():
            if sandbox_dir.name not in live_ids and not any(
                c.get("Labels", {}).get("flowstate.sandbox-id") == sandbox_dir.name for c in containers
            ) and time.time() - sandbox_dir.stat().st_mtime > 60:
                self._unmount_dir(sandbox_dir)
        return reaped
