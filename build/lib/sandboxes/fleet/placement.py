"""Which host a create/fork request goes to: a pure function of the hosts' loads.

The fleet client (``sandboxes.fleet.client.Fleet``) asks a few hosts for their load and calls
``host_pick``; ``benchmarks/sim_fleet.py`` calls the same two functions on a simulated fleet. Asking
every host costs one round trip per host per request, which does not scale to a thousand hosts, so
``placement_candidates`` samples ``choices`` hosts (the "power of d choices" rule: picking the
least loaded of a few random hosts keeps queues nearly as even as asking all of them).

Scores are purpose-aware because admission is: a product request only queues behind other product
requests (and may use the slots reserved for product), a training request queues behind everything.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from sandboxes.base import SandboxError

PLACEMENT_PURPOSES = ("product", "training")


class PlacementError(SandboxError):
    """No host can ever take the request (it is bigger than every host)."""


@dataclass
class HostLoad:
    """A host's routing figures, as ``SandboxHost.load`` reports them."""

    name: str
    slots: int
    free: int
    waiting: int = 0
    product_waiting: int = 0
    reserved: int = 0
    """Slots kept for product requests (``product_reserved_slots``)."""

    @classmethod
    def from_dict(cls, data: dict) -> HostLoad:
        return cls(name=data["host_name"], slots=data["slots"], free=data["free"], waiting=data.get("waiting", 0),
                   product_waiting=data.get("product_waiting", 0), reserved=data.get("reserved", 0))


def placement_candidates(*, names: Sequence[str], choices: int, rng: random.Random) -> list[str]:
    """The hosts to ask for their load: all of them when ``choices`` is 0 or covers the fleet, else a sample."""
    if choices < 0:
        raise ValueError(f"choices={choices} must be 0 (ask every host) or positive")
    if choices == 0 or choices >= len(names):
        return list(names)
    return rng.sample(list(names), choices)


def host_pick(*, loads: Sequence[HostLoad], count: int, purpose: str) -> HostLoad:
    """The host where ``count`` sandboxes for ``purpose`` will start soonest (ties: the first given)."""
    if purpose not in PLACEMENT_PURPOSES:
        raise ValueError(f"purpose={purpose!r}; use 'product' or 'training'")
    if count < 1:
        raise ValueError(f"count must be a positive integer, got {count!r}")
    best: HostLoad | None = None
    best_score = 0.0
    for load in loads:
        if purpose == "product":
            if load.slots < count:
                continue
            score = (load.free - load.product_waiting) / load.slots
        else:
            if load.slots - load.reserved < count:
                continue
            score = (load.free - load.reserved - load.waiting) / load.slots
        if best is None or score > best_score:
            best, best_score = load, score
    if best is None:
        biggest = max((load.slots for load in loads), default=0)
        raise PlacementError(f"{count} sandboxes exceed the largest host ({biggest} slots); split the request")
    return best
