"""Docker sandbox backend: one locked-down container per sandbox, the workspace an overlay on the host.

Workspaces use the same host-side mechanism as the local backend: the snapshot is a frozen
directory, and each sandbox's ``/workspace`` is an overlay whose upper layer lives on a tmpfs of
``disk_mb`` (the disk quota). The overlay is mounted on the host and bind-mounted into the
container, so the host reads and writes workspace files through ``sandboxes.safe_fs`` exactly as the
local backend does; file tools and diffs are byte-identical on both backends. Forking N sandboxes
copies nothing: N overlays share one lower directory.

Containers run under the configured OCI runtime (``SANDBOX_DOCKER_RUNTIME``: runc, or runsc once it
passes ``sandboxes.docker_runtime.runtime_self_test``) and image (``SANDBOX_IMAGE``, built by
``manage.py build_sandbox_image``) as uid 1000 with every capability dropped, ``no-new-privileges``, a
read-only root, a sized tmpfs ``/tmp``, cgroup memory/CPU/pids limits and no network unless
``SandboxLimits.network`` (then public addresses only, ``sandboxes.netguard``; runc only). The main
process is ``sleep <lifetime_s>`` under docker-init (as ``nobody``), so the kernel ends every process
when the lifetime runs out even if this process died; labels name the owner and deadline for
``reap_orphans``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from sandboxes import extract_server, netguard, proc, safe_tree
from sandboxes.archives import ArchiveLimits
from sandboxes.backend_core import COMMAND_ENV, CappedOutput, CoreBackend, CoreSandbox, setup_result_check
from sandboxes.base import (
    WORKSPACE_DIR,
    BackendUnavailable,
    ExecResult,
    SandboxError,
    SandboxGone,
    SandboxLimits,
    Snapshot,
    SnapshotError,
)
from sandboxes.docker_runtime import (
    EXEC_MARK,
    GVISOR_KILL_TIMEOUT_S,
    gvisor_kill_command,
    gvisor_rlimits,
    runtime_is_gvisor,
    runtime_missing,
    runtime_pids_overhead,
    runtime_self_test,
)
from sandboxes.settings import RUNTIME_NAME
from sandboxes.settings import current as current_settings

AGENT_UID = 1000
# The container's init and lifetime timer run as "nobody", so an agent's `kill -9 -1` (which reaches
# every process of its own uid) cannot end the sandbox from inside; agent commands run as AGENT_UID.
KEEPER_UID = 65534
LABEL = "flowstate.sandbox"
MNT_DETACH = 0x2
RUNC_START_FAILURE = "OCI runtime exec failed"
_libc = ctypes.CDLL(None, use_errno=True)

if TYPE_CHECKING:
    from collections.abc import Iterator


def _exec_frames(stream: Any) -> Iterator[tuple[int, bytes]]:
    """(stream id, bytes) frames of a non-TTY ``docker exec`` stream, read through the HTTP response's
    buffered reader: docker-py's ``frames_iter`` reads the raw socket beneath that buffer, so output that
    arrived with the response headers would be lost and the frames after it misread."""
    from docker.utils.socket import frames_iter

    try:
        reader = stream._response.raw._fp.fp
    except AttributeError:  # a transport docker-py reads otherwise: its own reader
        yield from frames_iter(stream, tty=False)
        return
    while True:
        header = reader.read(8)
        if len(header) < 8:
            return
        length = int.from_bytes(header[4:8], "big")
        payload = reader.read(length) if length else b""
        if payload:
            yield header[0], payload
        if len(payload) < length:
            return


@dataclass(frozen=True)
class DockerBackendConfig:
    """Settings of the Docker backend."""

    image: str | None = None
    """Default container image; ``None``: the configured ``SANDBOX_IMAGE`` (``flowstate-sandbox:latest``)."""
    root: Path | None = None
    """Host state directory (snapshots, overlay mounts); default: the configured ``SANDBOX_ROOT / "docker"``."""
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
    setup_limits: SandboxLimits = field(default_factory=lambda: SandboxLimits(
        command_timeout_s=600.0, lifetime_s=1800.0, disk_mb=4096))
    """Limits of the container that runs a snapshot's setup commands."""
    archive_limits: ArchiveLimits = field(default_factory=ArchiveLimits)
    """Bounds on archives accepted as snapshot sources."""
    start_workers: int = 8
    """Containers ``sandbox_fork`` starts concurrently."""
    runtime: str | None = None
    """OCI runtime (``runc``, ``runsc``), registered with the engine; ``None``: ``SANDBOX_DOCKER_RUNTIME``."""

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
        if self.runtime is not None and not RUNTIME_NAME.fullmatch(self.runtime):
            raise ValueError(f"DockerBackendConfig.runtime={self.runtime!r} is not a runtime name (e.g. runc, runsc)")


