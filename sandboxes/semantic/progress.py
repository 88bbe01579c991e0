"""Progress of base-index builds, readable from any process (the web server, ``/metrics``).

The process that builds a snapshot's index writes ``<index directory>.progress.json`` beside it
(at most every half second); readers list those files. A build whose file stops moving for
``STALE_AFTER_S`` while not finished is reported as ``stalled`` (its process died or hangs).

States: ``queued`` (started, chunking the snapshot or waiting for an encoding slot: BM25 answers),
``building`` (encoding), ``ready``, ``failed``, ``cancelled`` (its task ended first) and ``stalled``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

STALE_AFTER_S = 300.0
_WRITE_EVERY_S = 0.5
STATES = ("queued", "building", "ready", "failed", "cancelled", "stalled")
ACTIVE_STATES = ("queued", "building")


class IndexBuildCancelled(Exception):
    """A build was cancelled (its snapshot's task ended before the index was ready)."""


@dataclass(frozen=True)
class IndexProgress:
    snapshot_id: str
    encoder: str
    state: str
    """One of ``STATES``."""
    chunks_total: int
    chunks_done: int
    started_at: float
    updated_at: float
    error: str = ""

    @property
    def fraction(self) -> float:
        return 1.0 if self.chunks_total == 0 else self.chunks_done / self.chunks_total


def progress_path(directory: Path) -> Path:
    return directory.with_name(directory.name + ".progress.json")


class IndexProgressWriter:
    """Writes one build's progress file; ``advance`` is cheap enough to call per batch."""

    def __init__(
        self, *, directory: Path, snapshot_id: str, encoder: str, chunks_total: int, state: str = "building",
        started_at: float | None = None,
    ) -> None:
        if state not in ACTIVE_STATES:
            raise ValueError(f"a build starts as one of {ACTIVE_STATES}, not {state!r}")
        self._path = progress_path(directory)
        now = time.time()
        self._state = IndexProgress(snapshot_id, encoder, state, chunks_total, 0, started_at or now, now)
        self._written = 0.0
        self._write(force=True)

    @property
    def started_at(self) -> float:
        return self._state.started_at

    @property
    def chunks_done(self) -> int:
        return self._state.chunks_done

    def advance(self, count: int) -> None:
        done = min(self._state.chunks_total, self._state.chunks_done + count)
        self._state = IndexProgress(**{**asdict(self._state), "chunks_done": done, "updated_at": time.time()})
        self._write(force=False)

    def queued(self, *, chunks_total: int) -> None:
        """Still waiting to encode (for an encoding slot); also the heartbeat that keeps it from ``stalled``."""
        self._state = IndexProgress(**{**asdict(self._state), "chunks_total": chunks_total, "updated_at": time.time()})
        self._write(force=True)

    def finish(self, *, error: str = "", cancelled: bool = False) -> None:
        state = "cancelled" if cancelled else "failed" if error else "ready"
        done = self._state.chunks_done if error else self._state.chunks_total
        self._state = IndexProgress(
            **{**asdict(self._state), "state": state, "chunks_done": done, "updated_at": time.time(), "error": error}
        )
        self._write(force=True)

    def _write(self, *, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._written < _WRITE_EVERY_S:
            return
        self._written = now
        staging = self._path.with_name(f".{self._path.name}.{uuid.uuid4().hex}")
        staging.write_text(json.dumps(asdict(self._state)))
        os.replace(staging, self._path)


def index_progress_read(directory: Path) -> IndexProgress | None:
    """The progress recorded beside one index directory, or None."""
    return _read(progress_path(directory), now=time.time())


def _read(path: Path, *, now: float) -> IndexProgress | None:
    try:
        progress = IndexProgress(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if progress.state in ACTIVE_STATES and now - progress.updated_at > STALE_AFTER_S:
        return IndexProgress(**{**asdict(progress), "state": "stalled"})
    return progress


def index_progress_list(*, index_root: Path, snapshot_id: str | None = None) -> list[IndexProgress]:
    """Every recorded build under ``index_root`` (or of one snapshot), newest first."""
    now = time.time()
    found = [_read(path, now=now) for path in Path(index_root).glob("*/*.progress.json")]
    rows = [row for row in found if row is not None and (snapshot_id is None or row.snapshot_id == snapshot_id)]
    return sorted(rows, key=lambda row: row.started_at, reverse=True)


def index_progress_summary(*, index_root: Path) -> dict[str, float]:
    """Totals for ``/metrics``: builds in progress and their chunks done / total, builds by state."""
    rows = index_progress_list(index_root=index_root)
    building = [row for row in rows if row.state in ACTIVE_STATES]  # queued ones count as chunks to encode
    summary: dict[str, float] = {f"builds_{state}": 0 for state in STATES}
    for row in rows:
        summary[f"builds_{row.state}"] += 1
    summary["building_chunks_done"] = sum(row.chunks_done for row in building)
    summary["building_chunks_total"] = sum(row.chunks_total for row in building)
    return summary


def semantic_index_metrics() -> dict[str, float]:
    """The deployment's index-build figures for ``/metrics`` (``index_progress_summary`` of its index root)."""
    from sandboxes.semantic.config import SemanticSearchConfig

    return index_progress_summary(index_root=SemanticSearchConfig.from_environment().index_root)
