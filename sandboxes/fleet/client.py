"""Driver side of the fleet: one host actor per Ray node, and sandboxes reached only through them.

``Fleet.start`` finds every alive node that offers the ``sandbox_slots`` custom resource (start
nodes with ``ray start --resources='{"sandbox_slots": 32}'``, or ``ray.init(resources=...)``) and
places one ``SandboxHostActor`` on it that claims all of the node's slots. ``FleetSandbox`` is a
``sandboxes.base.Sandbox``, so the agent loop and the reward code run unchanged on fleet sandboxes;
``run_tools`` sends a whole tool batch in one call.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from sandboxes.base import (
    DirEntry,
    ExecResult,
    RepoSource,
    Sandbox,
    SandboxError,
    SandboxGone,
    SandboxLimits,
    Snapshot,
)
from sandboxes.fleet.host import SandboxHostActor, SandboxHostConfig, default_host_name
from sandboxes.fleet.placement import HostLoad, PlacementError, host_pick, placement_candidates

SLOT_RESOURCE = "sandbox_slots"
FORWARDED_ENV = ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "REDIS_URL", "SANDBOX_ROOT", "SANDBOX_IMAGE",
                 "FLOWSTATE_STATE_DIR")


def _configured_sandbox_root() -> str:
    # Ray workers start in a scratch directory, so a relative default root would differ per worker.
    try:
        from django.conf import settings

        if settings.configured:
            return str(settings.SANDBOX_ROOT)
    except ImportError:
        pass
    return os.path.abspath(os.environ.get("SANDBOX_ROOT") or "var/sandboxes")


@dataclass(frozen=True)
class FleetConfig:
    """How the fleet places hosts and what each host runs."""

    backend: str = "local"
    """Sandbox backend every host runs (``local`` or ``docker``)."""
    heartbeat_interval_s: float = 1.0
    """Seconds between host heartbeats (at most 2)."""
    heartbeat_sink: str | None = "webapp.fleet.heartbeat_sink.heartbeat_record"
    """Where hosts send heartbeats; ``None`` keeps them in the actors only."""
    admission_timeout_s: float | None = None
    """Longest a create/fork waits for a slot before failing; ``None`` waits."""
    namespace: str = "flowstate"
    """Ray namespace of the named host actors."""
    placement_choices: int = 8
    """Hosts asked for their load per request (the least loaded wins); 0 asks every host."""
    product_reserved_slots: int = 0
    """Slots per host that training may not take, kept free for product requests."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment for host actors, on top of the forwarded DJANGO/DATABASE/REDIS/SANDBOX variables."""

    def __post_init__(self) -> None:
        if self.backend not in ("local", "docker"):
            raise ValueError(f"FleetConfig.backend={self.backend!r}; use 'local' or 'docker'")
        if not 0.05 <= self.heartbeat_interval_s <= 2.0:
            raise ValueError("FleetConfig.heartbeat_interval_s must be within 0.05..2 s")
        if self.placement_choices < 0:
            raise ValueError("FleetConfig.placement_choices must be 0 (every host) or positive")
        if self.product_reserved_slots < 0:
            raise ValueError("FleetConfig.product_reserved_slots must not be negative")


@dataclass(frozen=True)
class FleetSnapshot:
    """A snapshot built on every host (backend snapshots are host-local directories)."""

    key: str
    per_host: dict[str, Snapshot]


@dataclass
class _Host:
    name: str
    node_id: str
    slots: int
    actor: object


