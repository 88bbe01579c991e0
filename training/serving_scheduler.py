"""Fair admission of many users' requests into one continuous-batching engine.

The engine admits waiting sequences first come, first served into its batch slots, so one user asking for
many long completions at once would hold every slot and everyone else would wait until those finish. The
serving worker (training.serving.ChatModel) therefore keeps requests here and hands the engine only as many
as it has free slots, choosing each time:

- among owners with requests waiting, the one holding the fewest slots, ties going to the one served least
  recently (round-robin), so slots are shared out evenly and no owner's queue is passed over for ever;
- and keeping the last ``reserved_slots`` free slots for owners holding none: an owner already generating
  cannot take them, so a newcomer's request starts at the next engine step instead of waiting for another
  owner's generations to end. A lone owner thus uses ``max_slots - reserved_slots`` slots; 0 (the default,
  for in-process callers such as RL loops, which are one owner) keeps every slot usable by anyone.

Not thread-safe: only the serving worker thread touches it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_NOBODY = object()


class FairAdmission(Generic[T]):
    """Per-owner queues of waiting requests and the count of engine slots each owner holds."""

    def __init__(self, max_slots: int, *, reserved_slots: int = 0) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}.")
        self.max_slots = max_slots
        self.reserved_slots = reserved_slots
        self._waiting: OrderedDict[Hashable, deque[T]] = OrderedDict()
        """Owners with requests waiting, least recently served first."""
        self._holding: Counter[Hashable] = Counter()

    @property
    def reserved_slots(self) -> int:
        return self._reserved

    @reserved_slots.setter
    def reserved_slots(self, value: int) -> None:
        # At least one slot stays usable by an owner already generating, or a lone owner could never run two.
        if value < 0:
            raise ValueError(f"reserved_slots must be >= 0, got {value}.")
        self._reserved = min(value, self.max_slots - 1)

    def add(self, owner: Hashable, request: T) -> None:
        self._waiting.setdefault(owner, deque()).append(request)

    def discard(self, owner: Hashable, request: T) -> bool:
        """Drop a request that is still waiting; False if it is not here (admitted or unknown)."""
        queue = self._waiting.get(owner)
        if queue is None:
            return False
        for index, waiting in enumerate(queue):
            if waiting is request:
                del queue[index]
                if not queue:
                    del self._waiting[owner]
                return True
        return False

    def released(self, owner: Hashable) -> None:
        """One of `owner`'s admitted requests finished or was cancelled: its slot is free."""
        if self._holding[owner] <= 1:
            self._holding.pop(owner, None)
        else:
            self._holding[owner] -= 1

    def release_all(self) -> None:
        self._holding.clear()

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def holding(self, owner: Hashable) -> int:
        return self._holding.get(owner, 0)

    def admit(self) -> Iterator[tuple[Hashable, T]]:
        """(owner, request) pairs to hand the engine now, each counted as holding a slot from here on."""
        while True:
            free = self.max_slots - sum(self._holding.values())
            owner = self._next_owner(free)
            if owner is _NOBODY:
                return
            queue = self._waiting.pop(owner)  # re-inserted last: served most recently
            request = queue.popleft()
            if queue:
                self._waiting[owner] = queue
            self._holding[owner] += 1
            yield owner, request

    def _next_owner(self, free: int) -> Hashable:
        """The owner to serve next, or _NOBODY (None is an owner: in-process callers)."""
        if free <= 0:
            return _NOBODY
        best, best_held = _NOBODY, 0
        for owner in self._waiting:  # least recently served first, so a strict < keeps the round-robin order
            held = self._holding.get(owner, 0)
            if held and free <= self._reserved:
                continue
            if best is _NOBODY or held < best_held:
                best, best_held = owner, held
        return best

    def drain(self) -> list[T]:
        """Every waiting request (the worker is shutting down); the queues are empty afterwards."""
        requests = [request for queue in self._waiting.values() for request in queue]
        self._waiting.clear()
        return requests
