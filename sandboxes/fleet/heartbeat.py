"""What a sandbox host reports every heartbeat; plain data so it crosses Ray and Django unchanged."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Literal

SandboxState = Literal["starting", "idle", "busy", "destroyed", "failed"]
SandboxPurpose = Literal["product", "training", "warm"]


@dataclass(frozen=True)
class SandboxStatus:
    """One sandbox as its host sees it."""

    sandbox_id: str
    """Backend sandbox id, unique across the fleet."""
    state: SandboxState
    """``busy`` while a command or tool batch runs, ``idle`` between them."""
    purpose: SandboxPurpose
    """Who asked for it: a product (cloud-agent) task, a training rollout, or the warm pool."""
    cpu_percent: float = 0.0
    """CPU use of the sandbox's processes since the previous heartbeat, percent of one core."""
    memory_mb: float = 0.0
    """Resident memory of the sandbox's processes, MiB."""

    def __post_init__(self) -> None:
        if self.state not in ("starting", "idle", "busy", "destroyed", "failed"):
            raise ValueError(f"SandboxStatus.state={self.state!r} is not a sandbox state")
        if self.purpose not in ("product", "training", "warm"):
            raise ValueError(f"SandboxStatus.purpose={self.purpose!r}; use product, training or warm")


@dataclass(frozen=True)
class QueueMetrics:
    """Admission-control queue figures at heartbeat time."""

    product_waiting: int = 0
    """Product requests waiting for a slot."""
    training_waiting: int = 0
    """Training requests waiting for a slot."""
    admitted_total: int = 0
    """Requests admitted since the host started."""
    wait_p50_s: float = 0.0
    """Median wait of recently admitted requests, seconds."""
    wait_p95_s: float = 0.0
    """95th percentile wait of recently admitted requests, seconds."""

    @property
    def waiting(self) -> int:
        return self.product_waiting + self.training_waiting


@dataclass(frozen=True)
class HostHeartbeat:
    """A host's utilisation and sandboxes, sent at least every ``heartbeat_interval_s``."""

    host_name: str
    """Stable name of the host (one per Ray node)."""
    backend: str
    """Sandbox backend the host runs (``local`` or ``docker``)."""
    slots_total: int
    """Sandboxes the host may run at once."""
    slots_used: int
    """Slots taken now."""
    cpu_percent: float
    """Host CPU utilisation, 0-100."""
    memory_percent: float
    """Host memory utilisation, 0-100."""
    memory_used_mb: float
    """Host memory in use, MiB."""
    sandboxes: tuple[SandboxStatus, ...] = ()
    """Every live sandbox on the host."""
    starting: int = 0
    """Sandboxes admitted and being started (a fork in progress); they have no id yet."""
    queue: QueueMetrics = field(default_factory=QueueMetrics)
    """Admission queue figures."""
    sent_at: float = field(default_factory=time.time)
    """Unix time the heartbeat was taken."""
    stopping: bool = False
    """True on the last heartbeat of a host shutting down cleanly (not to be reported lost)."""
    runtime: str = ""
    """OCI runtime of a ``docker`` host's containers (``runc``, ``runsc``; ``SANDBOX_DOCKER_RUNTIME``);
    empty for the ``local`` backend (Linux namespaces, no OCI runtime)."""

    def __post_init__(self) -> None:
        if not self.host_name:
            raise ValueError("HostHeartbeat.host_name must be non-empty")
        if self.slots_used > self.slots_total:
            raise ValueError(
                f"HostHeartbeat.slots_used={self.slots_used} exceeds slots_total={self.slots_total}"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> HostHeartbeat:
        values = dict(data)
        values["sandboxes"] = tuple(SandboxStatus(**s) for s in values.get("sandboxes", ()))
        values["queue"] = QueueMetrics(**values.get("queue", {}))
        return cls(**values)