class Fleet:
    """Handle on the running host actors. Create with ``Fleet.start``; ``shutdown`` ends every host."""

    def __init__(self, config: FleetConfig, hosts: list[_Host]) -> None:
        if not hosts:
            raise SandboxError(
                f"no Ray node offers the {SLOT_RESOURCE!r} resource; start nodes with "
                f"--resources='{{\"{SLOT_RESOURCE}\": N}}'"
            )
        self.config = config
        self.hosts = {host.name: host for host in hosts}
        self._rng = random.Random()

    @classmethod
    def start(cls, config: FleetConfig | None = None) -> Fleet:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        config = config or FleetConfig()
        env = {name: os.environ[name] for name in FORWARDED_ENV if os.environ.get(name)}
        env.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
        env.setdefault("SANDBOX_ROOT", _configured_sandbox_root())
        env.update(config.env)
        hosts = []
        for node in ray.nodes():
            slots = int(node.get("Resources", {}).get(SLOT_RESOURCE, 0))
            if not node.get("Alive") or slots < 1:
                continue
            node_id = node["NodeID"]
            name = default_host_name(node_id)
            host_config = SandboxHostConfig(
                host_name=name, slots=slots, backend=config.backend,
                heartbeat_interval_s=config.heartbeat_interval_s, heartbeat_sink=config.heartbeat_sink,
                admission_timeout_s=config.admission_timeout_s,
                product_reserved_slots=min(config.product_reserved_slots, slots - 1),
            )
            actor = SandboxHostActor.options(
                name=f"sandbox-host-{node_id[:12]}",
                namespace=config.namespace,
                resources={SLOT_RESOURCE: slots},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
                runtime_env={"env_vars": env},
            ).remote(host_config)
            hosts.append(_Host(name, node_id, slots, actor))
        fleet = cls(config, hosts)
        # Fail here, not on first use, if a host cannot start its backend.
        ray.get([host.actor.load.remote() for host in hosts])
        return fleet

    @classmethod
    def connect(cls, config: FleetConfig | None = None) -> Fleet:
        """Attach to host actors another process started (``manage.py fleet_serve``) in this Ray cluster."""
        import ray

        config = config or FleetConfig()
        hosts = []
        for node in ray.nodes():
            if not node.get("Alive") or node.get("Resources", {}).get(SLOT_RESOURCE, 0) < 1:
                continue
            try:
                actor = ray.get_actor(f"sandbox-host-{node['NodeID'][:12]}", namespace=config.namespace)
            except ValueError:
                continue
            load = ray.get(actor.load.remote())
            hosts.append(_Host(load["host_name"], node["NodeID"], load["slots"], actor))
        return cls(config, hosts)

    # Snapshots and placement --------------------------------------------------------------------

    def snapshot_create(self, *, source: RepoSource, image: str | None = None,
                        setup_commands: tuple[str, ...] = (), setup_limits: SandboxLimits | None = None) -> FleetSnapshot:
        import ray

        names = list(self.hosts)
        snapshots = ray.get([
            self.hosts[name].actor.snapshot_create.remote(source=source, image=image, setup_commands=setup_commands,
                                                         setup_limits=setup_limits)
            for name in names
        ])
        return FleetSnapshot(key=snapshots[0].id, per_host=dict(zip(names, snapshots, strict=True)))

    def _pick_host(self, count: int, purpose: str) -> _Host:
        import ray

        names = placement_candidates(names=list(self.hosts), choices=self.config.placement_choices, rng=self._rng)
        while True:
            loads = ray.get([self.hosts[name].actor.load.remote() for name in names])
            try:
                best = host_pick(loads=[HostLoad.from_dict(load) for load in loads], count=count, purpose=purpose)
            except PlacementError:
                if len(names) == len(self.hosts):
                    raise
                names = list(self.hosts)  # the sample held only small hosts: ask them all
                continue
            return self.hosts[best.name]

    def sandbox_create(self, *, snapshot: FleetSnapshot, limits: SandboxLimits, purpose: str = "training",
                       tenant: str = "default") -> FleetSandbox:
        return self.sandbox_fork(snapshot=snapshot, count=1, limits=limits, purpose=purpose, tenant=tenant)[0]

    def sandbox_fork(self, *, snapshot: FleetSnapshot, count: int, limits: SandboxLimits,
                     purpose: str = "training", tenant: str = "default") -> list[FleetSandbox]:
        """Start ``count`` sandboxes on one host; waits in that host's queue while it is full."""
        import ray

        host = self._pick_host(count, purpose)
        host_snapshot = snapshot.per_host[host.name]
        ids = ray.get(host.actor.fork.remote(snapshot=host_snapshot, count=count, limits=limits,
                                             purpose=purpose, tenant=tenant))
        return [FleetSandbox(host=host, sandbox_id=sandbox_id, snapshot=host_snapshot, limits=limits)
                for sandbox_id in ids]

    def shutdown(self) -> int:
        """Destroy every sandbox on every host and stop the hosts; returns how many sandboxes went."""
        import ray

        destroyed = sum(ray.get([host.actor.shutdown.remote() for host in self.hosts.values()]))
        for host in self.hosts.values():
            ray.kill(host.actor)
        return destroyed


class FleetSandbox(Sandbox):
    """A sandbox living on a fleet host; every method is one call to that host."""

    def __init__(self, *, host: _Host, sandbox_id: str, snapshot: Snapshot, limits: SandboxLimits) -> None:
        self.id = sandbox_id
        self.snapshot = snapshot
        self.limits = limits
        self.host_name = host.name
        self._actor = host.actor

    def _call(self, method: str, *args, **kwargs):
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        try:
            return ray.get(getattr(self._actor, method).remote(self.id, *args, **kwargs))
        except (ActorDiedError, ActorUnavailableError) as exc:
            # An infrastructure failure, not the agent's doing: callers must not score it as a zero reward.
            raise SandboxGone(f"sandbox {self.id} was lost with its host {self.host_name}: {type(exc).__name__}") from exc

    def exec(self, command: str, *, timeout_s: float | None = None) -> ExecResult:
        return self._call("exec", command, timeout_s)

    def run_tools(self, calls: list) -> list:
        """Run a whole batch of ``sandboxes.tools.ToolCall`` on the host in one round trip."""
        return self._call("run_tools", list(calls))

    def read_bytes(self, path: str) -> bytes:
        return self._call("read_bytes", path)

    def write_bytes(self, path: str, data: bytes) -> None:
        self._call("write_bytes", path, bytes(data))

    def list_dir(self, path: str) -> list[DirEntry]:
        return self._call("list_dir", path)

    def diff(self) -> str:
        return self._call("diff")

    def reset(self) -> None:
        self._call("reset")

    def destroy(self) -> None:
        self._call("destroy")
