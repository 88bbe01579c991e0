"""Chunk tables, the shared per-snapshot base index and the per-fork overlay of edited files.

A base index is built once per (snapshot, encoder) and written under the index root as
``chunks.jsonl`` + ``vectors.npy``; every process memory-maps the vectors read-only, so N forks of
one snapshot (N rollouts of one task) share one copy. Each fork keeps a small overlay with the
chunks of the files it changed; searches hide the base chunks of those files and add the overlay's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from filelock import FileLock

from sandboxes.semantic.chunking import (
    SKIPPED_DIRECTORIES,
    Chunk,
    chunk_file,
    decode_source,
    is_indexable_path,
)
from sandboxes.semantic.config import SemanticSearchConfig
from sandboxes.semantic.encoder import encoder_runtime, encoder_tag, runtime_mismatch, text_encoder_load
from sandboxes.semantic.progress import IndexBuildCancelled, IndexProgressWriter

INDEX_FORMAT_VERSION = 2
# Stored vectors are float16: half the bytes to memory-map and scan per query, and cosine scores
# move by ~1e-4, far below the gaps that order search results (version 1 stored float32).
INDEX_VECTOR_DTYPE = np.float16

logger = logging.getLogger(__name__)


@dataclass
class ChunkTable:
    """Chunks and their unit-normalised embeddings, row ``i`` of ``vectors`` belonging to ``chunks[i]``."""

    chunks: list[Chunk]
    vectors: np.ndarray
    rows_by_path: dict[str, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.chunks) != self.vectors.shape[0]:
            raise ValueError(f"{len(self.chunks)} chunks but {self.vectors.shape[0]} vectors")
        grouped: dict[str, list[int]] = {}
        for row, chunk in enumerate(self.chunks):
            grouped.setdefault(chunk.path, []).append(row)
        self.rows_by_path = {path: np.asarray(rows, dtype=np.int64) for path, rows in grouped.items()}


@dataclass(frozen=True)
class SearchHit:
    chunk: Chunk
    score: float


def content_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def chunks_for_files(*, files: Iterable[tuple[str, bytes]], config: SemanticSearchConfig) -> list[Chunk]:
    chunks: list[Chunk] = []
    for path, data in files:
        if not is_indexable_path(path) or len(data) > config.chunking.max_file_bytes:
            continue
        source = decode_source(data)
        if source is None:
            continue
        chunks.extend(chunk_file(path=path, source=source, config=config.chunking))
    return chunks


def table_encode(
    *, chunks: list[Chunk], config: SemanticSearchConfig, progress: Callable[[int], None] | None = None
) -> ChunkTable:
    """Encode ``chunks`` with the configured encoder backend into a table."""
    encoder = text_encoder_load(config=config)
    vectors = encoder.encode(
        [chunk.embedding_text() for chunk in chunks], batch_size=config.encode_batch_size, progress=progress
    )
    return ChunkTable(chunks=chunks, vectors=vectors)


def table_build(*, files: Iterable[tuple[str, bytes]], config: SemanticSearchConfig) -> ChunkTable:
    """Chunk and encode ``files`` (relative path, bytes) into a table."""
    return table_encode(chunks=chunks_for_files(files=files, config=config), config=config)


def iter_directory_files(root: Path, *, max_file_bytes: int) -> Iterator[tuple[str, bytes]]:
    """Indexable files under ``root`` as (relative POSIX path, bytes), in a stable order (os.walk's, top-down).

    A loop over an explicit stack, not os.walk, which recurses: a snapshot tree (setup commands wrote
    it) can nest deeper than the recursion limit. What cannot be read (e.g. a path past PATH_MAX) is skipped.
    """
    pending = [root]
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as listing:
                entries = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in listing]
        except OSError:
            continue
        for filename in sorted(name for name, is_dir in entries if not is_dir):
            full = directory / filename
            relative = full.relative_to(root).as_posix()
            try:
                if full.is_symlink() or not full.is_file() or not is_indexable_path(relative):
                    continue
                if full.stat().st_size > max_file_bytes:
                    continue
                data = full.read_bytes()
            except OSError:
                continue
            yield relative, data
        subdirectories = sorted(name for name, is_dir in entries if is_dir and name not in SKIPPED_DIRECTORIES)
        pending.extend(directory / name for name in reversed(subdirectories))


# --- on-disk base index ---------------------------------------------------------------------------


def _safe_component(value: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", value)[:80]
    return f"{cleaned}-{hashlib.sha256(value.encode()).hexdigest()[:8]}"


def base_index_directory(*, snapshot_id: str, config: SemanticSearchConfig) -> Path:
    return (
        Path(config.index_root)
        / _safe_component(snapshot_id)
        / f"v{INDEX_FORMAT_VERSION}-{encoder_tag(config)}"
    )


def _table_write(*, table: ChunkTable, directory: Path, meta: dict) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.parent / f".{directory.name}.{uuid.uuid4().hex}.tmp"
    staging.mkdir()
    retired = directory.parent / f".{directory.name}.{uuid.uuid4().hex}.replaced"
    try:
        with open(staging / "chunks.jsonl", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(
                        {"path": chunk.path, "start": chunk.start_line, "end": chunk.end_line, "kind": chunk.kind,
                         "symbol": chunk.symbol, "text": chunk.text},
                        ensure_ascii=False,
                    )
                    + "\n" for chunk in table.chunks)
        np.save(staging / "vectors.npy", np.asarray(table.vectors, dtype=INDEX_VECTOR_DTYPE))
        (staging / "meta.json").write_text(json.dumps(meta, indent=2))
        # The rename is the commit point: a crash before it leaves only a staging directory that the
        # next build ignores, never a half-written index. An index being replaced is moved aside first
        # (processes that memory-mapped its vectors keep reading them until they reload).
        if directory.exists():
            os.replace(directory, retired)
        try:
            os.replace(staging, directory)
        except BaseException:
            if retired.exists() and not directory.exists():
                os.replace(retired, directory)  # the new index could not take its place: keep the old one
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(retired, ignore_errors=True)


def _table_read(directory: Path) -> ChunkTable:
    chunks = []
    with open(directory / "chunks.jsonl", encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            chunks.append(Chunk(row["path"], row["start"], row["end"], row["kind"], row["symbol"], row["text"]))
    vectors = np.load(directory / "vectors.npy", mmap_mode="r")
    return ChunkTable(chunks=chunks, vectors=vectors)


@dataclass
class BaseIndex:
    """The read-only index of one snapshot's files under one encoder."""

    snapshot_id: str
    directory: Path
    table: ChunkTable
    built_here: bool
    """True when this call built the index (False: loaded from disk)."""


def _stale_reason(directory: Path, config: SemanticSearchConfig) -> str | None:
    """Why the index in ``directory`` must be rebuilt before ``config``'s encoder searches it (None: it need not).

    Its vectors must have been made the way this machine's encoder makes the queries' (backend, precision
    and, for int8 and bfloat16 backends, the CPU's ISA class), or scores would compare unlike vectors."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError) as error:
        return f"its meta.json is unreadable ({error})"
    if not isinstance(meta, dict):
        return "its meta.json is not an object"
    return runtime_mismatch(recorded=meta.get("encoder_runtime"), current=encoder_runtime(config))


def _usable(directory: Path, config: SemanticSearchConfig) -> bool:
    """True when ``directory`` holds a complete index this machine's encoder can search; logs why not."""
    if not (directory / "meta.json").is_file():
        return False
    reason = _stale_reason(directory, config)
    if reason is not None:
        logger.warning("semantic index %s will be rebuilt: %s", directory, reason)
    return reason is None


def base_index_load(*, snapshot_id: str, config: SemanticSearchConfig) -> BaseIndex | None:
    """The snapshot's index when it is on disk and comparable with this encoder's vectors, else None (never builds)."""
    directory = base_index_directory(snapshot_id=snapshot_id, config=config)
    if _usable(directory, config):
        return BaseIndex(snapshot_id, directory, _table_read(directory), built_here=False)
    return None


def base_index_load_or_build(
    *,
    snapshot_id: str,
    files: Callable[[], Iterable[tuple[str, bytes]]],
    config: SemanticSearchConfig,
    chunks: list[Chunk] | None = None,
    progress: Callable[[int], None] | None = None,
    started_at: float | None = None,
) -> BaseIndex:
    """Load the snapshot's index from disk, building it first (once across processes) if missing.

    ``files`` is called only when a build is needed and yields (relative path, bytes) of the snapshot;
    ``chunks``, when given, are those files already chunked. ``progress(n)`` follows the encoding (raising
    ``IndexBuildCancelled`` there stops it), and ``<directory>.progress.json`` shows it to other processes
    (``started_at``: when the build began, if before this call, e.g. queued for an encoding slot).
    """
    directory = base_index_directory(snapshot_id=snapshot_id, config=config)
    loaded = base_index_load(snapshot_id=snapshot_id, config=config)
    if loaded is not None:
        return loaded
    directory.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory) + ".lock"):
        if _usable(directory, config):
            return BaseIndex(snapshot_id, directory, _table_read(directory), built_here=False)
        if chunks is None:
            chunks = chunks_for_files(files=files(), config=config)
        writer = IndexProgressWriter(
            directory=directory, snapshot_id=snapshot_id, encoder=encoder_tag(config), chunks_total=len(chunks),
            started_at=started_at,
        )

        def advance(count: int) -> None:
            writer.advance(count)
            if progress is not None:
                progress(count)

        try:
            table = table_encode(chunks=chunks, config=config, progress=advance)
        except BaseException as exc:
            writer.finish(error=f"{type(exc).__name__}: {exc}"[:500], cancelled=isinstance(exc, IndexBuildCancelled))
            raise
        _table_write(
            table=table,
            directory=directory,
            meta={
                "format": INDEX_FORMAT_VERSION,
                "snapshot_id": snapshot_id,
                "encoder_path": str(config.encoder_path),
                "chunks": len(table.chunks),
                "encoder": encoder_tag(config),
                "encoder_runtime": encoder_runtime(config),
            },
        )
        writer.finish()
    return BaseIndex(snapshot_id, directory, _table_read(directory), built_here=True)


