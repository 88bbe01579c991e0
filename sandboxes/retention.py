"""Retention of snapshot trees: delete those older than a bound that no live sandbox uses.

A snapshot is in use (reference-counted by the backends' own records: the local backend's registry,
Docker's container labels) while any live sandbox was created from it; those are never deleted,
whatever their age. Half-built ``.partial`` staging directories older than the bound go too.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path


def snapshots_gc(*, snapshots_dir: Path, max_age_s: float, in_use: set[str], now: float | None = None) -> list[str]:
    """Remove snapshot directories under ``snapshots_dir`` older than ``max_age_s`` and not in ``in_use``."""
    if max_age_s <= 0:
        raise ValueError("max_age_s must be positive")
    now = time.time() if now is None else now
    removed: list[str] = []
    if not snapshots_dir.is_dir():
        return removed
    for entry in sorted(snapshots_dir.iterdir()):
        name = entry.name
        snapshot_id = name[1:].removesuffix(".partial") if name.startswith(".") else name
        if snapshot_id in in_use or not entry.is_dir() or entry.is_symlink():
            continue
        try:
            age = now - entry.stat().st_mtime
        except FileNotFoundError:
            continue
        if age < max_age_s:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(snapshot_id)
    return removed
