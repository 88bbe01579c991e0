"""Admission control for one sandbox host: when every slot is taken, requests wait instead of failing.

Two priority classes: product (cloud-agent) requests are always admitted before training requests.
Within a class, tenants (a task owner, an experiment) take turns, so one experiment's burst of forks
cannot starve another's; each tenant's own requests stay first-in first-out. A request for several
slots (a fork) waits until all of them are free, and nothing behind it in its class overtakes it,
so large forks are never starved by a stream of small ones.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
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

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"AdmissionConfig.slots={self.slots} must be at least 1")
        if self.max_waiting < 1:
            raise ValueError("AdmissionConfig.max_waiting must be at least 1")
        if self.wait_samples < 1:
            raise ValueError("AdmissionConfig.wait_samples must be at least 1")


@dataclass
class _Waiter:
    count: int
    purpose: Purpose
    tenant: str
    enqueued_at: float
    future: asyncio.Future = field(repr=False)
    order: int = 0


class AdmissionController:
    """Slot accounting with a fair, prioritised wait queue. Use from one asyncio event loop."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._free = config.slots
        # purpose -> tenant -> FIFO of waiters; OrderedDict order is the round-robin turn order.
        self._queues: dict[Purpose, OrderedDict[str, deque[_Waiter]]] = {p: OrderedDict() for p in PURPOSES}
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

    async def acquire(self, *, purpose: Purpose, tenant: str, count: int = 1, timeout_s: float | None = None) -> None:
        """Wait until ``count`` slots are granted to this request; raises AdmissionRejected on timeout."""
        if purpose not in PURPOSES:
            raise ValueError(f"purpose={purpose!r}; use 'product' or 'training'")
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a positive integer, got {count!r}")
        if count > self.config.slots:
            raise AdmissionRejected(
                f"{count} sandboxes exceed this host's {self.config.slots} slots; split the request across hosts"
            )
        if sum(self._waiting.values()) >= self.config.max_waiting:
            self._rejected_total += 1
            raise AdmissionRejected(f"{self.config.max_waiting} requests are already waiting; retry later")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(count, purpose, tenant, time.monotonic(), loop.create_future(), next(self._sequence))
        with self._lock:
            self._queues[purpose].setdefault(tenant, deque()).append(waiter)
            self._waiting[purpose] += 1
        self._dispatch()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if waiter.future.done() and not waiter.future.cancelled():
                # Granted in the same instant it timed out: hand the slots back.
                self.release(count=count)
            else:
                waiter.future.cancel()
                self._remove(waiter)
                self._dispatch()
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

    def _remove(self, waiter: _Waiter) -> None:
        with self._lock:
            self._remove_locked(waiter)

    def _remove_locked(self, waiter: _Waiter) -> None:
        tenants = self._queues[waiter.purpose]
        queue = tenants.get(waiter.tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self._waiting[waiter.purpose] -= 1
            if not queue:
                del tenants[waiter.tenant]

    def _dispatch(self) -> None:
        with self._lock:
            granted = self._grant_locked()
        for waiter in granted:
            waiter.future.set_result(None)

    def _grant_locked(self) -> list[_Waiter]:
        granted: list[_Waiter] = []
        for purpose in PURPOSES:
            tenants = self._queues[purpose]
            while tenants:
                tenant, queue = next(iter(tenants.items()))
                head = queue[0]
                if head.count > self._free:
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
                self._waits.append(time.monotonic() - head.enqueued_at)
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
