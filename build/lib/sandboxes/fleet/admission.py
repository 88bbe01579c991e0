"""Admission control for one sandbox host: when every slot is taken, requests wait instead of failing.

Two priority classes: product (cloud-agent) requests are always admitted before training requests.
Within a class, tenants (a task owner, an experiment) take turns, so one experiment's burst of forks
cannot starve another's; each tenant's own requests stay first-in first-out. A request for several
slots (a fork) waits until all of them are free, and nothing behind it in its class overtakes it,
so large forks are never starved by a stream of small ones.

``product_reserved_slots`` keeps a few slots of the host for product requests only: training is
admitted while more than that many slots are free, so a product request arriving in the middle of a
training burst finds a free slot instead of waiting for a rollout to end.

The queue itself is synchronous and takes its clock as an argument (``enqueue``, ``release``,
``cancel``), so ``benchmarks/sim_fleet.py`` drives this very class on a simulated clock;
``acquire`` is the asyncio front the host actor uses.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from sandboxes.fleet.heartbeat import QueueMetrics

Purpose = Literal["product", "training"]
PURPOSES: tuple[Purpose, ...] = ("product", "training")


class AdmissionRejected(RuntimeError):
    """The request can never be admitted (bigger than the host) or waited past its deadline."""


@dataclass(frozen=True)
class AdmissionConfig:
    """Capacity and queue bounds of one host."""

    slots: int
    """Sandboxes that may run at once (the node's ``sandbox_slots`` Ray resource)."""
    max_waiting: int = 10_000
    """Requests allowed to wait at once; past it new requests are rejected with a clear error."""
    wait_samples: int = 1000
    """Recent admission waits kept for the p50/p95 queue metrics."""
    product_reserved_slots: int = 0
    """Slots training may not take: kept free for product requests arriving during a training burst."""

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"AdmissionConfig.slots={self.slots} must be at least 1")
        if self.max_waiting < 1:
            raise ValueError("AdmissionConfig.max_waiting must be at least 1")
        if self.wait_samples < 1:
            raise ValueError("AdmissionConfig.wait_samples must be at least 1")
        if not 0 <= self.product_reserved_slots < self.slots:
            raise ValueError(
                f"AdmissionConfig.product_reserved_slots={self.product_reserved_slots} must be within "
                f"0..{self.slots - 1} so training can still run"
            )


@dataclass(eq=False)
class AdmissionTicket:
    """One waiting request; ``on_grant`` runs (outside the lock) when its slots are granted."""

    count: int
    purpose: Purpose
    tenant: str
    enqueued_at: float
    on_grant: Callable[[], None]
    order: int = 0
    granted: bool = False
    cancelled: bool = False


