"""One sandbox host per Ray node: owns the node's sandboxes and is the only way to reach them.

Callers never hold a backend sandbox; they hold a sandbox id and call the host's coarse methods
(create, fork, exec, a whole tool batch, diff, destroy), so one Ray call does one unit of agent work.
Requests beyond the host's slots wait in its admission queue (product before training). A thread
sends a heartbeat (utilisation, sandboxes by state, queue figures) every ``heartbeat_interval_s`` to
the configured sink, which records it in the database and the live dashboard.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import psutil

from sandboxes.base import DirEntry, ExecResult, RepoSource, Sandbox, SandboxError, SandboxLimits, Snapshot
from sandboxes.fleet.admission import AdmissionConfig, AdmissionController, AdmissionRejected, Purpose
from sandboxes.fleet.heartbeat import HostHeartbeat, SandboxStatus
from sandboxes.fleet.usage import SandboxUsage, SandboxUsageSampler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SandboxHostConfig:
    """Settings of one sandbox host actor."""

    host_name: str
    """Stable, fleet-unique name (shown on the dashboard, key of the heartbeat records)."""
    slots: int
    """Sandboxes the host runs at once; equals the node's ``sandbox_slots`` Ray resource."""
    backend: str = "local"
    """Sandbox backend on this node: ``local`` or ``docker``."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats; the dashboard and lost-host detection need at most 2."""
    heartbeat_sink: str | None = "webapp.fleet.heartbeat_sink.heartbeat_record"
    """``module.function`` called with each heartbeat dict; ``None`` keeps heartbeats in memory only."""
    admission_timeout_s: float | None = None
    """Longest a create/fork request waits for slots; ``None`` waits as long as it takes."""
    max_waiting: int = 10_000
    """Requests that may wait at once before new ones are rejected."""
    product_reserved_slots: int = 0
    """Slots training may not take, kept free for product requests (see ``AdmissionConfig``)."""
    workers: int | None = None
    """Threads running blocking backend calls; default ``slots + 4`` so every slot can work at once."""
    reap_interval_s: float = 5.0
    """How often sandboxes past their lifetime are destroyed and their slots freed."""
    retention_s: float = 3 * 24 * 3600
    """Snapshots older than this that no live sandbox uses are deleted (``SandboxBackend.gc``)."""
    gc_interval_s: float = 3600.0
    """How often the host runs that retention pass."""
    extra: dict[str, str] = field(default_factory=dict)
    """Free-form labels shown with the host (zone, machine type)."""

    def __post_init__(self) -> None:
        if not self.host_name:
            raise ValueError("SandboxHostConfig.host_name must be non-empty")
        if self.slots < 1:
            raise ValueError(f"SandboxHostConfig.slots={self.slots} must be at least 1")
        if self.backend not in ("local", "docker"):
            raise ValueError(f"SandboxHostConfig.backend={self.backend!r}; use 'local' or 'docker'")
        if not 0.05 <= self.heartbeat_interval_s <= 2.0:
            raise ValueError(
                f"SandboxHostConfig.heartbeat_interval_s={self.heartbeat_interval_s} must be within 0.05..2 s "
                "so the dashboard stays live and lost-host detection stays quick"
            )
        if self.heartbeat_sink is not None and "." not in self.heartbeat_sink:
            raise ValueError(f"SandboxHostConfig.heartbeat_sink={self.heartbeat_sink!r} must be 'module.function'")
        if self.workers is not None and self.workers < 1:
            raise ValueError("SandboxHostConfig.workers must be at least 1")
        if self.retention_s <= 0 or self.gc_interval_s <= 0:
            raise ValueError("SandboxHostConfig.retention_s and gc_interval_s must be positive")
        if self.reap_interval_s <= 0:
            raise ValueError("SandboxHostConfig.reap_interval_s must be positive")


@dataclass
class _Entry:
    sandbox: Sandbox
    purpose: Purpose
    tenant: str
    busy: int = 0


