"""Code retrieval quality and speed: BM25, grep-style keywords, the base encoder, our fine-tuned encoder.

Quality: queries are docstring summaries of held-out stdlib functions; the indexed code has every
docstring removed (see ``training/embeddings/evaluation.py``). Speed: query latency on a 50k-chunk
index (in process, and pgvector when available) against BM25 on the same 50k chunks, and indexing
throughput (chunk + encode) against BM25 indexing.

    .venv/bin/python benchmarks/bench_retrieval.py --finetuned var/embeddings/code-search --pgvector
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from sandboxes.semantic.config import default_encoder_path
from sandboxes.semantic.encoder import encode_texts, load_encoder
from sandboxes.semantic.index import INDEX_VECTOR_DTYPE, ChunkTable
from sandboxes.semantic.stores import MemoryVectorStore, PgVectorStore, pgvector_available
from training.embeddings.evaluation import (
    RetrievalMetrics,
    bm25_ranker,
    dense_ranker,
    held_out_files,
    keyword_ranker,
    retrieval_metrics,
    retrieval_set_build,
)


def _row(name: str, metrics: RetrievalMetrics) -> str:
    return (
        f"| {name} | {metrics.recall_at_1 * 100:.1f} | {metrics.recall_at_5 * 100:.1f} | "
        f"{metrics.recall_at_10 * 100:.1f} | {metrics.mrr_at_10:.3f} |"
    )


def _encoder_run(*, path: str, retrieval_set, batch_size: int) -> tuple[RetrievalMetrics, np.ndarray, float]:
    encoder = load_encoder(path=path, max_seq_length=256)
    encode_texts(encoder=encoder, texts=["warm up"], batch_size=1)
    started = time.perf_counter()
    vectors = encode_texts(
        encoder=encoder, texts=[chunk.embedding_text() for chunk in retrieval_set.chunks], batch_size=batch_size
    )
    throughput = len(retrieval_set.chunks) / (time.perf_counter() - started)
    rank_all = dense_ranker(
        vectors, lambda queries: encode_texts(encoder=encoder, texts=queries, batch_size=batch_size)
    )
    rankings = rank_all([query.text for query in retrieval_set.queries])
    return retrieval_metrics(queries=retrieval_set.queries, rankings=rankings), vectors, throughput


def _large_index(vectors: np.ndarray, size: int, seed: int) -> np.ndarray:
    """``size`` unit vectors: the real chunk vectors repeated with jitter (search cost ignores values)."""
    rng = np.random.default_rng(seed)
    repeats = int(np.ceil(size / vectors.shape[0]))
    tiled = np.tile(vectors, (repeats, 1))[:size]
    tiled = tiled + rng.normal(scale=0.05, size=tiled.shape).astype(np.float32)
    return (tiled / np.linalg.norm(tiled, axis=1, keepdims=True)).astype(INDEX_VECTOR_DTYPE)  # as stored


def _percentile(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples) * 1000.0, q))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finetuned", default="var/embeddings/code-search", help="fine-tuned encoder directory")
    parser.add_argument("--queries", type=int, default=400)
    parser.add_argument("--latency-chunks", type=int, default=50_000)
    parser.add_argument("--latency-queries", type=int, default=200)
    parser.add_argument("--pgvector", action="store_true", help="also time pgvector (needs PostgreSQL + vector)")
    parser.add_argument("--dsn", default="host=127.0.0.1 user=postgres dbname=postgres")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    retrieval_set = retrieval_set_build(files=held_out_files(), max_queries=args.queries, seed=0)
    query_texts = [query.text for query in retrieval_set.queries]
    print(f"held-out set: {len(retrieval_set.chunks)} chunks, {len(retrieval_set.queries)} queries "
          f"(stdlib modules, docstrings removed from the indexed code)")

    results: dict[str, dict] = {}
    started = time.perf_counter()
    bm25 = bm25_ranker(retrieval_set.chunks)
    bm25_index_rate = len(retrieval_set.chunks) / (time.perf_counter() - started)
    results["BM25"] = retrieval_metrics(queries=retrieval_set.queries, rankings=[bm25(q) for q in query_texts]).__dict__
    keywords = keyword_ranker(retrieval_set.chunks)
    results["grep keywords"] = retrieval_metrics(
        queries=retrieval_set.queries, rankings=[keywords(q) for q in query_texts]
    ).__dict__

    base_metrics, base_vectors, base_rate = _encoder_run(
        path=default_encoder_path(), retrieval_set=retrieval_set, batch_size=args.batch_size
    )
    results["base MiniLM-L6-v2"] = base_metrics.__dict__
    finetuned = Path(args.finetuned)
    if (finetuned / "modules.json").is_file():
        tuned_metrics, _, _ = _encoder_run(path=str(finetuned), retrieval_set=retrieval_set, batch_size=args.batch_size)
        results["fine-tuned (ours)"] = tuned_metrics.__dict__
    else:
        print(f"no fine-tuned encoder at {finetuned}: run `manage.py train_embeddings --output {finetuned}` first")

    print("\n| retriever | recall@1 | recall@5 | recall@10 | MRR@10 |\n|---|---|---|---|---|")
    for name, metrics in results.items():
        print(_row(name, RetrievalMetrics(**metrics)))
    base_r5 = results["base MiniLM-L6-v2"]["recall_at_5"]
    print(f"\nbase - BM25 recall@5: {(base_r5 - results['BM25']['recall_at_5']) * 100:+.1f} points (target >= +10)")
    if "fine-tuned (ours)" in results:
        gain = (results["fine-tuned (ours)"]["recall_at_5"] - base_r5) * 100
        print(f"fine-tuned - base recall@5: {gain:+.1f} points (target >= +5)")

    # --- speed -----------------------------------------------------------------------------
    speed: dict[str, float] = {
        "index_chunks_per_s": base_rate,
        "bm25_index_chunks_per_s": bm25_index_rate,
    }
    print(f"\nindexing: {base_rate:.1f} chunks/s (chunk text -> MiniLM vectors, 2 CPU threads); "
          f"BM25 indexing {bm25_index_rate:.0f} chunks/s; ratio {base_rate / bm25_index_rate:.4f}x")

    large = _large_index(base_vectors, args.latency_chunks, seed=0)
    chunks = [retrieval_set.chunks[row % len(retrieval_set.chunks)] for row in range(args.latency_chunks)]
    table = ChunkTable(chunks=chunks, vectors=large)
    store = MemoryVectorStore(table)
    encoder = load_encoder(path=default_encoder_path(), max_seq_length=256)
    sample = [query_texts[i % len(query_texts)] for i in range(args.latency_queries)]
    end_to_end, search_only = [], []
    for text in sample:
        t0 = time.perf_counter()
        vector = encode_texts(encoder=encoder, texts=[text], batch_size=1)[0]
        t1 = time.perf_counter()
        store.search(query=vector, k=10, exclude_paths=frozenset())
        t2 = time.perf_counter()
        end_to_end.append(t2 - t0)
        search_only.append(t2 - t1)
    speed.update(
        memory_query_p50_ms=_percentile(end_to_end, 50),
        memory_query_p95_ms=_percentile(end_to_end, 95),
        memory_search_only_p50_ms=_percentile(search_only, 50),
    )

    bm25_large_started = time.perf_counter()
    bm25_large = bm25_ranker(chunks)
    speed["bm25_50k_build_s"] = time.perf_counter() - bm25_large_started
    bm25_times = []
    for text in sample[:20]:
        t0 = time.perf_counter()
        bm25_large(text)
        bm25_times.append(time.perf_counter() - t0)
    speed["bm25_query_p50_ms"] = _percentile(bm25_times, 50)
    print(f"query latency on {args.latency_chunks} chunks, in process: p50 {speed['memory_query_p50_ms']:.1f} ms "
          f"(encode + search; search alone {speed['memory_search_only_p50_ms']:.1f} ms), "
          f"p95 {speed['memory_query_p95_ms']:.1f} ms; BM25 p50 {speed['bm25_query_p50_ms']:.1f} ms; "
          f"ratio BM25/ours {speed['bm25_query_p50_ms'] / speed['memory_query_p50_ms']:.1f}x")

    if args.pgvector:
        speed.update(_pgvector_latency(dsn=args.dsn, table=table, encoder=encoder, sample=sample))

    if args.json:
        Path(args.json).write_text(json.dumps({"quality": results, "speed": speed}, indent=2))
    return 0


def _pgvector_latency(*, dsn: str, table: ChunkTable, encoder, sample: list[str]) -> dict[str, float]:
    import psycopg

    if not pgvector_available(dsn):
        print("pgvector: the server has no vector extension (apt package postgresql-15-pgvector); skipped")
        return {}
    database = f"bench_semantic_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {database}")
    try:
        started = time.perf_counter()
        store = PgVectorStore(dsn=f"{dsn} dbname={database}", index_key="bench", table=table)
        load_s = time.perf_counter() - started
        vectors = encode_texts(encoder=encoder, texts=sample, batch_size=32)
        timings = []
        for vector in vectors:
            t0 = time.perf_counter()
            store.search(query=vector, k=10, exclude_paths=frozenset())
            timings.append(time.perf_counter() - t0)
        store.close()
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
    p50 = _percentile(timings, 50)
    print(f"pgvector (HNSW, cosine) on {len(table.chunks)} chunks: load + index build {load_s:.1f} s, "
          f"search p50 {p50:.2f} ms (query encoding not included)")
    return {"pgvector_search_p50_ms": p50, "pgvector_load_s": load_s}


if __name__ == "__main__":
    raise SystemExit(main())
