"""Started sandboxes kept ready per (snapshot, limits), shared by the local and Docker backends.

A claim takes the oldest fresh sandbox of its pair and wakes a background thread that starts
replacements one at a time, so a claim during a refill already gets the first new one. Warm
sandboxes are started with ``max_idle_s`` added to their lifetime: one claimed within its idle
window still has its whole lifetime ahead of it (the claim restarts its clock), and one that waited
longer is destroyed and replaced.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sandboxes.base import SandboxError, SandboxLimits, Snapshot

if TYPE_CHECKING:
    from sandboxes.backend_core import CoreSandbox

PoolKey = tuple[str, SandboxLimits]
Starter = Callable[[Snapshot, SandboxLimits, float], "CoreSandbox"]
"""start(snapshot, limits, extra_lifetime_s) -> a started sandbox."""


class WarmPool:
    """The warm sandboxes of one backend instance and the thread that refills them."""

    def __init__(self, *, start: Starter, size: int, max_idle_s: float, remember_claimed: bool,
                 thread_name: str) -> None:
        self._start = start
        self._size = size
        self._max_idle_s = max_idle_s
        self._remember_claimed = remember_claimed
        self._thread_name = thread_name
        self._entries: dict[PoolKey, list[tuple[float, CoreSandbox]]] = {}
        self._wanted: dict[PoolKey, tuple[Snapshot, int]] = {}
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._refill_lock = threading.Lock()  # one refill at a time, or two would both fill the gap
        self._thread: threading.Thread | None = None
        self._closed = False

    def want(self, *, snapshot: Snapshot, limits: SandboxLimits, count: int | None, wait: bool) -> None:
        """Keep ``count`` (default: the pool size) sandboxes ready for the pair; ``wait`` fills it now."""
        wanted = self._size if count is None else count
        if not isinstance(wanted, int) or isinstance(wanted, bool) or not 0 <= wanted <= 64:
            raise ValueError(f"warm pool size must be between 0 and 64, got {wanted!r}")
        if count is None and wanted == 0:
            return
        key = (snapshot.id, limits)
        with self._lock:
            self._wanted[key] = (snapshot, wanted)
            self._entries.setdefault(key, [])
        if wait:
            self.refill_once()
        self._ensure_thread()
        self._wakeup.set()

    def count(self, *, snapshot: Snapshot, limits: SandboxLimits) -> int:
        with self._lock:
            return len(self._entries.get((snapshot.id, limits), ()))

    def claim(self, *, snapshot: Snapshot, limits: SandboxLimits) -> CoreSandbox | None:
        """A ready sandbox of the pair (its lifetime clock restarted), or None."""
        key = (snapshot.id, limits)
        claimed, stale = None, []
        with self._lock:
            if self._remember_claimed and self._size > 0 and key not in self._wanted:
                self._wanted[key] = (snapshot, self._size)
            entries = self._entries.get(key)
            while entries:
                started, sandbox = entries.pop(0)
                if time.time() - started < self._max_idle_s and sandbox._warm_usable():
                    claimed = sandbox
                    break
                stale.append(sandbox)
            refill = key in self._wanted
        for sandbox in stale:
            sandbox.destroy()
        if refill:
            self._ensure_thread()
            self._wakeup.set()
        if claimed is not None:
            claimed._restart_clock()
        return claimed

    def drop_snapshot(self, snapshot_id: str) -> None:
        """Forget every pair of the snapshot and destroy its warm sandboxes."""
        with self._lock:
            doomed = []
            for key in [k for k in {*self._wanted, *self._entries} if k[0] == snapshot_id]:
                self._wanted.pop(key, None)
                doomed += [sandbox for _, sandbox in self._entries.pop(key, [])]
        for sandbox in doomed:
            sandbox.destroy()

    def close(self) -> None:
        """Stop refilling and destroy the idle sandboxes (claimed ones are left alone)."""
        self._closed = True
        self._wakeup.set()
        with self._lock:
            entries, self._entries, self._wanted = self._entries, {}, {}
        for pool in entries.values():
            for _, sandbox in pool:
                sandbox.destroy()

    def refill_once(self) -> None:
        """Replace stale sandboxes and start the missing ones of every wanted pair."""
        with self._refill_lock:
            with self._lock:
                wanted = dict(self._wanted)
            for key, (snapshot, size) in wanted.items():
                self._refill_pair(key, snapshot, size)

    def _refill_pair(self, key: PoolKey, snapshot: Snapshot, size: int) -> None:
        with self._lock:
            now = time.time()
            entries = self._entries.setdefault(key, [])
            stale = [entry for entry in entries if now - entry[0] >= self._max_idle_s]
            entries[:] = [entry for entry in entries if entry not in stale]
            missing = size - len(entries)
        for _, sandbox in stale:
            sandbox.destroy()
        for _ in range(missing):
            if not Path(snapshot.location).is_dir():
                return
            sandbox = self._start(snapshot, key[1], self._max_idle_s)
            with self._lock:
                if key in self._wanted and not self._closed:
                    self._entries.setdefault(key, []).append((time.time(), sandbox))
                    continue
            sandbox.destroy()
            return

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self._thread_name, daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while not self._closed:
            self._wakeup.wait(timeout=5.0)
            self._wakeup.clear()
            if self._closed:
                return
            try:
                self.refill_once()
            except SandboxError:
                time.sleep(1.0)
