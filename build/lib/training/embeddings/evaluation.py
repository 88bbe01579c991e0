"""Retrieval evaluation on code held out of fine-tuning.

The set is built from Python stdlib modules (fine-tuning mines only third-party packages): every
file's docstrings are removed before it is chunked and indexed, and each removed function docstring's
summary becomes a query whose relevant chunk is the one holding that function's ``def`` line.
Retrievers rank chunks for every query; recall@1/5/10 and MRR@10 compare them.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sandboxes.semantic.chunking import Chunk, chunk_file
from sandboxes.semantic.config import ChunkingConfig
from sandboxes.semantic.lexical import code_tokens
from training.embeddings.mining import docstring_summary, iter_functions, strip_docstrings

# Stdlib modules used only for evaluation. ``train_embeddings`` mines the rest of the standard library
# but excludes these files (finetune.default_excluded_paths), so the fine-tuned encoder never saw this
# code or these docstrings.
HELD_OUT_STDLIB_MODULES = (
    "argparse.py", "calendar.py", "configparser.py", "csv.py", "difflib.py", "fractions.py", "ftplib.py",
    "gettext.py", "heapq.py", "imaplib.py", "ipaddress.py", "mailbox.py", "netrc.py", "pathlib.py",
    "plistlib.py", "shlex.py", "shutil.py", "smtplib.py", "statistics.py", "tarfile.py", "textwrap.py",
    "zipfile.py", "json/decoder.py", "json/encoder.py", "urllib/parse.py", "http/cookies.py", "email/utils.py",
)

RANK_DEPTH = 10


@dataclass(frozen=True)
class RetrievalQuery:
    text: str
    path: str
    symbol: str
    relevant_rows: tuple[int, ...]


@dataclass
class RetrievalSet:
    chunks: list[Chunk]
    queries: list[RetrievalQuery]


def stdlib_directory() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def held_out_files(modules: Sequence[str] = HELD_OUT_STDLIB_MODULES) -> dict[str, str]:
    root = stdlib_directory()
    files = {}
    for module in modules:
        path = root / module
        if not path.is_file():
            raise FileNotFoundError(f"held-out module {module} not found under {root}")
        files[f"stdlib/{module}"] = path.read_text(encoding="utf-8")
    return files


def _definition_lines(source: str) -> dict[str, int]:
    """Qualified name -> line of ``def`` (first decorator) for every function in ``source``."""
    lines: dict[str, int] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines.setdefault(f"{prefix}{node.name}", min([node.lineno] + [d.lineno for d in node.decorator_list]))

    visit(ast.parse(source).body, "")
    return lines


def retrieval_set_build(
    *, files: dict[str, str], max_queries: int, seed: int, chunking: ChunkingConfig | None = None
) -> RetrievalSet:
    chunking = chunking or ChunkingConfig()
    chunks: list[Chunk] = []
    candidates: list[RetrievalQuery] = []
    for path, source in sorted(files.items()):
        stripped = strip_docstrings(source)
        first_row = len(chunks)
        file_chunks = chunk_file(path=path, source=stripped, config=chunking)
        chunks.extend(file_chunks)
        definition_lines = _definition_lines(stripped)
        for function in iter_functions(path=path, source=source, min_lines=1, max_lines=10_000):
            summary = docstring_summary(function.docstring)
            def_line = definition_lines.get(function.symbol)
            if summary is None or def_line is None:
                continue
            relevant = tuple(
                first_row + offset
                for offset, chunk in enumerate(file_chunks)
                if chunk.start_line <= def_line <= chunk.end_line
            )
            if relevant:
                candidates.append(RetrievalQuery(summary, path, function.symbol, relevant))
    # A summary shared by several functions ("Return a string representation.") has no single answer.
    counts: dict[str, int] = {}
    for query in candidates:
        counts[query.text.lower()] = counts.get(query.text.lower(), 0) + 1
    unique = [query for query in candidates if counts[query.text.lower()] == 1]
    random.Random(seed).shuffle(unique)
    return RetrievalSet(chunks=chunks, queries=sorted(unique[:max_queries], key=lambda q: (q.path, q.symbol)))


# --- retrievers -------------------------------------------------------------------------------

STOPWORDS = frozenset(
    ["a", "an", "and", "are", "as", "at", "be", "by", "for", "from", "has", "have", "if", "in", "is", "it", "its", "of", "on", "or", "that", "the", "this", "to", "was", "were", "will", "with", "return", "returns", "given", "into", "which", "when", "not", "can", "should", "used", "use"]
)


def bm25_ranker(chunks: list[Chunk]) -> Callable[[str], list[int]]:
    from rank_bm25 import BM25Okapi

    bm25 = BM25Okapi([code_tokens(chunk.embedding_text()) or ["_"] for chunk in chunks])

    def rank(query: str) -> list[int]:
        scores = bm25.get_scores(code_tokens(query))
        return np.argsort(-scores, kind="stable")[:RANK_DEPTH].tolist()

    return rank


def keyword_ranker(chunks: list[Chunk]) -> Callable[[str], list[int]]:
    """What an agent gets from grep: chunks ranked by how many distinct query keywords they contain."""
    texts = [chunk.embedding_text().lower() for chunk in chunks]

    def rank(query: str) -> list[int]:
        keywords = {word for word in code_tokens(query) if len(word) >= 3 and word not in STOPWORDS}
        scores = np.array([sum(1 for word in keywords if word in text) for text in texts], dtype=np.float32)
        return np.argsort(-scores, kind="stable")[:RANK_DEPTH].tolist()

    return rank


def dense_ranker(chunk_vectors: np.ndarray, encode_queries: Callable[[list[str]], np.ndarray]):
    def rank_all(queries: list[str]) -> list[list[int]]:
        query_vectors = encode_queries(queries)
        scores = query_vectors @ chunk_vectors.T
        return np.argsort(-scores, axis=1, kind="stable")[:, :RANK_DEPTH].tolist()

    return rank_all


@dataclass(frozen=True)
class RetrievalMetrics:
    recall_at_1: float
    recall_at_5: float
    recall_at_10: float
    mrr_at_10: float
    queries: int


def retrieval_metrics(*, queries: list[RetrievalQuery], rankings: list[list[int]]) -> RetrievalMetrics:
    if len(queries) != len(rankings) or not queries:
        raise ValueError("need one ranking per query and at least one query")
    hits = {1: 0, 5: 0, 10: 0}
    reciprocal = 0.0
    for query, ranking in zip(queries, rankings, strict=True):
        relevant = set(query.relevant_rows)
        first = next((position for position, row in enumerate(ranking[:RANK_DEPTH]) if row in relevant), None)
        if first is None:
            continue
        reciprocal += 1.0 / (first + 1)
        for depth in hits:
            if first < depth:
                hits[depth] += 1
    count = len(queries)
    return RetrievalMetrics(hits[1] / count, hits[5] / count, hits[10] / count, reciprocal / count, count)
