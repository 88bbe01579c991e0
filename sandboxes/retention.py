"""Retention of snapshot trees: delete those older than a bound that no live sandbox uses.

A snapshot is in use (reference-counted by the backends' own records: the local backend's registry,
Docker's container labels) while any live sandbox was created from it; those are never deleted,
whatever their age. Half-built ``.partial`` staging directories older than the bound go too.
Snapshot trees are untrusted (archives, setup commands wrote them): they are deleted by
``safe_tree.remove_tree``, and an entry that cannot be deleted is logged and skipped, so one bad
entry never stops the collection of the others.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

from sandboxes.safe_tree import remove_tree

logger = logging.getLogger(__name__)


def snapshots_gc(*, snapshots_dir: Path, max_age_s: float, in_use: set[str], now: float | None = None) -> list[str]:
    """Remove snapshot directories under ``snapshots_dir`` older than ``max_age_s`` and not in ``in_use``."""
    if max_age_s <= 0:
        raise ValueError("max_age_s must be positive")
    now = time.time() if now is None else now
    removed: list[str] = []
    if not snapshots_dir.is_dir():
        return removed
    for name in sorted(os.listdir(snapshots_dir)):
        snapshot_id = name[1:].removesuffix(".partial") if name.startswith(".") else name
        entry = snapshots_dir / name
        try:
            info = entry.lstat()
        except FileNotFoundError:
            continue
        if snapshot_id in in_use or not stat.S_ISDIR(info.st_mode) or now - info.st_mtime < max_age_s:
            continue
        try:
            remove_tree(entry)
        except Exception:  # one entry must never stop the collection of the others
            logger.warning("snapshot gc: could not remove %s; skipped, retried at the next pass", entry, exc_info=True)
            continue
        removed.append(snapshot_id)
    return removed
