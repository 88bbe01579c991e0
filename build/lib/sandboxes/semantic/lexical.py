"""BM25 over the same chunks the semantic index holds: the answer while that index is still building.

Tokens are code-aware words (identifiers split at ``_`` and camelCase), the tokenization the
retrieval benchmark's BM25 row uses. A fork's edited files are scored with the base corpus's
statistics, so their chunks rank on the same scale as the base chunks they replace.
"""

from __future__ import annotations

import re

import numpy as np

from sandboxes.semantic.chunking import Chunk
from sandboxes.semantic.index import SearchHit

_WORD = re.compile(r"[A-Za-z][a-z]+|[A-Z]+(?![a-z])|\d+")


def code_tokens(text: str) -> list[str]:
    """Lower-cased words with identifiers split at ``_`` and camelCase boundaries."""
    return [token.lower() for token in _WORD.findall(text)]


class LexicalIndex:
    """BM25 (Okapi, ``rank_bm25``) over a snapshot's chunks."""

    def __init__(self, chunks: list[Chunk]) -> None:
        from rank_bm25 import BM25Okapi

        self.chunks = chunks
        self._bm25 = BM25Okapi([code_tokens(chunk.embedding_text()) or ["_"] for chunk in chunks]) if chunks else None
        rows: dict[str, list[int]] = {}
        for row, chunk in enumerate(chunks):
            rows.setdefault(chunk.path, []).append(row)
        self._rows_by_path = {path: np.asarray(found, dtype=np.int64) for path, found in rows.items()}

    def _score_extra(self, *, query_tokens: list[str], chunks: list[Chunk]) -> np.ndarray:
        """BM25 scores of chunks outside the corpus, with the corpus's idf and average length."""
        bm25 = self._bm25
        scores = np.zeros(len(chunks))
        if bm25 is None:
            return scores
        for position, chunk in enumerate(chunks):
            tokens = code_tokens(chunk.embedding_text()) or ["_"]
            counts: dict[str, int] = {}
            for token in tokens:
                counts[token] = counts.get(token, 0) + 1
            norm = bm25.k1 * (1 - bm25.b + bm25.b * len(tokens) / bm25.avgdl)
            scores[position] = sum(
                (bm25.idf.get(token) or 0.0) * counts[token] * (bm25.k1 + 1) / (counts[token] + norm)
                for token in query_tokens if token in counts
            )
        return scores

    def search(
        self, *, query: str, k: int, exclude_paths: frozenset[str], extra: list[Chunk]
    ) -> list[SearchHit]:
        """Top ``k`` of the corpus minus ``exclude_paths`` plus ``extra`` chunks, best first."""
        query_tokens = code_tokens(query)
        base_scores = self._bm25.get_scores(query_tokens) if self._bm25 is not None else np.zeros(0)
        for path in exclude_paths:
            rows = self._rows_by_path.get(path)
            if rows is not None:
                base_scores[rows] = -np.inf
        candidates = [SearchHit(self.chunks[row], float(base_scores[row]))
                      for row in np.argsort(-base_scores, kind="stable")[:k] if np.isfinite(base_scores[row])]
        extra_scores = self._score_extra(query_tokens=query_tokens, chunks=extra)
        candidates.extend(SearchHit(chunk, float(score)) for chunk, score in zip(extra, extra_scores, strict=True))
        candidates.sort(key=lambda hit: (-hit.score, hit.chunk.path, hit.chunk.start_line))
        return candidates[:k]
