"""``SANDBOX_BACKEND=fleet``: product (cloud-agent) tasks take their sandbox from the Ray sandbox fleet.

The other backends start the sandbox on the Celery worker's own machine. This one asks the fleet
(``manage.py fleet_serve``'s host actors, one per Ray node with ``sandbox_slots``) for a product
sandbox, so product tasks share the fleet's admission control with training (product requests
first, the reserved product slots) and run on whichever node has room.

A task's snapshot is built on one host only, the one placement picks for it (a product task needs
one sandbox; building on every host would cost the whole fleet a clone per task). If that host is
lost before the sandbox starts, the snapshot is built again on another host and the sandbox started
there; a host lost while the agent runs ends the task as failed with the reason
(``SandboxGone: ... lost with its host``), an infrastructure failure, never a verdict on the agent.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid

from sandboxes.base import RepoSource, SandboxBackend, SandboxError, SandboxGone, SandboxLimits, Snapshot
from sandboxes.fleet.client import Fleet, FleetConfig, FleetSandbox, FleetSnapshot

PRODUCT_TENANT = "product"


class FleetBackend(SandboxBackend):
    """A sandbox backend whose sandboxes live on the fleet's host actors (attached, never placed here)."""

    name = "fleet"

    def __init__(self, config: FleetConfig | None = None, *, ray_address: str | None = None,
                 attempts: int = 3) -> None:
        if attempts < 1:
            raise ValueError("FleetBackend attempts must be at least 1")
        self.config = config or FleetConfig(heartbeat_sink=None)
        self.ray_address = ray_address
        self.attempts = attempts
        self._fleet: Fleet | None = None
        self._lock = threading.Lock()

    def fleet(self) -> Fleet:
        """The attached fleet, joining the Ray cluster (``RAY_ADDRESS``) on first use."""
        with self._lock:
            if self._fleet is None:
                import ray

                if not ray.is_initialized():
                    address = self.ray_address or os.environ.get("RAY_ADDRESS")
                    if not address:
                        raise SandboxError("SANDBOX_BACKEND=fleet needs RAY_ADDRESS (the Ray head, HOST:6379)")
                    ray.init(address=address, log_to_driver=False, configure_logging=False)
                self._fleet = Fleet.connect(self.config)
            return self._fleet

    # A fleet snapshot is a recipe plus the copies built per host, not one backend's frozen tree.
    def snapshot_create(self, *, source: RepoSource, image: str | None = None,  # type: ignore[override]
                        setup_commands: tuple[str, ...] | list[str] = (),
                        setup_limits: SandboxLimits | None = None) -> FleetSnapshot:
        """A snapshot that is built on the host its sandbox is placed on (see ``sandbox_create``)."""
        return FleetSnapshot(key=f"fleet-{uuid.uuid4().hex[:16]}", per_host={}, source=source, image=image,
                             setup_commands=tuple(setup_commands), setup_limits=setup_limits)

    def sandbox_create(self, *, snapshot: Snapshot | FleetSnapshot, limits: SandboxLimits) -> FleetSandbox:
        return self.sandbox_fork(snapshot=snapshot, count=1, limits=limits)[0]

    def sandbox_fork(self, *, snapshot: Snapshot | FleetSnapshot, count: int,
                     limits: SandboxLimits) -> list[FleetSandbox]:
        """Product sandboxes on the best host; placed again on another host when one is lost on the way."""
        snapshot = _fleet_snapshot(snapshot)
        fleet = self.fleet()
        last: SandboxError | None = None
        for _ in range(self.attempts):
            try:
                return fleet.sandbox_fork(snapshot=snapshot, count=count, limits=limits, purpose="product",
                                          tenant=PRODUCT_TENANT)
            except SandboxGone as exc:
                last = exc
                fleet.refresh()
        raise SandboxGone(f"no sandbox host could start the sandbox after {self.attempts} attempts: {last}")

    def snapshot_delete(self, *, snapshot: Snapshot | FleetSnapshot) -> None:
        import ray

        snapshot = _fleet_snapshot(snapshot)
        fleet = self.fleet()
        for name, built in list(snapshot.per_host.items()):
            host = fleet.hosts.get(name)
            if host is None:
                continue  # the host is gone, and its snapshots with it
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(host.actor.snapshot_delete.remote(built))
            snapshot.per_host.pop(name, None)

    def reap_orphans(self) -> int:
        return 0  # each host reaps its own node's orphans when it starts

    def snapshots_in_use(self) -> set[str]:
        return set()

    def gc(self, *, max_age_s: float) -> dict[str, int]:
        return {"sandboxes": 0, "snapshots": 0}  # each host runs its own retention pass


def _fleet_snapshot(snapshot: Snapshot | FleetSnapshot) -> FleetSnapshot:
    if not isinstance(snapshot, FleetSnapshot):
        raise SandboxError(f"the fleet backend takes snapshots it made, not a {snapshot.backend} snapshot")
    return snapshot
