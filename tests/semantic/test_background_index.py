"""A new snapshot's index builds in the background; until it is ready semantic_search answers from BM25.

"Not ready" is made real, not simulated: the test holds the index's file lock the way another process
building the same snapshot does, so the build thread chunks the snapshot and then waits. Releasing the
lock lets it encode, and the tool switches to semantic results.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace

import pytest
from filelock import FileLock

from sandboxes.base import RepoSource, SandboxLimits
from sandboxes.semantic import index_build_cancel, index_build_start, semantic_search
from sandboxes.semantic.encoder import text_encoder_load
from sandboxes.semantic.index import base_index_directory
from sandboxes.semantic.progress import index_progress_list, index_progress_summary

BM25_NOTE = re.compile(r"^\[BM25 keyword results: the semantic index of this snapshot is not ready yet \((\d+) of (\d+) "
                       r"chunks encoded\); semantic results replace these once it is\.\]$", re.MULTILINE)
NOT_READY = "[BM25 keyword results: the semantic index of this snapshot is not ready yet"
HIT = re.compile(r"^(\d+)\. (\S+):(\d+)-(\d+) \((score|bm25) (-?\d+\.\d{3})\) (\w+)(?: (\S+))?$", re.MULTILINE)


def _hits(text):
    return [{"path": m.group(2), "label": m.group(5), "score": float(m.group(6)), "symbol": m.group(8)}
            for m in HIT.finditer(text)]


@pytest.fixture
def forks(local_backend, tiny_repository):
    snapshot = local_backend.snapshot_create(source=RepoSource(kind="path", location=str(tiny_repository)))
    sandboxes = local_backend.sandbox_fork(snapshot=snapshot, count=2, limits=SandboxLimits())
    yield sandboxes
    for sandbox in sandboxes:
        sandbox.destroy()


@pytest.fixture
def background_config(search_config):
    return replace(search_config, background_indexing=True)


def _wait_for_semantic(*, sandbox, query, config, timeout_s=300.0):
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = semantic_search(sandbox=sandbox, query=query, k=3, config=config)
        if NOT_READY not in text:
            return text
        time.sleep(0.2)
    raise AssertionError(f"the index was not ready after {timeout_s} s; last answer:\n{text}")


def test_bm25_answers_before_the_index_is_ready_then_semantic_results_take_over(forks, background_config):
    sandbox = forks[0]
    text_encoder_load(config=background_config)  # the ONNX export is cached once per worker, not per snapshot
    directory = base_index_directory(snapshot_id=sandbox.snapshot.id, config=background_config)
    directory.parent.mkdir(parents=True, exist_ok=True)
    other_builder = FileLock(str(directory) + ".lock")
    other_builder.acquire()
    try:
        text = semantic_search(sandbox=sandbox, query="parse duration units", k=3, config=background_config)
        note = BM25_NOTE.search(text)
        assert note is not None, text
        assert int(note.group(1)) == 0 and int(note.group(2)) == 6  # the tiny repository's 6 chunks
        hits = _hits(text)
        assert hits[0]["path"] == "app/durations.py" and hits[0]["symbol"] == "parse_duration"
        assert {hit["label"] for hit in hits} == {"bm25"}
        assert not (directory / "meta.json").exists()

        # The fork's own edits count in the stand-in too: a new function is found, a deleted file is not.
        sandbox.write_bytes("app/geometry.py", sandbox.read_bytes("app/geometry.py")
                            + b"\n\ndef fibonacci_number(n):\n    return n\n")
        sandbox.exec("rm app/cache.py")
        edited = _hits(semantic_search(sandbox=sandbox, query="fibonacci number", k=5, config=background_config))
        assert edited[0]["symbol"] == "fibonacci_number"
        evicted = semantic_search(sandbox=sandbox, query="evict least recently used", k=5, config=background_config)
        assert BM25_NOTE.search(evicted) and "app/cache.py" not in {hit["path"] for hit in _hits(evicted)}
    finally:
        other_builder.release()

    text = _wait_for_semantic(sandbox=forks[1], query="convert a string like 5m into a number of seconds",
                              config=background_config)
    hits = _hits(text)
    assert text.startswith('Top 3 results for "convert a string like 5m into a number of seconds":')
    assert hits[0]["symbol"] == "parse_duration" and {hit["label"] for hit in hits} == {"score"}
    assert (directory / "meta.json").is_file()
    # The edited fork switches too, and still sees only its own edits.
    switched = _hits(semantic_search(sandbox=sandbox, query="compute the n-th fibonacci number", k=10,
                                     config=background_config))
    assert switched[0]["symbol"] == "fibonacci_number" and "app/cache.py" not in {hit["path"] for hit in switched}

    (progress,) = index_progress_list(index_root=background_config.index_root, snapshot_id=sandbox.snapshot.id)
    assert (progress.state, progress.chunks_done, progress.chunks_total) == ("ready", 6, 6)
    summary = index_progress_summary(index_root=background_config.index_root)
    assert summary["builds_ready"] == 1 and summary["builds_building"] == 0


def test_a_failed_build_keeps_bm25_answering_and_says_why(forks, background_config, tmp_path):
    broken = tmp_path / "broken-encoder"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # a directory that looks like a model but is not one
    config = replace(background_config, encoder_path=str(broken))
    first = semantic_search(sandbox=forks[0], query="parse duration units", k=2, config=config)
    assert first.startswith(NOT_READY)
    deadline = time.monotonic() + 60
    text = first
    while "build failed" not in text and time.monotonic() < deadline:
        time.sleep(0.2)
        text = semantic_search(sandbox=forks[0], query="parse duration units", k=2, config=config)
    assert "its build failed" in text and "restarts on the next search" in text
    assert _hits(text)[0]["symbol"] == "parse_duration"
    (progress,) = index_progress_list(index_root=config.index_root)
    assert progress.state == "failed" and progress.error


def _progress(config, snapshot_id):
    rows = index_progress_list(index_root=config.index_root, snapshot_id=snapshot_id)
    return rows[0] if rows else None


def _wait_for(predicate, *, timeout_s=60.0, what=""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_builds_started_with_the_task_are_visible_at_once_bounded_and_cancellable(
    local_backend, tiny_repository, background_config
):
    """The build starts before any search, shows ``queued`` at once; one encodes at a time; cancel stops one."""
    config = replace(background_config, max_concurrent_builds=1)
    text_encoder_load(config=config)
    sandboxes = [local_backend.sandbox_create(snapshot=local_backend.snapshot_create(
        source=RepoSource(kind="path", location=str(tiny_repository))), limits=SandboxLimits()) for _ in range(3)]
    first, second, third = sandboxes
    directory = base_index_directory(snapshot_id=first.snapshot.id, config=config)
    directory.parent.mkdir(parents=True, exist_ok=True)
    other_builder = FileLock(str(directory) + ".lock")  # holds the first build inside its encoding slot
    other_builder.acquire()
    try:
        build = index_build_start(sandbox=first, config=config)
        assert build is not None and index_build_start(sandbox=first, config=config) is build  # one per snapshot
        row = _progress(config, first.snapshot.id)  # written before index_build_start returned
        assert row is not None and row.state == "queued"
        _wait_for(lambda: build.chunks_ready.is_set() and build.encoding, what="the first build's slot")

        queued = index_build_start(sandbox=second, config=config)
        _wait_for(lambda: queued.waiting, what="the second build to queue behind the first")
        assert (_progress(config, second.snapshot.id).state, _progress(config, second.snapshot.id).chunks_total) \
            == ("queued", 6)
        text = semantic_search(sandbox=second, query="parse duration units", k=3, config=config)
        assert text.startswith("[BM25 keyword results: the semantic index of this snapshot is not ready yet "
                               "(6 chunks queued for encoding behind other snapshots' builds)")
        assert _hits(text)[0]["symbol"] == "parse_duration"
        summary = index_progress_summary(index_root=config.index_root)
        assert summary["builds_queued"] == 2 and summary["building_chunks_total"] == 12

        cancelled = index_build_start(sandbox=third, config=config)
        _wait_for(lambda: cancelled.waiting, what="the third build to queue")
        assert index_build_cancel(snapshot_id=third.snapshot.id) == 1
        _wait_for(lambda: cancelled.finished.is_set(), what="the cancelled build to stop")
        assert _progress(config, third.snapshot.id).state == "cancelled"
        assert queued.waiting and not queued.finished.is_set()  # the others are untouched
    finally:
        other_builder.release()

    assert _hits(_wait_for_semantic(sandbox=first, query="parse duration units", config=config))[0]["label"] == "score"
    _wait_for_semantic(sandbox=second, query="parse duration units", config=config)
    assert [_progress(config, s.snapshot.id).state for s in (first, second)] == ["ready", "ready"]
    assert not (base_index_directory(snapshot_id=third.snapshot.id, config=config) / "meta.json").exists()
    for sandbox in sandboxes:
        sandbox.destroy()
