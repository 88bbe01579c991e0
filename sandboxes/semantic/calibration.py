"""A fixed calibration set for the statically quantized encoder (``openvino-int8``).

Static int8 quantization needs activation ranges measured on representative inputs. They must be the
same for every index that shares an encoder tag (a snapshot's shared index and a sandbox's delta are
compared vector to vector), so they never come from the code being indexed: they come from a fixed
list of the interpreter's standard-library modules, chunked by the index's own chunker and rendered
as the index embeds chunks. None of these modules is one the retrieval benchmark holds out
(``tests/semantic/test_openvino_encoder.py`` checks it), so the benchmark's recall is not measured on
code the quantizer has seen. The digest of the texts names the quantized model and its indexes: a
host whose standard library differs makes (and names) its own.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import sysconfig
from pathlib import Path

from sandboxes.semantic.chunking import chunk_file
from sandboxes.semantic.config import ChunkingConfig, SemanticSearchError

CALIBRATION_MODULES = (
    "asyncio/base_events.py", "asyncio/streams.py", "collections/__init__.py", "concurrent/futures/_base.py",
    "dataclasses.py", "datetime.py", "enum.py", "functools.py", "http/client.py", "inspect.py",
    "logging/__init__.py", "logging/handlers.py", "os.py", "pickle.py", "queue.py", "random.py", "selectors.py",
    "socket.py", "subprocess.py", "tempfile.py", "threading.py", "tokenize.py", "typing.py", "unittest/case.py",
    "weakref.py", "xml/dom/minidom.py", "sqlite3/dump.py", "importlib/metadata/__init__.py",
)
"""Standard-library files the calibration chunks are cut from (in this order)."""

CALIBRATION_TEXTS = 256
"""Texts in the calibration set (NNCF's statistics converge well before its default of 300)."""

QUERY_SHARE = 4
"""One text in this many is a query-like line (a docstring's summary line): searches encode short
natural-language queries with the same model, and their activation ranges differ from code's."""


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _summary_lines(source: str) -> list[str]:
    """The first line of every docstring in ``source`` that reads like a query (3 to 16 words)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            docstring = ast.get_docstring(node) or ""
            line = docstring.strip().split("\n", 1)[0].strip()
            if 3 <= len(line.split()) <= 16:
                lines.append(line)
    return lines


def _spread(items: list[str], count: int) -> list[str]:
    """``count`` items spread evenly over ``items``."""
    if len(items) < count:
        raise SemanticSearchError(f"the calibration modules give {len(items)} texts of a kind, fewer than {count}")
    step = len(items) / count
    return [items[int(position * step)] for position in range(count)]


@functools.lru_cache(maxsize=4)
def calibration_texts(count: int = CALIBRATION_TEXTS) -> tuple[str, ...]:
    """``count`` texts: chunks spread evenly over every calibration module's chunks, and one in
    ``QUERY_SHARE`` a docstring summary line (deterministic for a given standard library)."""
    chunks: list[str] = []
    queries: list[str] = []
    for module in CALIBRATION_MODULES:
        path = _stdlib() / module
        try:
            source = path.read_text(encoding="utf-8")
        except OSError as error:
            raise SemanticSearchError(f"calibration module {module} is not readable under {_stdlib()}: {error}") from error
        chunks.extend(chunk.embedding_text()
                      for chunk in chunk_file(path=f"stdlib/{module}", source=source, config=ChunkingConfig()))
        queries.extend(_summary_lines(source))
    query_count = count // QUERY_SHARE
    return tuple(_spread(chunks, count - query_count) + _spread(queries, query_count))


@functools.lru_cache(maxsize=4)
def calibration_digest(count: int = CALIBRATION_TEXTS) -> str:
    """Names the calibration set: changes when any of its texts does."""
    digest = hashlib.sha256()
    for text in calibration_texts(count):
        digest.update(hashlib.sha256(text.encode()).digest())
    return digest.hexdigest()[:12]
