"""Syntax-aware chunking: definitions, large classes, module heads, line-window fallback."""

from __future__ import annotations

import pytest

from sandboxes.semantic.chunking import chunk_file, decode_source, is_indexable_path
from sandboxes.semantic.config import ChunkingConfig, SemanticSearchConfig, SemanticSearchError

SOURCE = '''"""Module docstring."""
import os

LIMIT = 3


@decorator
def first(a):
    return a + 1


class Small:
    def method(self):
        return 1


if __name__ == "__main__":
    first(LIMIT)
'''


def _assert_ranges_match(chunks, source):
    lines = source.splitlines()
    for chunk in chunks:
        assert chunk.text == "\n".join(lines[chunk.start_line - 1 : chunk.end_line])


def test_python_file_is_cut_at_definitions_with_decorators_and_head():
    chunks = chunk_file(path="pkg/mod.py", source=SOURCE, config=ChunkingConfig())
    summary = [(c.kind, c.symbol, c.start_line, c.end_line) for c in chunks]
    assert summary == [
        ("module", "", 1, 4),
        ("function", "first", 7, 9),
        ("class", "Small", 12, 14),
        ("window", "", 17, 18),
    ]
    _assert_ranges_match(chunks, SOURCE)


def test_large_class_splits_into_header_and_methods_and_long_bodies_into_windows():
    body = "\n".join(f"        value_{i} = {i}" for i in range(30))
    source = "class Big:\n    size = 1\n\n" + "".join(
        f"    def method_{n}(self):\n{body}\n        return 0\n\n" for n in range(3)
    )
    config = ChunkingConfig(max_chunk_lines=20, window_overlap_lines=5)
    chunks = chunk_file(path="big.py", source=source, config=config)
    assert chunks[0].kind == "class" and chunks[0].symbol == "Big" and chunks[0].end_line == 3
    method_symbols = {c.symbol for c in chunks if c.kind == "method"}
    assert method_symbols == {"Big.method_0", "Big.method_1", "Big.method_2"}
    assert all(c.end_line - c.start_line + 1 <= 20 for c in chunks)
    windows_of_first = [c for c in chunks if c.symbol == "Big.method_0"]
    assert len(windows_of_first) == 2 and windows_of_first[1].start_line == windows_of_first[0].start_line + 15
    _assert_ranges_match(chunks, source)


def test_other_files_and_broken_python_fall_back_to_overlapping_windows():
    text = "\n".join(f"line {i}" for i in range(1, 26))
    config = ChunkingConfig(max_chunk_lines=10, window_overlap_lines=2)
    for path in ("notes.md", "broken.py"):
        source = text if path == "notes.md" else "def broken(:\n" + text
        chunks = chunk_file(path=path, source=source, config=config)
        assert [c.kind for c in chunks] == ["window"] * len(chunks)
        assert chunks[0].start_line == 1 and chunks[1].start_line == 9
        assert chunks[-1].end_line == len(source.splitlines())
        _assert_ranges_match(chunks, source)


def test_binary_vendored_and_unknown_files_are_not_indexed():
    assert decode_source(b"\x00\x01\x02") is None
    assert decode_source(b"\xff\xfe bad utf8") is None
    assert decode_source("ok é".encode()) == "ok é"
    assert is_indexable_path("src/app.py") and is_indexable_path("Makefile")
    assert not is_indexable_path("node_modules/lib/index.js")
    assert not is_indexable_path(".git/config") and not is_indexable_path("image.png")
    assert chunk_file(path="empty.py", source="\n\n", config=ChunkingConfig()) == []


def test_configuration_errors_say_how_to_fix_them(tmp_path):
    with pytest.raises(SemanticSearchError, match="window_overlap_lines"):
        ChunkingConfig(max_chunk_lines=10, window_overlap_lines=10)
    with pytest.raises(SemanticSearchError, match="SEMANTIC_VECTOR_STORE"):
        SemanticSearchConfig(vector_store="faiss")
    with pytest.raises(SemanticSearchError, match="SEMANTIC_ENCODER"):
        SemanticSearchConfig(encoder_path=str(tmp_path / "missing-model"))


def test_environment_selects_encoder_and_store(monkeypatch, settings, tmp_path):
    model = tmp_path / "my-encoder"
    model.mkdir()
    settings.SEMANTIC_ENCODER = str(model)
    settings.SEMANTIC_VECTOR_STORE = "memory"
    settings.SANDBOX_ROOT = str(tmp_path / "sb")
    config = SemanticSearchConfig.from_environment()
    assert config.encoder_path == str(model)
    assert config.vector_store == "memory"
    assert config.index_root == tmp_path / "sb" / "semantic-index"


@pytest.mark.parametrize("value", ["80; rm -rf /", "-5", "1e3", "eighty", "0x50"])
def test_a_sequence_length_that_is_not_a_whole_number_is_refused(settings, tmp_path, value):
    settings.SANDBOX_ROOT = str(tmp_path / "sb")
    settings.SEMANTIC_MAX_SEQ_LENGTH = value
    with pytest.raises(SemanticSearchError, match="SEMANTIC_MAX_SEQ_LENGTH"):
        SemanticSearchConfig.from_environment()


def test_the_sequence_length_comes_from_the_environment_within_the_encoders_range(settings, tmp_path):
    settings.SANDBOX_ROOT = str(tmp_path / "sb")
    settings.SEMANTIC_MAX_SEQ_LENGTH = "128"
    assert SemanticSearchConfig.from_environment().max_seq_length == 128
    settings.SEMANTIC_MAX_SEQ_LENGTH = "100000"
    with pytest.raises(SemanticSearchError, match=r"\[16, 512\]"):
        SemanticSearchConfig.from_environment()
