"""Retention: old snapshots go, unless a live sandbox was created from them (every backend)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.sandboxes.conftest import TEST_LIMITS


def _age(snapshot, days: float) -> None:
    old = time.time() - days * 24 * 3600
    os.utime(Path(snapshot.location).parent, (old, old))


def test_gc_deletes_old_unused_snapshots_and_keeps_those_in_use(sandbox_backend, make_snapshot):
    unused = make_snapshot({"a.txt": "a\n"})
    used = make_snapshot({"b.txt": "b\n"})
    recent = make_snapshot({"c.txt": "c\n"})
    _age(unused, 10)
    _age(used, 10)
    box = sandbox_backend.sandbox_create(snapshot=used, limits=TEST_LIMITS)
    try:
        assert used.id in sandbox_backend.snapshots_in_use()
        counts = sandbox_backend.gc(max_age_s=3 * 24 * 3600)
        assert counts["snapshots"] == 1
        assert not Path(unused.location).exists()
        assert Path(used.location).is_dir() and Path(recent.location).is_dir()
        assert box.exec("cat b.txt").stdout == "b\n"
    finally:
        box.destroy()
    # A warm pool may keep sandboxes of `used` alive; once none is, the next pass deletes it.
    if used.id not in sandbox_backend.snapshots_in_use():
        sandbox_backend.gc(max_age_s=3 * 24 * 3600)
        assert not Path(used.location).exists()
    assert Path(recent.location).is_dir()
