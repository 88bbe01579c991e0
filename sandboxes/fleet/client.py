"""Driver side of the fleet: one host actor per Ray node, and sandboxes reached only through them.

``Fleet.start`` finds every alive node that offers the ``sandbox_slots`` custom resource (start
nodes with ``ray start --resources='{"sandbox_slots": 32}'``, or ``ray.init(resources=...)``) and
places one ``SandboxHostActor`` on it that claims all of the node's slots. ``FleetSandbox`` is a
``sandboxes.base.Sandbox``, so the agent loop and the reward code run unchanged on fleet sandboxes;
``run_tools`` sends a whole tool batch in one call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

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
from sandboxes.settings import current as current_settings

logger = logging.getLogger(__name__)

SLOT_RESOURCE = "sandbox_slots"
FORWARDED_ENV = ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "REDIS_URL", "SANDBOX_ROOT", "SANDBOX_IMAGE",
                 "SANDBOX_DOCKER_RUNTIME", "FLOWSTATE_STATE_DIR")


def _configured_sandbox_root() -> str:
    # Ray workers start in a scratch directory, so a relative default root would differ per worker.
    return str(current_settings().root.absolute())


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
    refresh_interval_s: float = 5.0
    """How often a placing client looks for hosts that joined (new nodes) or died; 0 never does."""
    follow_interval_s: float = 1.0
    """How often the process that started the fleet (``Fleet.start``: ``fleet_serve``, or an experiment
    driver that found no fleet running) places a host on every node that joined, in a background
    thread; 0 leaves it to the caller's ``refresh(place=True)``."""

    def __post_init__(self) -> None:
        if self.backend not in ("local", "docker"):
            raise ValueError(f"FleetConfig.backend={self.backend!r}; use 'local' or 'docker'")
        if not 0.05 <= self.heartbeat_interval_s <= 2.0:
            raise ValueError("FleetConfig.heartbeat_interval_s must be within 0.05..2 s")
        if self.placement_choices < 0:
            raise ValueError("FleetConfig.placement_choices must be 0 (every host) or positive")
        if self.product_reserved_slots < 0:
            raise ValueError("FleetConfig.product_reserved_slots must not be negative")
        if self.refresh_interval_s < 0:
            raise ValueError("FleetConfig.refresh_interval_s must be 0 (never) or positive")
        if self.follow_interval_s != 0 and not 0.1 <= self.follow_interval_s <= 60:
            raise ValueError("FleetConfig.follow_interval_s must be 0 (never) or within 0.1..60 s")


@dataclass(frozen=True)
class FleetSnapshot:
    """A snapshot built on some hosts (backend snapshots are host-local), and built on others on first use.

    A host that joined after the snapshot was made gets its copy the first time a sandbox is placed
    there, from ``source``/``image``/``setup_commands``/``setup_limits``; so does any host missing from
    ``per_host``.
    """

    key: str
    per_host: dict[str, Snapshot]
    source: RepoSource | None = None
    image: str | None = None
    setup_commands: tuple[str, ...] = ()
    setup_limits: SandboxLimits | None = None

    @property
    def id(self) -> str:
        """The fleet-wide id (``Snapshot.id``'s part, for callers of any backend): ``key``. A sandbox's
        own ``snapshot.id`` is the copy on its host."""
        return self.key


@dataclass
class _Host:
    name: str
    node_id: str
    slots: int
    actor: Any
    """The host's Ray actor handle (its methods are called as ``actor.method.remote(...)``)."""


