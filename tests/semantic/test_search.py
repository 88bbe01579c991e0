"""The semantic_search tool on real local sandboxes: shared base index, per-fork overlays, errors."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from sandboxes.base import RepoSource, SandboxLimits
from sandboxes.semantic import SemanticSearchError, semantic_search
from sandboxes.semantic.index import base_index_directory
from sandboxes.semantic.search import base_index_for_snapshot

HIT_LINE = re.compile(r"^(\d+)\. (\S+):(\d+)-(\d+) \(score (-?\d\.\d{3})\) (\w+)(?: (\S+))?$", re.MULTILINE)

FIBONACCI = b"\n\ndef fibonacci_number(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"


def _hits(text):
    return [
        {"path": m.group(2), "start": int(m.group(3)), "end": int(m.group(4)), "score": float(m.group(5)),
         "symbol": m.group(7)}
        for m in HIT_LINE.finditer(text)
    ]


@pytest.fixture
def forks(local_backend, tiny_repository):
    snapshot = local_backend.snapshot_create(source=RepoSource(kind="path", location=str(tiny_repository)))
    sandboxes = local_backend.sandbox_fork(snapshot=snapshot, count=2, limits=SandboxLimits())
    yield sandboxes
    for sandbox in sandboxes:
        sandbox.destroy()


def test_query_finds_the_function_with_path_lines_score_and_snippet(forks, search_config):
    text = semantic_search(sandbox=forks[0], query="convert a string like 5m into a number of seconds", k=3,
                           config=search_config)
    hits = _hits(text)
    assert text.startswith('Top 3 results for "convert a string like 5m into a number of seconds":')
    assert hits[0]["path"] == "app/durations.py" and hits[0]["symbol"] == "parse_duration"
    assert (hits[0]["start"], hits[0]["end"]) == (6, 8)
    assert hits[0]["score"] > hits[1]["score"] >= hits[2]["score"]
    assert "   6 | def parse_duration(text):" in text
    assert all(hit["path"] != "assets/logo.bin" for hit in hits)


def test_forks_share_one_base_index_and_see_only_their_own_edits(forks, search_config):
    first, second = forks
    assert first.snapshot.id == second.snapshot.id
    query = "compute the n-th fibonacci number iteratively"
    before = _hits(semantic_search(sandbox=first, query=query, k=1, config=search_config))
    assert before[0]["symbol"] != "fibonacci_number"

    first.write_bytes("app/geometry.py", first.read_bytes("app/geometry.py") + FIBONACCI)
    after_first = _hits(semantic_search(sandbox=first, query=query, k=2, config=search_config))
    after_second = _hits(semantic_search(sandbox=second, query=query, k=2, config=search_config))
    assert after_first[0]["symbol"] == "fibonacci_number"
    assert (after_first[0]["path"], after_first[0]["start"], after_first[0]["end"]) == ("app/geometry.py", 8, 12)
    assert "fibonacci_number" not in [hit["symbol"] for hit in after_second]
    # The edited file is shown once, from the overlay, not also from the stale base chunks.
    geometry_hits = _hits(semantic_search(sandbox=first, query="area of a circle from its radius", k=10,
                                          config=search_config))
    assert [(h["start"], h["end"]) for h in geometry_hits if h["symbol"] == "circle_area"] == [(4, 5)]

    loaded = base_index_for_snapshot(sandbox=second, config=search_config)
    directories = [path for path in search_config.index_root.glob("*/*") if path.is_dir()]
    assert directories == [base_index_directory(snapshot_id=first.snapshot.id, config=search_config)]
    assert not any("fibonacci" in chunk.text for chunk in loaded.index.table.chunks)


def test_deleted_new_and_reverted_files(forks, search_config):
    sandbox = forks[0]
    sandbox.exec("rm app/cache.py && mkdir -p lib && printf 'def send_email_report(to):\\n    return to\\n' > lib/mail.py")
    hits = _hits(semantic_search(sandbox=sandbox, query="evict the least recently used cache entry", k=10,
                                 config=search_config))
    assert "app/cache.py" not in {hit["path"] for hit in hits}
    top = _hits(semantic_search(sandbox=sandbox, query="send an email report", k=1, config=search_config))
    assert top[0]["path"] == "lib/mail.py"

    sandbox.reset()
    hits = _hits(semantic_search(sandbox=sandbox, query="evict the least recently used cache entry", k=1,
                                 config=search_config))
    assert hits[0]["path"] == "app/cache.py"


def test_a_fresh_process_loads_the_index_from_disk_instead_of_rebuilding(forks, search_config, monkeypatch):
    from sandboxes.semantic import search as search_module

    semantic_search(sandbox=forks[0], query="circle area", k=1, config=search_config)
    monkeypatch.setattr(search_module, "_REGISTRY", search_module._Registry())
    loaded = base_index_for_snapshot(sandbox=forks[1], config=search_config)
    assert loaded.index.built_here is False
    assert len(loaded.index.table.chunks) == loaded.index.table.vectors.shape[0] > 0


def test_bad_arguments_are_clear_errors(forks, search_config):
    for query, k, message in [("", 5, "non-empty"), ("x" * 3000, 5, "under"), ("ok", 0, "k must"),
                              ("ok", 500, "k must"), ("ok", True, "k must"), (None, 5, "non-empty")]:
        with pytest.raises(SemanticSearchError, match=message):
            semantic_search(sandbox=forks[0], query=query, k=k, config=search_config)


def test_snapshot_without_host_directory_is_indexed_from_the_sandbox_minus_its_edits(forks, search_config):
    """The Docker backend's snapshot is an image tag: the base comes from a sandbox with its diff reversed."""
    edited = forks[0]
    edited.write_bytes("app/durations.py", b"def parse_duration(text):\n    raise ValueError(text)\n")
    edited.exec("rm docs/deploy.md")

    class ImageSnapshotView:
        """A real sandbox seen through a snapshot whose location is an image tag, as Docker reports it."""

        def __init__(self, sandbox):
            self._sandbox = sandbox
            self.id = sandbox.id
            self.snapshot = replace(sandbox.snapshot, id="image-snapshot", location="flowstate-sandbox:snap")

        def __getattr__(self, name):
            return getattr(self._sandbox, name)

    loaded = base_index_for_snapshot(sandbox=ImageSnapshotView(edited), config=search_config)
    texts = {chunk.path: chunk.text for chunk in loaded.index.table.chunks}
    assert "UNITS[unit]" in texts["app/durations.py"] and "raise ValueError" not in texts["app/durations.py"]
    assert "docker compose" in texts["docs/deploy.md"]
    assert set(texts) == {"app/durations.py", "app/cache.py", "app/geometry.py", "docs/deploy.md"}
