"""Background builds of base indexes, so a task on a new snapshot never waits for its index.

The first search of a snapshot whose index is not on disk starts one build thread per (snapshot,
encoder, index root) in this process. The thread chunks the snapshot and publishes a BM25 index of
those chunks at once (the first search waits only for that), then encodes the chunks and hands the
finished index to ``on_ready``. Another process building the same snapshot holds the index's file
lock; this thread then waits for it and loads the result instead of encoding twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sandboxes.semantic.chunking import Chunk
from sandboxes.semantic.config import SemanticSearchConfig
from sandboxes.semantic.index import BaseIndex, base_index_load, base_index_load_or_build, chunks_for_files
from sandboxes.semantic.lexical import LexicalIndex

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

    def describe(self) -> str:
        if self.error is not None:
            return f"its build failed ({type(self.error).__name__}: {self.error}) and restarts on the next search"
        return f"{self.chunks_done} of {self.chunks_total} chunks encoded"


class BuildRegistry:
    """The builds running in this process, by index key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._builds: dict[tuple[str, ...], IndexBuild] = {}

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
        thread = threading.Thread(
            target=self._run, kwargs={"key": key, "build": build, "files": files, "config": config,
                                      "on_ready": on_ready},
            name=f"semantic-index-{snapshot_id[:24]}", daemon=True,
        )
        thread.start()
        return build

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
    ) -> None:
        try:
            on_disk = base_index_load(snapshot_id=build.snapshot_id, config=config)
            if on_disk is not None:  # finished by another process, or by an earlier build of this key
                on_ready(on_disk)
                self.forget(key)
                return
            chunks: list[Chunk] = chunks_for_files(files=files(), config=config)
            build.lexical = LexicalIndex(chunks)
            build.chunks_total = len(chunks)
            build.chunks_ready.set()

            def advance(count: int) -> None:
                build.chunks_done += count

            index = base_index_load_or_build(
                snapshot_id=build.snapshot_id, files=files, config=config, chunks=chunks, progress=advance
            )
            build.chunks_done = build.chunks_total
            on_ready(index)
            logger.info("semantic index of snapshot %s ready after %.1f s (%d chunks)",
                        build.snapshot_id, time.monotonic() - build.started_at, build.chunks_total)
            self.forget(key)
        except BaseException as exc:  # reported to the next search, which starts a new attempt
            logger.exception("semantic index build of snapshot %s failed", build.snapshot_id)
            build.error = exc
        finally:
            build.chunks_ready.set()
            build.finished.set()