# --- per-fork overlay ---------------------------------------------------------------------------


@dataclass
class _OverlayFile:
    digest: str | None
    """Content hash, or None when the file was deleted."""
    table: ChunkTable


class OverlayIndex:
    """Chunks of the files one fork changed; re-encodes a file only when its content changes."""

    def __init__(self, *, config: SemanticSearchConfig) -> None:
        self._config = config
        self._files: dict[str, _OverlayFile] = {}
        self._lock = threading.Lock()

    @property
    def changed_paths(self) -> frozenset[str]:
        return frozenset(self._files)

    def refresh(self, *, current: dict[str, bytes | None]) -> int:
        """Bring the overlay to ``current`` (path -> new bytes, None when deleted); returns files re-encoded.

        Paths absent from ``current`` are no longer changed (the fork reverted them), so they leave
        the overlay and the base chunks show again.
        """
        with self._lock:
            for path in list(self._files):
                if path not in current:
                    del self._files[path]
            encoded = 0
            for path, data in current.items():
                digest = None if data is None else content_digest(data)
                known = self._files.get(path)
                if known is not None and known.digest == digest:
                    continue
                files = [] if data is None else [(path, data)]
                self._files[path] = _OverlayFile(digest, table_build(files=files, config=self._config))
                encoded += 1
            return encoded

    def tables(self) -> list[ChunkTable]:
        with self._lock:
            return [entry.table for entry in self._files.values() if entry.table.chunks]
