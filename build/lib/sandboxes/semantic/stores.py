"""Nearest-neighbour search over a base index: numpy in process, or pgvector in PostgreSQL."""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Protocol

import numpy as np
import torch

from sandboxes.semantic.config import SemanticSearchConfig, SemanticSearchError, _django_setting
from sandboxes.semantic.index import ChunkTable

logger = logging.getLogger(__name__)


class VectorStore(Protocol):
    name: str

    def search(self, *, query: np.ndarray, k: int, exclude_paths: frozenset[str]) -> list[tuple[int, float]]:
        """Up to ``k`` (row, cosine score) pairs, best first, skipping chunks of ``exclude_paths``."""


def _cosine_scores(*, vectors: np.ndarray, query: np.ndarray) -> np.ndarray:
    # torch, not numpy: its float16 GEMV scans a 50k-chunk index in ~1.5 ms (numpy upcasts float16),
    # and it runs on the thread pool that encodes queries, where numpy's OpenBLAS threads keep
    # spinning after each call and slowed the next query encoding by ~10 ms.
    with warnings.catch_warnings():
        # The memory-mapped index is read-only; the product below only reads it.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        matrix = torch.from_numpy(np.asarray(vectors))
    with torch.inference_mode():
        scores = matrix @ torch.from_numpy(np.asarray(query, dtype=vectors.dtype))
    return scores.float().numpy()


def table_search(
    *, table: ChunkTable, query: np.ndarray, k: int, exclude_paths: frozenset[str] = frozenset()
) -> list[tuple[int, float]]:
    if not table.chunks or k <= 0:
        return []
    scores = _cosine_scores(vectors=table.vectors, query=query)
    for path in exclude_paths:
        rows = table.rows_by_path.get(path)
        if rows is not None:
            scores[rows] = -np.inf
    count = min(k, scores.shape[0])
    top = np.argpartition(-scores, count - 1)[:count]
    top = top[np.argsort(-scores[top], kind="stable")]
    return [(int(row), float(scores[row])) for row in top if np.isfinite(scores[row])]


class MemoryVectorStore:
    """Exact search by one matrix-vector product over the memory-mapped vectors."""

    name = "memory"

    def __init__(self, table: ChunkTable) -> None:
        self._table = table

    def search(self, *, query: np.ndarray, k: int, exclude_paths: frozenset[str]) -> list[tuple[int, float]]:
        return table_search(table=self._table, query=query, k=k, exclude_paths=exclude_paths)


def django_database_dsn() -> str | None:
    """libpq DSN of Django's default database when it is PostgreSQL, else None."""
    databases = _django_setting("DATABASES")
    if not databases or databases["default"]["ENGINE"] != "django.db.backends.postgresql":
        return None
    from psycopg.conninfo import make_conninfo

    database = databases["default"]
    parts = {
        "dbname": database.get("NAME") or None,
        "user": database.get("USER") or None,
        "password": database.get("PASSWORD") or None,
        "host": database.get("HOST") or None,
        "port": str(database["PORT"]) if database.get("PORT") else None,
    }
    return make_conninfo(**{key: value for key, value in parts.items() if value})


def pgvector_available(dsn: str) -> bool:
    """True when the server can load the ``vector`` extension (the ``postgresql-15-pgvector`` package)."""
    import psycopg

    try:
        with psycopg.connect(dsn, connect_timeout=5) as connection:
            row = connection.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'").fetchone()
            return row is not None
    except psycopg.Error as exc:
        logger.warning("PostgreSQL at %s unreachable for pgvector: %s", dsn, exc)
        return False


def _vector_literal(vector: np.ndarray) -> str:
    return "[" + ",".join(f"{value:.7g}" for value in vector.tolist()) + "]"