def _owner_alive(labels: dict[str, str]) -> bool:
    """Whether the process that started a container (its labels name it) still runs on this host."""
    if labels.get("flowstate.owner-host") != socket.gethostname():
        return False
    try:
        pid = int(labels.get("flowstate.owner-pid", "0"))
        recorded = int(labels.get("flowstate.owner-start", ""))
    except ValueError:  # no start time recorded, or one of another form: the owner cannot be told apart
        return False
    return pid > 0 and proc.alive(pid, recorded)


def _umount(path: Path) -> None:
    if os.path.ismount(path):
        # Lazy: a process still holding a file open must not keep the sandbox from being removed.
        _libc.umount2(str(path).encode(), MNT_DETACH)


def _mount(source: str, target: Path, fstype: str, options: str, cwd: Path | None = None) -> None:
    result = subprocess.run(["mount", "-t", fstype, "-o", options, source, str(target)],
                            capture_output=True, text=True, check=False, cwd=cwd)
    if result.returncode != 0:
        raise BackendUnavailable(f"mounting {fstype} on {target} failed: {result.stderr.strip()}")


class DockerSandbox(CoreSandbox):
    """A sandbox run by ``DockerBackend``: one container plus its host-side workspace overlay."""

    _backend: DockerBackend

    def __init__(self, *, backend: DockerBackend, sandbox_id: str, snapshot: Snapshot, limits: SandboxLimits,
                 container_id: str, workspace_fd: int) -> None:
        super().__init__(backend=backend, sandbox_id=sandbox_id, snapshot=snapshot, limits=limits)
        self._container_id: str | None = container_id
        self._init_pid: int | None = None
        self._workspace_fd = workspace_fd

    @property
    def container_id(self) -> str | None:
        return self._container_id

    @property
    def runtime(self) -> str:
        """OCI runtime of the container (the isolation tier the trace records)."""
        return self._backend.runtime

    @property
    def holder_pid(self) -> int | None:
        """Host pid of the container's init (docker-init), like ``LocalSandbox.holder_pid``."""
        if self._container_id is None:
            return None
        if self._init_pid is None:
            self._init_pid = self._backend._container_pid(self._container_id)
        return self._init_pid

    def _handle(self) -> str | None:
        return self._container_id

    def _workspace_fd_of(self, handle: str) -> int:
        return self._workspace_fd

    def _run(self, handle: str, command: str, timeout_s: float) -> ExecResult:
        try:
            return self._backend._exec(handle, command, timeout_s)
        except SandboxGone:
            self._gone("is no longer running (its container stopped)")

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


