"""The agent's ``semantic_search`` tool: one shared index per snapshot plus each fork's own edits."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sandboxes.base import SandboxError, SandboxGone
from sandboxes.semantic.building import BuildRegistry, IndexBuild
from sandboxes.semantic.chunking import SKIPPED_DIRECTORIES, decode_source, is_indexable_path
from sandboxes.semantic.config import SemanticSearchConfig, SemanticSearchError
from sandboxes.semantic.diffs import changed_paths, original_text, parse_unified_diff
from sandboxes.semantic.encoder import encoder_tag, text_encoder_load
from sandboxes.semantic.index import (
    BaseIndex,
    OverlayIndex,
    SearchHit,
    base_index_load,
    base_index_load_or_build,
    chunks_for_files,
    iter_directory_files,
)
from sandboxes.semantic.stores import VectorStore, table_search, vector_store_create

logger = logging.getLogger(__name__)

MAX_QUERY_CHARS = 2000
_OVERLAYS_KEPT = 512
_BASES_KEPT = 64
_FIRST_ANSWER_WAIT_S = 600.0
"""Longest a search waits for a new snapshot's chunks (not its vectors) before answering."""


@dataclass
class _LoadedBase:
    index: BaseIndex
    store: VectorStore


class _Registry:
    """Per-process caches: one loaded base index per snapshot and encoder, one overlay per sandbox."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bases: OrderedDict[tuple[str, str, str], _LoadedBase] = OrderedDict()
        self.base_locks: dict[tuple[str, str, str], threading.Lock] = {}
        self.overlays: OrderedDict[tuple[str, str], OverlayIndex] = OrderedDict()
        self.builds = BuildRegistry()


_REGISTRY = _Registry()


def _base_key(*, snapshot_id: str, config: SemanticSearchConfig) -> tuple[str, str, str]:
    return (snapshot_id, encoder_tag(config), str(Path(config.index_root).resolve()))


def base_index_for_snapshot(*, sandbox, config: SemanticSearchConfig) -> _LoadedBase:
    """The shared index of ``sandbox.snapshot``, loaded once per process and built once per snapshot."""
    snapshot = sandbox.snapshot
    key = _base_key(snapshot_id=snapshot.id, config=config)
    with _REGISTRY.lock:
        loaded = _REGISTRY.bases.get(key)
        if loaded is not None:
            _REGISTRY.bases.move_to_end(key)
            return loaded
        build_lock = _REGISTRY.base_locks.setdefault(key, threading.Lock())
    with build_lock:
        with _REGISTRY.lock:
            loaded = _REGISTRY.bases.get(key)
        if loaded is not None:
            return loaded
        index = base_index_load_or_build(
            snapshot_id=snapshot.id, files=lambda: snapshot_files(sandbox=sandbox, config=config), config=config
        )
        return _base_register(key=key, index=index, config=config)


def _base_register(*, key: tuple[str, str, str], index: BaseIndex, config: SemanticSearchConfig) -> _LoadedBase:
    store = vector_store_create(table=index.table, index_key=index.directory.as_posix(), config=config)
    loaded = _LoadedBase(index=index, store=store)
    with _REGISTRY.lock:
        _REGISTRY.bases[key] = loaded
        # Long RL runs visit many snapshots; keep the recent ones loaded and let the rest go
        # (they stay on disk and load again in milliseconds).
        while len(_REGISTRY.bases) > _BASES_KEPT:
            evicted_key, evicted = _REGISTRY.bases.popitem(last=False)
            _REGISTRY.base_locks.pop(evicted_key, None)
            close = getattr(evicted.store, "close", None)
            if close is not None:
                close()
    logger.info(
        "semantic index for snapshot %s: %d chunks (%s, %s store)",
        index.snapshot_id, len(index.table.chunks), "built" if index.built_here else "loaded", store.name,
    )
    return loaded


def base_index_or_build(*, sandbox, config: SemanticSearchConfig) -> _LoadedBase | IndexBuild:
    """The snapshot's loaded index when ready, else its background build (started here if needed).

    Waits only until the build has chunked the snapshot, so its BM25 stand-in can answer.
    """
    snapshot = sandbox.snapshot
    key = _base_key(snapshot_id=snapshot.id, config=config)
    with _REGISTRY.lock:
        loaded = _REGISTRY.bases.get(key)
    if loaded is not None:
        return base_index_for_snapshot(sandbox=sandbox, config=config)
    build = _build_or_loaded(sandbox=sandbox, config=config, key=key)
    if isinstance(build, _LoadedBase):
        return build
    build.chunks_ready.wait(_FIRST_ANSWER_WAIT_S)
    with _REGISTRY.lock:
        loaded = _REGISTRY.bases.get(key)
    if loaded is not None:
        return loaded
    if build.lexical is None:
        _REGISTRY.builds.forget(key)
        if build.error is not None:
            raise build.error
        raise SemanticSearchError(f"the files of snapshot {snapshot.id} were not chunked within "
                                  f"{_FIRST_ANSWER_WAIT_S:.0f} s; try again")
    if build.error is not None:
        _REGISTRY.builds.forget(key)  # the next search starts a fresh attempt
    return build


def _build_or_loaded(*, sandbox, config: SemanticSearchConfig, key: tuple[str, str, str]) -> _LoadedBase | IndexBuild:
    build = _REGISTRY.builds.get(key)
    if build is not None:
        return build
    snapshot = sandbox.snapshot
    on_disk = base_index_load(snapshot_id=snapshot.id, config=config)
    if on_disk is not None:
        return _base_register(key=key, index=on_disk, config=config)
    return _REGISTRY.builds.start(
        key=key, snapshot_id=snapshot.id, files=lambda: snapshot_files(sandbox=sandbox, config=config),
        config=config, on_ready=lambda index: _base_register(key=key, index=index, config=config),
    )


def index_build_start(*, sandbox, config: SemanticSearchConfig | None = None) -> IndexBuild | None:
    """Start building the index of ``sandbox.snapshot`` in the background now, without waiting.

    A product task calls this once its sandbox exists, so the build runs while the agent starts and
    its progress shows from the start; the agent's searches answer from BM25 until it is ready. None
    when the index is already loaded or on disk, or background indexing is off (searches then build).
    """
    config = config or SemanticSearchConfig.from_environment()
    if not config.background_indexing:
        return None
    key = _base_key(snapshot_id=sandbox.snapshot.id, config=config)
    with _REGISTRY.lock:
        if key in _REGISTRY.bases:
            return None
    build = _build_or_loaded(sandbox=sandbox, config=config, key=key)
    return None if isinstance(build, _LoadedBase) else build


def index_build_cancel(*, snapshot_id: str) -> int:
    """Stop this process's unfinished builds of a snapshot that is going away; returns how many."""
    return _REGISTRY.builds.cancel(snapshot_id=snapshot_id)