class AdmissionController:
    """Slot accounting with a fair, prioritised wait queue.

    ``acquire`` is for one asyncio event loop; ``enqueue``/``release``/``cancel`` are the same queue
    without asyncio, for a caller with its own loop or clock (the fleet simulation).
    """

    def __init__(self, config: AdmissionConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._free = config.slots
        # purpose -> tenant -> FIFO of waiters; OrderedDict order is the round-robin turn order.
        self._queues: dict[Purpose, OrderedDict[str, deque[AdmissionTicket]]] = {p: OrderedDict() for p in PURPOSES}
        self._waiting = {p: 0 for p in PURPOSES}
        self._waits: deque[float] = deque(maxlen=config.wait_samples)
        self._admitted_total = 0
        self._rejected_total = 0
        self._sequence = itertools.count()
        # The event loop changes the queues; the heartbeat thread reads metrics at the same time.
        self._lock = threading.Lock()

    @property
    def free_slots(self) -> int:
        return self._free

    @property
    def used_slots(self) -> int:
        return self.config.slots - self._free

    @property
    def waiting(self) -> int:
        return self._waiting["product"] + self._waiting["training"]

    @property
    def product_waiting(self) -> int:
        return self._waiting["product"]

    def enqueue(self, *, purpose: Purpose, tenant: str, count: int = 1,
                on_grant: Callable[[], None]) -> AdmissionTicket:
        """Queue a request for ``count`` slots; ``on_grant`` is called once they are granted (maybe now)."""
        if purpose not in PURPOSES:
            raise ValueError(f"purpose={purpose!r}; use 'product' or 'training'")
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a positive integer, got {count!r}")
        if count > self.config.slots:
            raise AdmissionRejected(
                f"{count} sandboxes exceed this host's {self.config.slots} slots; split the request across hosts"
            )
        if purpose == "training" and count > self.config.slots - self.config.product_reserved_slots:
            raise AdmissionRejected(
                f"{count} training sandboxes exceed the {self.config.slots - self.config.product_reserved_slots} "
                "slots training may use on this host; split the request across hosts"
            )
        if self.waiting >= self.config.max_waiting:
            self._rejected_total += 1
            raise AdmissionRejected(f"{self.config.max_waiting} requests are already waiting; retry later")
        ticket = AdmissionTicket(count, purpose, tenant, self._clock(), on_grant, next(self._sequence))
        with self._lock:
            self._queues[purpose].setdefault(tenant, deque()).append(ticket)
            self._waiting[purpose] += 1
        self._dispatch()
        return ticket

    def cancel(self, ticket: AdmissionTicket) -> bool:
        """Withdraw a waiting request; False when it was already granted (the caller owns its slots)."""
        if ticket.granted:
            return False
        ticket.cancelled = True
        self._remove(ticket)
        self._dispatch()
        return True

    async def acquire(self, *, purpose: Purpose, tenant: str, count: int = 1, timeout_s: float | None = None) -> None:
        """Wait until ``count`` slots are granted to this request; raises AdmissionRejected on timeout."""
        future = asyncio.get_running_loop().create_future()

        def grant() -> None:
            if not future.done():
                future.set_result(None)

        ticket = self.enqueue(purpose=purpose, tenant=tenant, count=count, on_grant=grant)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if not self.cancel(ticket):
                # Granted in the same instant it timed out: hand the slots back.
                self.release(count=count)
            if isinstance(exc, asyncio.CancelledError):
                raise
            self._rejected_total += 1
            raise AdmissionRejected(f"no sandbox slot became free within {timeout_s:g}s") from None

    def release(self, *, count: int = 1) -> None:
        if count < 1 or self._free + count > self.config.slots:
            raise ValueError(f"releasing {count} slots would exceed capacity {self.config.slots}")
        with self._lock:
            self._free += count
        self._dispatch()

    def _remove(self, ticket: AdmissionTicket) -> None:
        with self._lock:
            tenants = self._queues[ticket.purpose]
            queue = tenants.get(ticket.tenant)
            if queue is not None and ticket in queue:
                queue.remove(ticket)
                self._waiting[ticket.purpose] -= 1
                if not queue:
                    del tenants[ticket.tenant]

    def _dispatch(self) -> None:
        with self._lock:
            granted = self._grant_locked()
        for ticket in granted:
            ticket.on_grant()

    def _grant_locked(self) -> list[AdmissionTicket]:
        granted: list[AdmissionTicket] = []
        now = self._clock()
        for purpose in PURPOSES:
            tenants = self._queues[purpose]
            reserved = self.config.product_reserved_slots if purpose == "training" else 0
            while tenants:
                tenant, queue = next(iter(tenants.items()))
                head = queue[0]
                if head.count > self._free - reserved:
                    # Strict order inside the class: the head waits and nothing overtakes it.
                    return granted
                queue.popleft()
                self._waiting[purpose] -= 1
                # Round robin: the tenant just served moves to the back of its class.
                del tenants[tenant]
                if queue:
                    tenants[tenant] = queue
                self._free -= head.count
                self._admitted_total += 1
                self._waits.append(now - head.enqueued_at)
                head.granted = True
                granted.append(head)
            if self._waiting[purpose]:
                return granted
        return granted

    def metrics(self) -> QueueMetrics:
        with self._lock:
            waits = sorted(self._waits)
            waiting = dict(self._waiting)
            admitted = self._admitted_total

        def percentile(q: float) -> float:
            if not waits:
                return 0.0
            return waits[min(len(waits) - 1, int(q * len(waits)))]

        return QueueMetrics(
            product_waiting=waiting["product"],
            training_waiting=waiting["training"],
            admitted_total=admitted,
            wait_p50_s=percentile(0.5),
            wait_p95_s=percentile(0.95),
        )

    @property
    def rejected_total(self) -> int:
        return self._rejected_total