class DockerBackend(CoreBackend):
    """Sandboxes as Docker containers on the local engine (needs root for the host overlays)."""

    name = "docker"
    config: DockerBackendConfig
    snapshot_prefix = "dsnap-"

    def __init__(self, config: DockerBackendConfig | None = None) -> None:
        import docker
        from docker.errors import DockerException, ImageNotFound

        self.config = config or DockerBackendConfig()
        configured = current_settings()
        self.image = self.config.image or configured.image
        self.root = Path(self.config.root or configured.root / "docker").absolute()
        self.runtime = self.config.runtime or configured.docker_runtime
        self.fork_workers = self.config.start_workers
        self._agent_owner = (AGENT_UID, AGENT_UID)
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
        missing = runtime_missing(self._client, self.runtime)
        if missing:
            raise BackendUnavailable(missing)
        self.gvisor = runtime_is_gvisor(self._client, self.runtime)
        for sub in ("snapshots", "sandboxes"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._owner_pid = os.getpid()
        self._owner_start = proc.start_time(self._owner_pid)
        if self.runtime != "runc":
            runtime_self_test(self)
        extract_server.prestart((AGENT_UID, AGENT_UID))  # the first archive snapshot need not wait for it
        self._warm_pool_start()

    # Snapshots ----------------------------------------------------------------------------------

    def _snapshot_image(self, image: str | None) -> str:
        chosen_image = image or self.image
        if chosen_image != self.image:
            self._require_image(chosen_image)
        return chosen_image

    def _snapshot_setup(self, snapshot: Snapshot, tree: Path, commands: tuple[str, ...],
                        limits: SandboxLimits) -> None:
        self._run_setup(tree, snapshot.image or self.image, commands, limits)

    def _require_image(self, image: str) -> None:
        from docker.errors import ImageNotFound

        try:
            self._client.images.get(image)
        except ImageNotFound:
            raise SnapshotError(f"image {image} is not present on this Docker engine (no registry is reachable)") from None

    def _run_setup(self, tree: Path, image: str, commands: tuple[str, ...], limits: SandboxLimits) -> None:
        sandbox_id = "dsetup-" + secrets.token_hex(6)
        # Setup commands write into the tree itself, through an overlay whose upper layer it is (over an
        # empty lower one) with relative layer paths: a bind of the tree would show its host path in the
        # container's /proc/self/mountinfo.
        staging = tree.parent
        for name in ("setup-empty", "setup-work", "setup-workspace"):
            (staging / name).mkdir()
        _mount("overlay", staging / "setup-workspace", "overlay",
               f"lowerdir=setup-empty,upperdir={tree.name},workdir=setup-work,nosuid,nodev", cwd=staging)
        try:
            container = self._container_start(sandbox_id=sandbox_id, image=image, limits=limits,
                                              workspace=staging / "setup-workspace",
                                              deadline=time.time() + limits.lifetime_s)
        except BaseException:
            self._setup_unmount(staging)
            raise
        try:
            for command in commands:
                setup_result_check(command, self._exec(container, command, limits.command_timeout_s))
        finally:
            self._container_remove(container)
            self._setup_unmount(staging)

    @staticmethod
    def _setup_unmount(staging: Path) -> None:
        _umount(staging / "setup-workspace")
        for name in ("setup-empty", "setup-work", "setup-workspace"):
            safe_tree.discard_tree(staging / name, what="setup directory")

    # Sandboxes ----------------------------------------------------------------------------------

    def _new_sandbox(self, *, snapshot: Snapshot, limits: SandboxLimits, extra_lifetime_s: float = 0.0) -> DockerSandbox:
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
                runtime=self.runtime,
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
                pids_limit=limits.max_processes + runtime_pids_overhead(self.gvisor, limits.max_processes),
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
                    *(Ulimit(name=name, soft=value, hard=value) for name, value in
                      (gvisor_rlimits(limits) if self.gvisor else {}).items()),
                ],
            )
        except APIError as exc:
            raise SandboxError(f"starting the container of sandbox {sandbox_id} failed: {exc.explanation or exc}") from exc
        if limits.network:  # before any command runs: public, non-host addresses only (sandboxes.netguard)
            try:
                netguard.install_in_container(self._client.api.inspect_container(container.id), runtime=self.runtime)
            except netguard.EgressGuardUnavailable as exc:
                self._container_remove(container.id)
                raise BackendUnavailable(f"SandboxLimits.network=True is refused: {exc}") from exc
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
        safe_tree.discard_tree(sandbox_dir, what="sandbox directory")

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

    def _exec_once(self, container_id: str, command: str, timeout_s: float, *, killable: bool = True) -> ExecResult:
        from docker.errors import APIError, NotFound

        started = time.monotonic()
        api = self._client.api
        # Under gVisor the command's processes carry a token, so a timeout can kill them from inside.
        token = secrets.token_hex(8) if self.gvisor and killable else ""
        environment = {**COMMAND_ENV, EXEC_MARK: token} if token else COMMAND_ENV
        try:
            exec_id = api.exec_create(container_id, ["/bin/sh", "-c", command], user=f"{AGENT_UID}:{AGENT_UID}",
                                      workdir=WORKSPACE_DIR, environment=environment)["Id"]
            stream = api.exec_start(exec_id, socket=True)
        except NotFound:
            raise SandboxGone(f"container {container_id[:12]} is gone") from None
        except APIError as exc:
            if "is not running" in str(exc) or exc.response is not None and exc.response.status_code == 409:
                raise SandboxGone(f"container {container_id[:12]} is not running") from None
            raise SandboxError(f"docker exec failed: {exc}") from exc
        buffers = {1: CappedOutput(self.config.max_output_bytes), 2: CappedOutput(self.config.max_output_bytes)}

        def pump() -> None:
            with contextlib.suppress(OSError, ValueError):
                for stream_id, data in _exec_frames(stream):
                    buffers[2 if stream_id == 2 else 1].add(data)

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
                self._kill_exec(exec_id, container_id, token)
            if timed_out and now - started > timeout_s + 2.0:
                break
            # Background children may keep the output open after the command exits; stop reading soon.
            if exited_at is None and reader.is_alive() and now - started > 0.1:
                pid = pid or self._exec_info(container_id, exec_id).get("Pid") or 0
                if pid and not proc.alive(pid):
                    exited_at = now
            if exited_at is not None and now - exited_at > 0.2:
                break
        with contextlib.suppress(OSError):
            stream.close()
        reader.join(timeout=1.0)
        info = self._exec_info(container_id, exec_id)
        # dockerd reports the exit once it stops copying output, up to ~2 s after the process ended.
        while info["Running"] and time.monotonic() - started < timeout_s + 8.0:
            if timed_out:
                self._kill_exec(exec_id, container_id, token)
            time.sleep(0.05)
            info = self._exec_info(container_id, exec_id)
        exit_code = info["ExitCode"] if info["ExitCode"] is not None else -9
        if not timed_out and exit_code == 137 and not self._container_running(container_id):
            raise SandboxGone(f"container {container_id[:12]} stopped while the command ran")

        return ExecResult(exit_code=-9 if timed_out else exit_code, stdout=buffers[1].text(), stderr=buffers[2].text(),
                          timed_out=timed_out, duration_s=time.monotonic() - started)

    def _exec_info(self, container_id: str, exec_id: str) -> dict:
        """``docker exec`` inspection; the engine forgets an exec whose container died (SandboxGone)."""
        from docker.errors import NotFound

        try:
            return self._client.api.exec_inspect(exec_id)
        except NotFound:
            raise SandboxGone(f"container {container_id[:12]} stopped while the command ran") from None

    def _kill_exec(self, exec_id: str, container_id: str, token: str) -> None:
        """Kill an exec'd command with its process group and every descendant (host pids); under
        gVisor, whose sentry runs them out of the host's sight, first from inside the sandbox."""
        if token:
            with contextlib.suppress(SandboxError):
                self._exec_once(container_id, gvisor_kill_command(token), GVISOR_KILL_TIMEOUT_S, killable=False)
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

    # Reaping ------------------------------------------------------------------------------------

    def snapshots_in_use(self) -> set[str]:
        containers = self._client.api.containers(filters={"label": [LABEL, f"flowstate.root={self.root}"]})
        return {(c.get("Labels") or {}).get("flowstate.snapshot-id", "") for c in containers} - {""}

    def reap_orphans(self) -> int:
        """Remove containers of this state root whose owner process died, that expired, or that exited."""
        now = time.time()
        reaped = 0
        containers = self._client.api.containers(all=True, filters={"label": [LABEL, f"flowstate.root={self.root}"]})
        live_ids = set()
        for container in containers:
            labels = container.get("Labels") or {}
            sandbox_id = labels.get("flowstate.sandbox-id", "")
            owner_alive = _owner_alive(labels)
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