def snapshot_files(*, sandbox, config: SemanticSearchConfig) -> Iterator[tuple[str, bytes]]:
    """The snapshot's indexable files: from its frozen host directory, else from the sandbox minus its edits."""
    location = Path(sandbox.snapshot.location)
    if location.is_absolute() and location.is_dir():
        yield from iter_directory_files(location, max_file_bytes=config.chunking.max_file_bytes)
        return
    patches = parse_unified_diff(sandbox.diff())
    touched = changed_paths(patches)
    for path in _walk_sandbox(sandbox=sandbox, directory=""):
        if path in touched or not is_indexable_path(path):
            continue
        data = sandbox.read_bytes(path)
        if len(data) <= config.chunking.max_file_bytes:
            yield path, data
    for patch in patches:
        if patch.old_path is None or not is_indexable_path(patch.old_path):
            continue
        current = None
        if patch.new_path is not None:
            current = decode_source(sandbox.read_bytes(patch.new_path))
        text = original_text(patch=patch, current=current)
        if text is not None:
            yield patch.old_path, text.encode("utf-8")


def _walk_sandbox(*, sandbox, directory: str) -> Iterator[str]:
    for entry in sandbox.list_dir(directory or "."):
        path = f"{directory}/{entry.name}" if directory else entry.name
        if entry.kind == "dir" and entry.name not in SKIPPED_DIRECTORIES:
            yield from _walk_sandbox(sandbox=sandbox, directory=path)
        elif entry.kind == "file":
            yield path


def fork_changes(*, sandbox) -> dict[str, bytes | None]:
    """Indexable files the fork changed against its snapshot: path -> current bytes (None: deleted)."""
    current: dict[str, bytes | None] = {}
    for path in sorted(changed_paths(parse_unified_diff(sandbox.diff()))):
        if not is_indexable_path(path):
            continue
        try:
            current[path] = sandbox.read_bytes(path)
        except SandboxGone:
            raise
        except (FileNotFoundError, IsADirectoryError, SandboxError):
            # Deleted, or replaced by something that is not a regular file: nothing to index.
            current[path] = None
    return current


def _overlay_for(*, sandbox, config: SemanticSearchConfig) -> OverlayIndex:
    key = (str(sandbox.id), encoder_tag(config))
    with _REGISTRY.lock:
        overlay = _REGISTRY.overlays.get(key)
        if overlay is None:
            overlay = OverlayIndex(config=config)
            _REGISTRY.overlays[key] = overlay
            while len(_REGISTRY.overlays) > _OVERLAYS_KEPT:
                _REGISTRY.overlays.popitem(last=False)
        else:
            _REGISTRY.overlays.move_to_end(key)
        return overlay