class Fleet:
    """Handle on the running host actors. Create with ``Fleet.start``; ``shutdown`` ends every host.

    ``refresh`` follows the Ray cluster: hosts of dead nodes (or dead host actors) are dropped, and
    nodes that joined get a host (``place=True``, the fleet's owner) or are attached to when another
    process placed one. The owner (the process that called ``Fleet.start``) does that in a background
    thread every ``follow_interval_s``. Placement refreshes by itself every ``refresh_interval_s``
    (attaching only) and drops a host whose actor died as soon as a call to it fails, so a lost node
    stops receiving work at once. ``hosts`` and ``lost`` are replaced, never changed in place, so
    callers may iterate them while another thread refreshes.
    """

    _LOCAL_STATE = ("_rng", "_hosts_lock", "_refresh_lock", "_follower", "_stop_following")

    def __init__(self, config: FleetConfig, hosts: list[_Host]) -> None:
        if not hosts:
            raise SandboxError(
                f"no Ray node offers the {SLOT_RESOURCE!r} resource; start nodes with "
                f"--resources='{{\"{SLOT_RESOURCE}\": N}}'"
            )
        self.config = config
        self.hosts = {host.name: host for host in hosts}
        self.lost: frozenset[str] = frozenset()
        self._refreshed_at = time.monotonic()
        self._local_state_init()

    def _local_state_init(self) -> None:
        self._rng = random.Random()
        self._hosts_lock = threading.Lock()  # writers of hosts/lost (copy on write)
        self._refresh_lock = threading.Lock()  # one refresh at a time: two would place a node's host twice
        self._follower: threading.Thread | None = None
        self._stop_following = threading.Event()

    def __getstate__(self) -> dict:
        # A fleet handle travels to rollout workers (Ray pickles it): a copy attaches, it never follows.
        return {key: value for key, value in self.__dict__.items() if key not in self._LOCAL_STATE}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local_state_init()

    @staticmethod
    def _host_env(config: FleetConfig) -> dict[str, str]:
        env = {name: os.environ[name] for name in FORWARDED_ENV if os.environ.get(name)}
        env.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
        env.setdefault("SANDBOX_ROOT", _configured_sandbox_root())
        env.update(config.env)
        return env

    @staticmethod
    def _host_place(config: FleetConfig, node: dict, env: dict[str, str]) -> _Host:
        """Start the host actor of one node (all its slots, pinned to it, named after it)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node_id = node["NodeID"]
        slots = int(node["Resources"][SLOT_RESOURCE])
        name = default_host_name(node_id)
        host_config = SandboxHostConfig(
            host_name=name, slots=slots, backend=config.backend,
            heartbeat_interval_s=config.heartbeat_interval_s, heartbeat_sink=config.heartbeat_sink,
            admission_timeout_s=config.admission_timeout_s,
            product_reserved_slots=min(config.product_reserved_slots, slots - 1),
        )
        actor = SandboxHostActor.options(
            name=host_actor_name(node_id),
            namespace=config.namespace,
            resources={SLOT_RESOURCE: slots},
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            runtime_env={"env_vars": env},
        ).remote(host_config)
        return _Host(name, node_id, slots, actor)

    @classmethod
    def start(cls, config: FleetConfig | None = None) -> Fleet:
        import ray

        config = config or FleetConfig()
        env = cls._host_env(config)
        hosts = [cls._host_place(config, node, env) for node in _slot_nodes()]
        fleet = cls(config, hosts)
        # Fail here, not on first use, if a host cannot start its backend.
        ray.get([host.actor.load.remote() for host in hosts])
        if config.follow_interval_s:
            fleet.follow(interval_s=config.follow_interval_s)
        return fleet

    @classmethod
    def connect(cls, config: FleetConfig | None = None) -> Fleet:
        """Attach to host actors another process started (``manage.py fleet_serve``) in this Ray cluster."""
        config = config or FleetConfig()
        hosts = [host for node in _slot_nodes() if (host := _host_attach(config, node)) is not None]
        return cls(config, hosts)

    def follow(self, *, interval_s: float) -> None:
        """``refresh(place=True)`` every ``interval_s`` in a daemon thread until ``shutdown``.

        The owner's part: ``Fleet.start`` calls it, so nodes that join an experiment driver's own
        fleet get a host as they do under ``fleet_serve``.
        """
        if self._follower is not None:
            return

        def follow_loop() -> None:
            while not self._stop_following.wait(interval_s):
                try:
                    added, _ = self.refresh(place=True)
                except Exception:  # Ray or a node failing mid-refresh: the next round tries again
                    logger.exception("following the Ray cluster's nodes failed; trying again")
                    continue
                for name in added:
                    logger.info("sandbox host %s placed on a node that joined", name)

        self._follower = threading.Thread(target=follow_loop, name="fleet-follow", daemon=True)
        self._follower.start()

    def follow_stop(self) -> None:
        """End ``follow``'s thread (waits for a refresh in progress); ``shutdown`` calls it."""
        self._stop_following.set()
        if self._follower is not None:
            self._follower.join(timeout=180)

    def refresh(self, *, place: bool = False) -> tuple[list[str], list[str]]:
        """Follow the cluster: (hosts added, hosts dropped). ``place`` starts hosts on nodes that have none."""
        with self._refresh_lock:
            return self._refresh(place=place)

    def _refresh(self, *, place: bool) -> tuple[list[str], list[str]]:
        import ray

        self._refreshed_at = time.monotonic()
        nodes = {node["NodeID"]: node for node in _slot_nodes()}
        dropped = [name for name, host in self.hosts.items() if host.node_id not in nodes]
        for name in dropped:
            self._drop(name)
        known = {host.node_id for host in self.hosts.values()}
        added: list[_Host] = []
        env = self._host_env(self.config) if place else {}
        for node_id, node in nodes.items():
            if node_id in known:
                continue
            host = _host_attach(self.config, node)
            if host is None and place:
                host = self._host_place(self.config, node, env)
            if host is not None:
                added.append(host)
        ready = []
        for host in added:
            try:
                ray.get(host.actor.load.remote(), timeout=120)
            except (ray.exceptions.RayError, TimeoutError):
                continue  # the node went again while its host started; the next refresh retries
            with self._hosts_lock:
                self.hosts = {**self.hosts, host.name: host}
                self.lost = self.lost - {host.name}
            ready.append(host.name)
        return ready, dropped

    def _drop(self, name: str, why: BaseException | str = "") -> None:
        with self._hosts_lock:
            if name not in self.hosts:
                return
            self.hosts = {key: host for key, host in self.hosts.items() if key != name}
            self.lost = self.lost | {name}
        logger.warning("sandbox host %s dropped from placement: %s", name, why or "its node left")

    # Snapshots and placement --------------------------------------------------------------------

    def snapshot_create(self, *, source: RepoSource, image: str | None = None,
                        setup_commands: tuple[str, ...] = (), setup_limits: SandboxLimits | None = None) -> FleetSnapshot:
        """Build the snapshot on every live host (hosts that join later build it on first use)."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        refs = {name: host.actor.snapshot_create.remote(source=source, image=image, setup_commands=setup_commands,
                                                        setup_limits=setup_limits)
                for name, host in self.hosts.items()}
        per_host = {}
        for name, ref in refs.items():
            try:
                per_host[name] = ray.get(ref)
            except (ActorDiedError, ActorUnavailableError) as exc:
                self._drop(name, exc)
        if not per_host:
            raise SandboxGone(f"every sandbox host is lost ({', '.join(sorted(self.lost))})")
        return FleetSnapshot(key=next(iter(per_host.values())).id, per_host=per_host, source=source,
                             image=image, setup_commands=tuple(setup_commands), setup_limits=setup_limits)

    def _pick_host(self, count: int, purpose: str) -> _Host:
        import ray

        if (self.config.refresh_interval_s and time.monotonic() - self._refreshed_at >= self.config.refresh_interval_s
                and self._refresh_lock.acquire(blocking=False)):  # skipped while another thread refreshes
            try:
                self._refresh(place=False)
            finally:
                self._refresh_lock.release()
        asked_all = False
        while True:
            if not self.hosts:
                self.refresh()
                if not self.hosts:
                    raise SandboxGone(f"every sandbox host is lost ({', '.join(sorted(self.lost))})")
            names = list(self.hosts) if asked_all else placement_candidates(
                names=list(self.hosts), choices=self.config.placement_choices, rng=self._rng)
            refs = [self.hosts[name].actor.load.remote() for name in names]
            loads = []
            for name, ref in zip(names, refs, strict=True):
                try:
                    loads.append(HostLoad.from_dict(ray.get(ref)))
                except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError) as exc:
                    self._drop(name, exc)  # its node went: never place there again
            if not loads:
                continue
            try:
                best = host_pick(loads=loads, count=count, purpose=purpose)
            except PlacementError:
                if asked_all or len(names) == len(self.hosts):
                    raise
                asked_all = True  # the sample held only small hosts: ask them all
                continue
            return self.hosts[best.name]

    def _host_snapshot(self, host: _Host, snapshot: FleetSnapshot) -> Snapshot:
        import ray

        built = snapshot.per_host.get(host.name)
        if built is None:
            if snapshot.source is None:
                raise SandboxError(f"snapshot {snapshot.key} is not on host {host.name} and has no source to build it")
            built = cast(Snapshot, ray.get(host.actor.snapshot_create.remote(
                source=snapshot.source, image=snapshot.image, setup_commands=snapshot.setup_commands,
                setup_limits=snapshot.setup_limits)))
            snapshot.per_host[host.name] = built
        return built

    def sandbox_create(self, *, snapshot: FleetSnapshot, limits: SandboxLimits, purpose: str = "training",
                       tenant: str = "default") -> FleetSandbox:
        return self.sandbox_fork(snapshot=snapshot, count=1, limits=limits, purpose=purpose, tenant=tenant)[0]

    def sandbox_fork(self, *, snapshot: FleetSnapshot, count: int, limits: SandboxLimits,
                     purpose: str = "training", tenant: str = "default") -> list[FleetSandbox]:
        """Start ``count`` sandboxes on one host; waits in that host's queue while it is full.

        A host found dead on the way (its node left) is dropped and the request placed again on
        another, so a request is never lost with a host it had not started on.
        """
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        while True:
            host = self._pick_host(count, purpose)
            try:
                host_snapshot = self._host_snapshot(host, snapshot)
                ids = ray.get(host.actor.fork.remote(snapshot=host_snapshot, count=count, limits=limits,
                                                     purpose=purpose, tenant=tenant))
            except (ActorDiedError, ActorUnavailableError) as exc:
                self._drop(host.name, exc)
                continue
            return [FleetSandbox(host=host, sandbox_id=sandbox_id, snapshot=host_snapshot, limits=limits)
                    for sandbox_id in ids]

    def shutdown(self) -> int:
        """Destroy every sandbox on every host and stop the hosts; returns how many sandboxes went."""
        import ray

        self.follow_stop()  # first: a follower would place hosts again on the nodes emptied here
        hosts = list(self.hosts.values())
        stopping = [host.actor.shutdown.remote() for host in hosts]  # every host at once, not one after another
        destroyed = 0
        for host, ref in zip(hosts, stopping, strict=True):
            with contextlib.suppress(ray.exceptions.RayError):  # its node is gone, and its sandboxes with it
                destroyed += cast(int, ray.get(ref))
            ray.kill(host.actor)
        return destroyed


def host_actor_name(node_id: str) -> str:
    return f"sandbox-host-{node_id[:12]}"


def _slot_nodes() -> list[dict]:
    """Alive Ray nodes that offer sandbox slots."""
    import ray

    return [node for node in ray.nodes()
            if node.get("Alive") and int(node.get("Resources", {}).get(SLOT_RESOURCE, 0)) >= 1]


def _host_attach(config: FleetConfig, node: dict) -> _Host | None:
    """The running host actor of ``node`` (placed by another process), or None when it has none."""
    import ray

    try:
        actor = ray.get_actor(host_actor_name(node["NodeID"]), namespace=config.namespace)
        load = cast(dict[str, Any], ray.get(actor.load.remote(), timeout=60))
    except (ValueError, ray.exceptions.RayError, TimeoutError):
        return None
    return _Host(load["host_name"], node["NodeID"], load["slots"], actor)


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