def _load_sink(path: str | None) -> Callable[[dict], None] | None:
    if path is None:
        return None
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class SandboxHost:
    """The host's logic; ``SandboxHostActor`` is this class as a Ray actor (tests may use it directly)."""

    def __init__(self, config: SandboxHostConfig) -> None:
        from sandboxes import get_backend

        self.config = config
        self.backend = get_backend(config.backend)
        # A host that died left its sandboxes behind on this node; clean them up before taking work.
        self.reaped_at_start = self.backend.reap_orphans()
        self.admission = AdmissionController(AdmissionConfig(
            slots=config.slots, max_waiting=config.max_waiting, product_reserved_slots=config.product_reserved_slots))
        self._pool = ThreadPoolExecutor(max_workers=config.workers or config.slots + 4, thread_name_prefix="host")
        self._sandboxes: dict[str, _Entry] = {}
        self._starting = 0
        self._reaper: asyncio.Task | None = None
        self.expired_total = 0
        self._snapshots: dict[str, Snapshot] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sink = _load_sink(config.heartbeat_sink)
        self._last_heartbeat: dict | None = None
        self._usage = SandboxUsageSampler()
        self.heartbeats_sent = 0
        self.heartbeat_errors = 0
        psutil.cpu_percent(interval=None)
        self._beater = threading.Thread(target=self._heartbeat_loop, name="host-heartbeat", daemon=True)
        self._beater.start()

    async def _blocking(self, function, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: function(*args, **kwargs))

    # Snapshots ----------------------------------------------------------------------------------

    async def snapshot_create(self, *, source: RepoSource, image: str | None = None,
                              setup_commands: tuple[str, ...] = (), setup_limits: SandboxLimits | None = None) -> Snapshot:
        snapshot = await self._blocking(self.backend.snapshot_create, source=source, image=image,
                                        setup_commands=tuple(setup_commands), setup_limits=setup_limits)
        self._snapshots[snapshot.id] = snapshot
        return snapshot

    async def snapshot_delete(self, snapshot: Snapshot) -> None:
        self._snapshots.pop(snapshot.id, None)
        await self._blocking(self.backend.snapshot_delete, snapshot=snapshot)

    # Sandboxes ----------------------------------------------------------------------------------

    async def create(self, *, snapshot: Snapshot, limits: SandboxLimits, purpose: Purpose = "training",
                     tenant: str = "default") -> str:
        return (await self.fork(snapshot=snapshot, count=1, limits=limits, purpose=purpose, tenant=tenant))[0]

    async def fork(self, *, snapshot: Snapshot, count: int, limits: SandboxLimits, purpose: Purpose = "training",
                   tenant: str = "default") -> list[str]:
        """Wait for ``count`` slots (queued fairly when the host is full), then start the sandboxes."""
        self._ensure_reaper()
        await self.admission.acquire(purpose=purpose, tenant=tenant, count=count,
                                     timeout_s=self.config.admission_timeout_s)
        self._starting += count
        try:
            if count == 1:
                sandboxes = [await self._blocking(self.backend.sandbox_create, snapshot=snapshot, limits=limits)]
            else:
                sandboxes = await self._blocking(self.backend.sandbox_fork, snapshot=snapshot, count=count,
                                                 limits=limits)
        except BaseException:
            self.admission.release(count=count)
            raise
        finally:
            self._starting -= count
        with self._lock:
            for sandbox in sandboxes:
                self._sandboxes[sandbox.id] = _Entry(sandbox, purpose, tenant)
        return [sandbox.id for sandbox in sandboxes]

    def _entry(self, sandbox_id: str) -> _Entry:
        entry = self._sandboxes.get(sandbox_id)
        if entry is None:
            raise SandboxError(f"sandbox {sandbox_id} is not on host {self.config.host_name} (destroyed or never made)")
        return entry

    async def _busy(self, sandbox_id: str, function, *args, **kwargs):
        entry = self._entry(sandbox_id)
        entry.busy += 1
        try:
            return await self._blocking(function, entry.sandbox, *args, **kwargs)
        finally:
            entry.busy -= 1

    async def exec(self, sandbox_id: str, command: str, timeout_s: float | None = None) -> ExecResult:
        return await self._busy(sandbox_id, lambda s: s.exec(command, timeout_s=timeout_s))

    async def run_tools(self, sandbox_id: str, calls: list) -> list:
        """Run one model turn's tool calls (``sandboxes.tools.ToolCall``) and return their results."""
        from sandboxes.tools import execute_tool_calls

        return await self._busy(sandbox_id, lambda s: execute_tool_calls(sandbox=s, calls=list(calls)))

    async def read_bytes(self, sandbox_id: str, path: str) -> bytes:
        return await self._busy(sandbox_id, lambda s: s.read_bytes(path))

    async def write_bytes(self, sandbox_id: str, path: str, data: bytes) -> None:
        return await self._busy(sandbox_id, lambda s: s.write_bytes(path, data))

    async def list_dir(self, sandbox_id: str, path: str) -> list[DirEntry]:
        return await self._busy(sandbox_id, lambda s: s.list_dir(path))

    async def diff(self, sandbox_id: str) -> str:
        return await self._busy(sandbox_id, lambda s: s.diff())

    async def reset(self, sandbox_id: str) -> None:
        return await self._busy(sandbox_id, lambda s: s.reset())

    async def destroy(self, sandbox_id: str) -> bool:
        """Destroy a sandbox and free its slot; False when it was already gone."""
        with self._lock:
            entry = self._sandboxes.pop(sandbox_id, None)
        if entry is None:
            return False
        try:
            await self._blocking(entry.sandbox.destroy)
        finally:
            self.admission.release(count=1)
        return True

    def _ensure_reaper(self) -> None:
        # Started from the actor's event loop: slots must be released on the loop that waits for them.
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_expired_loop())

    async def _reap_expired_loop(self) -> None:
        last_gc = time.monotonic()
        while not self._stop.is_set():
            await asyncio.sleep(self.config.reap_interval_s)
            await self.reap_expired()
            if time.monotonic() - last_gc >= self.config.gc_interval_s:
                last_gc = time.monotonic()
                try:
                    await self._blocking(self.backend.gc, max_age_s=self.config.retention_s)
                except Exception:  # a failed retention pass must not stop the reaper
                    logger.exception("snapshot retention pass failed")

    async def reap_expired(self) -> int:
        """Destroy idle sandboxes whose lifetime is over (a caller forgot them) and free their slots."""
        now = time.time()
        with self._lock:
            expired = [sandbox_id for sandbox_id, entry in self._sandboxes.items()
                       if not entry.busy and getattr(entry.sandbox, "deadline", now + 1) <= now]
        for sandbox_id in expired:
            if await self.destroy(sandbox_id):
                self.expired_total += 1
        return len(expired)

    # Monitoring ---------------------------------------------------------------------------------

    def heartbeat(self, *, stopping: bool = False) -> HostHeartbeat:
        memory = psutil.virtual_memory()
        with self._lock:
            entries = sorted(self._sandboxes.items())
        pids = {}
        for sandbox_id, entry in entries:
            pid = getattr(entry.sandbox, "holder_pid", None)
            if pid:
                pids[sandbox_id] = pid
        usage = self._usage.sample(pids)
        idle = SandboxUsage(0.0, 0.0)
        statuses = tuple(
            SandboxStatus(sandbox_id, "busy" if entry.busy else "idle", entry.purpose,
                          usage.get(sandbox_id, idle).cpu_percent, usage.get(sandbox_id, idle).memory_mb)
            for sandbox_id, entry in entries
        )
        return HostHeartbeat(
            host_name=self.config.host_name,
            backend=self.config.backend,
            slots_total=self.config.slots,
            slots_used=self.admission.used_slots,
            cpu_percent=psutil.cpu_percent(interval=None),
            memory_percent=memory.percent,
            memory_used_mb=(memory.total - memory.available) / 2**20,
            sandboxes=statuses,
            starting=self._starting,
            queue=self.admission.metrics(),
            stopping=stopping,
            runtime=str(getattr(self.backend, "runtime", "") or ""),
        )

    async def load(self) -> dict:
        """Cheap routing figures for the fleet client: slots free and requests waiting."""
        return {"host_name": self.config.host_name, "free": self.admission.free_slots,
                "slots": self.config.slots, "waiting": self.admission.waiting,
                "product_waiting": self.admission.product_waiting,
                "reserved": self.config.product_reserved_slots}

    async def last_heartbeat(self) -> dict | None:
        return self._last_heartbeat

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            self._beat()

    def _beat(self, *, stopping: bool = False) -> None:
        try:
            payload = self.heartbeat(stopping=stopping).to_dict()
            self._last_heartbeat = payload
            if self._sink is not None:
                self._sink(payload)
            self.heartbeats_sent += 1
        except Exception:
            self.heartbeat_errors += 1
            logger.exception("heartbeat of %s failed", self.config.host_name)

    async def shutdown(self) -> int:
        """Destroy every sandbox, send a final heartbeat with none left, stop beating; returns how many."""
        self._stop.set()
        # The final heartbeat must be the last one stored, so wait out a beat in flight.
        await self._blocking(self._beater.join)
        with self._lock:
            entries, self._sandboxes = list(self._sandboxes.values()), {}
        for entry in entries:
            await self._blocking(entry.sandbox.destroy)
            self.admission.release(count=1)
        await self._blocking(self._beat, stopping=True)
        self._pool.shutdown(wait=False)
        return len(entries)


try:
    import ray

    # Ray's type stubs have no overload for an actor class with max_concurrency; the call is Ray's documented one.
    SandboxHostActor = ray.remote(num_cpus=0, max_concurrency=1000)(SandboxHost)  # type: ignore[call-overload]
except ImportError:  # the fleet needs Ray; the rest of sandboxes does not
    SandboxHostActor = None

__all__ = ["AdmissionRejected", "SandboxHost", "SandboxHostActor", "SandboxHostConfig", "default_host_name"]


def default_host_name(node_id: str) -> str:
    return f"{socket.gethostname()}-{node_id[:8]}"
