"""pgvector store against a real PostgreSQL database with the vector extension.

These need the Debian package ``postgresql-15-pgvector`` on the database server (bookworm main lacks it,
so .ci/run installs it only where the apt sources offer it); without it these
tests skip and say so.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from sandboxes.semantic.chunking import Chunk
from sandboxes.semantic.index import ChunkTable
from sandboxes.semantic.stores import (
    MemoryVectorStore,
    PgVectorStore,
    pgvector_available,
    vector_store_create,
)

ADMIN_DSN = os.environ.get("SEMANTIC_TEST_PG_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=postgres")


@pytest.fixture(scope="module")
def pgvector_dsn():
    psycopg = pytest.importorskip("psycopg")
    try:
        with psycopg.connect(ADMIN_DSN, autocommit=True, connect_timeout=3) as admin:
            available = admin.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'").fetchone()
            if available is None:
                pytest.skip("PostgreSQL lacks the vector extension: apt-get install postgresql-15-pgvector")
            database = f"test_semantic_{uuid.uuid4().hex[:10]}"
            admin.execute(f"CREATE DATABASE {database}")
    except psycopg.OperationalError as exc:
        pytest.skip(f"no PostgreSQL at {ADMIN_DSN}: {exc}")
    yield f"{ADMIN_DSN} dbname={database}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")


def _random_table(rows: int, dimension: int = 16, seed: int = 0) -> ChunkTable:
    rng = np.random.default_rng(seed)
    vectors = rng.normal(size=(rows, dimension)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    chunks = [Chunk(f"file_{row % 7}.py", row + 1, row + 1, "window", "", f"line {row}") for row in range(rows)]
    return ChunkTable(chunks=chunks, vectors=vectors)


def test_pgvector_returns_the_same_neighbours_as_exact_search(pgvector_dsn):
    table = _random_table(300)
    store = PgVectorStore(dsn=pgvector_dsn, index_key=f"key-{uuid.uuid4().hex}", table=table)
    exact = MemoryVectorStore(table)
    try:
        rng = np.random.default_rng(1)
        agreements = []
        for _ in range(10):
            query = rng.normal(size=16).astype(np.float32)
            query /= np.linalg.norm(query)
            excluded = frozenset({"file_3.py"})
            from_db = store.search(query=query, k=5, exclude_paths=excluded)
            from_numpy = exact.search(query=query, k=5, exclude_paths=excluded)
            assert len(from_db) == 5
            assert all(table.chunks[row].path != "file_3.py" for row, _ in from_db)
            assert [score for _, score in from_db] == sorted((score for _, score in from_db), reverse=True)
            agreements.append(len({row for row, _ in from_db} & {row for row, _ in from_numpy}) / 5)
            top_row, top_score = from_db[0]
            assert top_score == pytest.approx(float(table.vectors[top_row] @ query), abs=1e-4)
        # HNSW is approximate; on 300 rows it should agree with exact search almost always.
        assert np.mean(agreements) >= 0.9
    finally:
        store.close()


def test_rows_are_loaded_once_per_index_key_and_keys_are_isolated(pgvector_dsn):
    import psycopg

    key_a, key_b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"
    table_a, table_b = _random_table(40, seed=2), _random_table(25, seed=3)
    stores = [
        PgVectorStore(dsn=pgvector_dsn, index_key=key_a, table=table_a),
        PgVectorStore(dsn=pgvector_dsn, index_key=key_a, table=table_a),
        PgVectorStore(dsn=pgvector_dsn, index_key=key_b, table=table_b),
    ]
    try:
        with psycopg.connect(pgvector_dsn) as connection:
            counts = dict(connection.execute(
                "SELECT index_key, count(*) FROM semantic_chunk_d16 WHERE index_key IN (%s, %s) GROUP BY index_key",
                (key_a, key_b),
            ).fetchall())
        assert counts == {key_a: 40, key_b: 25}
        hits = stores[2].search(query=table_b.vectors[4], k=3, exclude_paths=frozenset())
        assert hits[0][0] == 4 and hits[0][1] == pytest.approx(1.0, abs=1e-4)
        assert all(row < 25 for row, _ in hits)
    finally:
        for store in stores:
            store.close()


def test_configured_pgvector_store_serves_semantic_search(pgvector_dsn, search_config, local_backend, tiny_repository):
    from sandboxes.base import RepoSource, SandboxLimits
    from sandboxes.semantic import semantic_search

    assert pgvector_available(pgvector_dsn)
    config = search_config.with_changes(vector_store="pgvector", database_dsn=pgvector_dsn)
    snapshot = local_backend.snapshot_create(source=RepoSource(kind="path", location=str(tiny_repository)))
    sandbox = local_backend.sandbox_create(snapshot=snapshot, limits=SandboxLimits())
    try:
        text = semantic_search(sandbox=sandbox, query="convert a string like 5m to seconds", k=2, config=config)
        assert "1. app/durations.py:6-8" in text
        from sandboxes.semantic.search import base_index_for_snapshot

        assert base_index_for_snapshot(sandbox=sandbox, config=config).store.name == "pgvector"
    finally:
        sandbox.destroy()


def test_auto_store_prefers_pgvector_and_falls_back_to_memory(pgvector_dsn):
    from sandboxes.semantic.config import SemanticSearchConfig, SemanticSearchError

    table = _random_table(5)
    auto = SemanticSearchConfig(vector_store="auto", database_dsn=pgvector_dsn)
    store = vector_store_create(table=table, index_key=f"auto-{uuid.uuid4().hex}", config=auto)
    assert store.name == "pgvector"
    store.close()
    unreachable = "host=127.0.0.1 port=1 user=postgres connect_timeout=2"
    fallback = SemanticSearchConfig(vector_store="auto", database_dsn=unreachable)
    assert vector_store_create(table=table, index_key="k", config=fallback).name == "memory"
    demanded = SemanticSearchConfig(vector_store="pgvector", database_dsn=unreachable)
    with pytest.raises(SemanticSearchError, match="postgresql-15-pgvector"):
        vector_store_create(table=table, index_key="k", config=demanded)
