"""Background builds of base indexes, so a task on a new snapshot never waits for its index.

A build starts when a product task's sandbox is ready (``search.index_build_start``) or, for other
callers, at the first search of a snapshot whose index is not on disk: one thread per (snapshot,
encoder, index root) in this process. Its progress file says ``queued`` at once (the task page and
``/metrics`` see it from the start); the thread chunks the snapshot and publishes a BM25 index of those
chunks (the first search waits only for that), waits for one of ``max_concurrent_builds`` encoding
slots, encodes the chunks and hands the finished index to ``on_ready``. Another process building the
same snapshot holds the index's file lock; this thread then waits for it and loads the result instead
of encoding twice. ``cancel`` stops a build whose snapshot is no longer needed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sandboxes.semantic.chunking import Chunk
from sandboxes.semantic.config import SemanticSearchConfig
from sandboxes.semantic.encoder import encoder_tag
from sandboxes.semantic.index import (
    BaseIndex,
    base_index_directory,
    base_index_load,
    base_index_load_or_build,
    chunks_for_files,
)
from sandboxes.semantic.lexical import LexicalIndex
from sandboxes.semantic.progress import (
    ACTIVE_STATES,
    STALE_AFTER_S,
    IndexBuildCancelled,
    IndexProgressWriter,
    index_progress_read,
)

_SLOT_HEARTBEAT_S = min(5.0, STALE_AFTER_S / 4)

logger = logging.getLogger(__name__)


@dataclass
class IndexBuild:
    """One background build: its BM25 stand-in, its progress, and how it ended."""

    snapshot_id: str
    chunks_ready: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    lexical: LexicalIndex | None = None
    chunks_total: int = 0
    chunks_done: int = 0
    error: BaseException | None = None
    started_at: float = field(default_factory=time.monotonic)
    waiting: bool = False
    """True while the build waits for an encoding slot that other builds hold."""
    encoding: bool = False
    """True once the build holds an encoding slot (its progress file is then the encoder's)."""
    cancelled: threading.Event = field(default_factory=threading.Event)

    def describe(self) -> str:
        if self.error is not None:
            return f"its build failed ({type(self.error).__name__}: {self.error}) and restarts on the next search"
        if self.waiting:
            return f"{self.chunks_total} chunks queued for encoding behind other snapshots' builds"
        return f"{self.chunks_done} of {self.chunks_total} chunks encoded"


class BuildRegistry:
    """The builds running in this process, by index key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._builds: dict[tuple[str, ...], IndexBuild] = {}
        self._slots: dict[tuple[str, int], threading.Semaphore] = {}
        """Encoding slots per (index root, limit): one deployment's builds share one bound."""

    def start(
        self,
        *,
        key: tuple[str, ...],
        snapshot_id: str,
        files: Callable[[], Iterable[tuple[str, bytes]]],
        config: SemanticSearchConfig,
        on_ready: Callable[[BaseIndex], object],
    ) -> IndexBuild:
        """The running build for ``key``, or a new one; a failed build is replaced by a fresh attempt."""
        with self._lock:
            build = self._builds.get(key)
            if build is not None and not (build.finished.is_set() and build.error is not None):
                return build
            build = IndexBuild(snapshot_id=snapshot_id)
            self._builds[key] = build
            slots = self._slots.setdefault((str(config.index_root), config.max_concurrent_builds),
                                           threading.Semaphore(config.max_concurrent_builds))
        writer = _queued_writer(snapshot_id=snapshot_id, config=config)  # visible before the thread runs
        thread = threading.Thread(
            target=self._run, kwargs={"key": key, "build": build, "files": files, "config": config,
                                      "on_ready": on_ready, "slots": slots, "writer": writer},
            name=f"semantic-index-{snapshot_id[:24]}", daemon=True,
        )
        thread.start()
        return build

    def cancel(self, *, snapshot_id: str) -> int:
        """Stop this process's unfinished builds of ``snapshot_id`` (its task ended); returns how many."""
        with self._lock:
            builds = [(key, build) for key, build in self._builds.items() if build.snapshot_id == snapshot_id]
            for key, _build in builds:
                self._builds.pop(key, None)
        for _key, build in builds:
            build.cancelled.set()
        return sum(1 for _key, build in builds if not build.finished.is_set())

    def get(self, key: tuple[str, ...]) -> IndexBuild | None:
        with self._lock:
            return self._builds.get(key)

    def forget(self, key: tuple[str, ...]) -> None:
        with self._lock:
            self._builds.pop(key, None)

    def _run(
        self,
        *,
        key: tuple[str, ...],
        build: IndexBuild,
        files: Callable[[], Iterable[tuple[str, bytes]]],
        config: SemanticSearchConfig,
        on_ready: Callable[[BaseIndex], object],
        slots: threading.Semaphore,
        writer: IndexProgressWriter | None,
    ) -> None:
        holding = False
        try:
            on_disk = base_index_load(snapshot_id=build.snapshot_id, config=config)
            if on_disk is not None:  # finished by another process, or by an earlier build of this key
                if writer is not None:
                    writer.finish()
                on_ready(on_disk)
                self.forget(key)
                return
            chunks: list[Chunk] = chunks_for_files(files=files(), config=config)
            build.lexical = LexicalIndex(chunks)
            build.chunks_total = len(chunks)
            build.chunks_ready.set()
            holding = _slot_wait(slots=slots, build=build, writer=writer)
            build.encoding = True

            def advance(count: int) -> None:
                if build.cancelled.is_set():
                    raise IndexBuildCancelled(f"the build of snapshot {build.snapshot_id} was cancelled")
                build.chunks_done += count

            index = base_index_load_or_build(
                snapshot_id=build.snapshot_id, files=files, config=config, chunks=chunks, progress=advance,
                started_at=writer.started_at if writer is not None else None,
            )
            build.chunks_done = build.chunks_total
            on_ready(index)
            logger.info("semantic index of snapshot %s ready after %.1f s (%d chunks)",
                        build.snapshot_id, time.monotonic() - build.started_at, build.chunks_total)
            self.forget(key)
        except IndexBuildCancelled as exc:
            logger.info("semantic index build of snapshot %s cancelled", build.snapshot_id)
            build.error = exc
            if writer is not None and not build.encoding:
                writer.finish(error=str(exc), cancelled=True)
        except BaseException as exc:  # reported to the next search, which starts a new attempt
            logger.exception("semantic index build of snapshot %s failed", build.snapshot_id)
            build.error = exc
            if writer is not None and not build.encoding:
                writer.finish(error=f"{type(exc).__name__}: {exc}"[:500])
        finally:
            if holding:
                slots.release()
            build.chunks_ready.set()
            build.finished.set()


def _queued_writer(*, snapshot_id: str, config: SemanticSearchConfig) -> IndexProgressWriter | None:
    """A ``queued`` progress file for a new build, unless another process is building this index now."""
    directory = base_index_directory(snapshot_id=snapshot_id, config=config)
    current = index_progress_read(directory)
    if current is not None and current.state in ACTIVE_STATES:
        return None  # that builder's file stays; this thread waits for its lock and loads its result
    directory.parent.mkdir(parents=True, exist_ok=True)
    return IndexProgressWriter(directory=directory, snapshot_id=snapshot_id, encoder=encoder_tag(config),
                               chunks_total=0, state="queued")


def _slot_wait(*, slots: threading.Semaphore, build: IndexBuild, writer: IndexProgressWriter | None) -> bool:
    """Wait for an encoding slot, keeping the progress file fresh; True once one is held."""
    if writer is not None:
        writer.queued(chunks_total=build.chunks_total)
    held = slots.acquire(blocking=False)
    build.waiting = not held
    while not held:
        if build.cancelled.is_set():
            raise IndexBuildCancelled(f"the build of snapshot {build.snapshot_id} was cancelled before it encoded")
        held = slots.acquire(timeout=_SLOT_HEARTBEAT_S)
        if writer is not None:
            writer.queued(chunks_total=build.chunks_total)
    build.waiting = False
    if build.cancelled.is_set():
        slots.release()
        raise IndexBuildCancelled(f"the build of snapshot {build.snapshot_id} was cancelled before it encoded")
    return True