class PgVectorStore:
    """Base-index vectors in a PostgreSQL table with an HNSW cosine index, one row set per index key."""

    name = "pgvector"

    def __init__(self, *, dsn: str, index_key: str, table: ChunkTable) -> None:
        self._dimension = int(table.vectors.shape[1]) if table.vectors.ndim == 2 else 0
        if self._dimension <= 0:
            raise SemanticSearchError("cannot store an index with no vector dimension in pgvector")
        self._index_key = index_key
        self._table_name = f"semantic_chunk_d{self._dimension}"
        self._dsn = dsn
        self._connection, self._lock = _shared_connection_acquire(dsn)
        self._closed = False
        try:
            with self._lock:
                self._prepare(table)
        except Exception:
            self.close()
            raise

    def _prepare(self, table: ChunkTable) -> None:
        connection = self._connection
        # Filtering by index key after an approximate scan could return fewer than k rows; the
        # iterative scan keeps walking the graph until enough rows pass the filter.
        connection.execute("SET hnsw.iterative_scan = relaxed_order")
        with connection.transaction():
            # Loaders in every process queue here, so DDL never races and each key is loaded once.
            connection.execute("SELECT pg_advisory_xact_lock(hashtext('flowstate-semantic-index'))")
            connection.execute("CREATE EXTENSION IF NOT EXISTS vector")
            connection.execute(
                f"CREATE TABLE IF NOT EXISTS {self._table_name} ("
                " index_key text NOT NULL, row_number integer NOT NULL, path text NOT NULL,"
                f" embedding vector({self._dimension}) NOT NULL, PRIMARY KEY (index_key, row_number))"
            )
            connection.execute(
                f"CREATE INDEX IF NOT EXISTS {self._table_name}_hnsw ON {self._table_name} "
                "USING hnsw (embedding vector_cosine_ops)"
            )
            loaded = connection.execute(
                f"SELECT count(*) FROM {self._table_name} WHERE index_key = %s", (self._index_key,)
            ).fetchone()[0]
            if loaded == len(table.chunks):
                return
            connection.execute(f"DELETE FROM {self._table_name} WHERE index_key = %s", (self._index_key,))
            with connection.cursor().copy(
                f"COPY {self._table_name} (index_key, row_number, path, embedding) FROM STDIN"
            ) as copy:
                for row, chunk in enumerate(table.chunks):
                    copy.write_row((self._index_key, row, chunk.path, _vector_literal(table.vectors[row])))

    def search(self, *, query: np.ndarray, k: int, exclude_paths: frozenset[str]) -> list[tuple[int, float]]:
        literal = _vector_literal(query)
        with self._lock:
            rows = self._connection.execute(
                f"SELECT row_number, 1 - (embedding <=> %s::vector) FROM {self._table_name} "
                "WHERE index_key = %s AND NOT (path = ANY(%s)) ORDER BY embedding <=> %s::vector LIMIT %s",
                (literal, self._index_key, list(exclude_paths), literal, k),
            ).fetchall()
        return [(int(row), float(score)) for row, score in rows]

    def drop(self) -> None:
        with self._lock:
            self._connection.execute(f"DELETE FROM {self._table_name} WHERE index_key = %s", (self._index_key,))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _shared_connection_release(self._dsn)


# Every base index of a process shares one connection per database: an RL run touches many
# snapshots, and one connection each would exhaust the server's connection slots.
_SHARED: dict[str, list] = {}
_SHARED_LOCK = threading.Lock()


def _shared_connection_acquire(dsn: str):
    import psycopg

    with _SHARED_LOCK:
        entry = _SHARED.get(dsn)
        if entry is None or entry[0].closed:
            entry = [psycopg.connect(dsn, autocommit=True), threading.Lock(), 0]
            _SHARED[dsn] = entry
        entry[2] += 1
        return entry[0], entry[1]


def _shared_connection_release(dsn: str) -> None:
    with _SHARED_LOCK:
        entry = _SHARED.get(dsn)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] <= 0:
            entry[0].close()
            del _SHARED[dsn]


_PGVECTOR_CHECKED: dict[str, bool] = {}


def vector_store_create(*, table: ChunkTable, index_key: str, config: SemanticSearchConfig) -> VectorStore:
    """The store ``config.vector_store`` asks for; ``auto`` picks pgvector when the database offers it."""
    if config.vector_store == "memory":
        return MemoryVectorStore(table)
    dsn = config.database_dsn or django_database_dsn()
    if config.vector_store == "pgvector":
        if dsn is None:
            raise SemanticSearchError("vector_store='pgvector' needs a PostgreSQL database_dsn")
        if not pgvector_available(dsn):
            raise SemanticSearchError(
                "vector_store='pgvector' but the PostgreSQL server lacks the vector extension; install the "
                "Debian package postgresql-15-pgvector or set SEMANTIC_VECTOR_STORE=memory"
            )
        return PgVectorStore(dsn=dsn, index_key=index_key, table=table)
    if dsn is None or not table.chunks:
        return MemoryVectorStore(table)
    if dsn not in _PGVECTOR_CHECKED:
        _PGVECTOR_CHECKED[dsn] = pgvector_available(dsn)
    if not _PGVECTOR_CHECKED[dsn]:
        return MemoryVectorStore(table)
    import psycopg

    try:
        return PgVectorStore(dsn=dsn, index_key=index_key, table=table)
    except psycopg.Error as exc:
        # Typically a role that may not CREATE EXTENSION; the in-process store gives the same results.
        logger.warning("pgvector unusable (%s); searching in process instead", exc)
        _PGVECTOR_CHECKED[dsn] = False
        return MemoryVectorStore(table)