def validate_query(*, query: object, k: object, config: SemanticSearchConfig) -> tuple[str, int]:
    if not isinstance(query, str) or not query.strip():
        raise SemanticSearchError("query must be a non-empty string describing the code to find")
    if len(query) > MAX_QUERY_CHARS:
        raise SemanticSearchError(f"query is {len(query)} characters; keep it under {MAX_QUERY_CHARS}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= config.max_k:
        raise SemanticSearchError(f"k must be an integer from 1 to {config.max_k}, got {k!r}")
    return query.strip(), k


def search_hits(*, sandbox, query: str, k: int, config: SemanticSearchConfig) -> list[SearchHit]:
    """Semantic hits; waits for the snapshot's index (see ``search_hits_or_lexical`` for the tool's path)."""
    base = base_index_for_snapshot(sandbox=sandbox, config=config)
    return _semantic_hits(sandbox=sandbox, base=base, query=query, k=k, config=config)


def _semantic_hits(*, sandbox, base: _LoadedBase, query: str, k: int, config: SemanticSearchConfig) -> list[SearchHit]:
    overlay = _overlay_for(sandbox=sandbox, config=config)
    overlay.refresh(current=fork_changes(sandbox=sandbox))
    query_vector = text_encoder_load(config=config).encode([query], batch_size=1)[0]
    return merge_hits(base=base, overlay=overlay, query_vector=query_vector, k=k)


def search_hits_or_lexical(
    *, sandbox, query: str, k: int, config: SemanticSearchConfig
) -> tuple[list[SearchHit], IndexBuild | None]:
    """Semantic hits when the snapshot's index is ready, else BM25 hits and the build they stand in for."""
    ready = base_index_or_build(sandbox=sandbox, config=config)
    if isinstance(ready, _LoadedBase):
        return _semantic_hits(sandbox=sandbox, base=ready, query=query, k=k, config=config), None
    current = fork_changes(sandbox=sandbox)
    edited = chunks_for_files(files=[(path, data) for path, data in current.items() if data is not None], config=config)
    assert ready.lexical is not None  # base_index_or_build returns a build only once its chunks are ready
    hits = ready.lexical.search(query=query, k=k, exclude_paths=frozenset(current), extra=edited)
    return hits, ready


def merge_hits(*, base: _LoadedBase, overlay: OverlayIndex, query_vector: np.ndarray, k: int) -> list[SearchHit]:
    hits = [
        SearchHit(base.index.table.chunks[row], score)
        for row, score in base.store.search(query=query_vector, k=k, exclude_paths=overlay.changed_paths)
    ]
    for table in overlay.tables():
        hits.extend(SearchHit(table.chunks[row], score) for row, score in table_search(table=table, query=query_vector, k=k))
    hits.sort(key=lambda hit: (-hit.score, hit.chunk.path, hit.chunk.start_line))
    return hits[:k]


def format_hits(*, query: str, hits: list[SearchHit], snippet_lines: int, note: str = "",
                score_label: str = "score") -> str:
    """The tool's result text, identical for product tasks and RL rollouts (``note`` leads it when set)."""
    if not hits:
        return f'{note}No code found for "{query}": the workspace has no indexable source files.'
    lines = [f'{note}Top {len(hits)} results for "{query}":']
    for rank, hit in enumerate(hits, start=1):
        chunk = hit.chunk
        label = f" {chunk.kind} {chunk.symbol}" if chunk.symbol else f" {chunk.kind}"
        lines.append("")
        lines.append(f"{rank}. {chunk.path}:{chunk.start_line}-{chunk.end_line} ({score_label} {hit.score:.3f}){label}")
        source_lines = chunk.text.splitlines()
        width = len(str(chunk.start_line + min(len(source_lines), snippet_lines) - 1))
        for offset, text in enumerate(source_lines[:snippet_lines]):
            lines.append(f"   {str(chunk.start_line + offset).rjust(width)} | {text}")
        if len(source_lines) > snippet_lines:
            lines.append(f"   ... {len(source_lines) - snippet_lines} more lines")
    return "\n".join(lines)


def semantic_search(*, sandbox, query: str, k: int = 10, config: SemanticSearchConfig | None = None) -> str:
    """Find the code in ``sandbox``'s workspace that best matches a natural-language ``query``.

    Returns ranked hits as text: path, line range, cosine score and a numbered snippet. Bad
    arguments raise ``SemanticSearchError`` with a message the agent can act on.
    """
    config = config or SemanticSearchConfig.from_environment()
    query, k = validate_query(query=query, k=k, config=config)
    if not config.background_indexing:
        hits = search_hits(sandbox=sandbox, query=query, k=k, config=config)
        return format_hits(query=query, hits=hits, snippet_lines=config.snippet_lines)
    hits, build = search_hits_or_lexical(sandbox=sandbox, query=query, k=k, config=config)
    if build is None:
        return format_hits(query=query, hits=hits, snippet_lines=config.snippet_lines)
    note = (f"[BM25 keyword results: the semantic index of this snapshot is not ready yet ({build.describe()}); "
            "semantic results replace these once it is.]\n")
    return format_hits(query=query, hits=hits, snippet_lines=config.snippet_lines, note=note, score_label="bm25")
