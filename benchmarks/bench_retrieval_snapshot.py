"""Time until a fresh snapshot answers ``semantic_search``: first (BM25) answer, then semantic.

Part of ``bench_retrieval.py``, and runnable alone (the figures of issue 53)::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_retrieval_snapshot.py --chunks 20000

The snapshot is real code: standard-library files copied into a
directory until it holds ``target_chunks`` chunks, snapshotted and opened by the local sandbox
backend, searched through the tool's own entry point with a fresh index root. The encoder is loaded
(and its ONNX export cached) before the clock starts, as in a worker that has served a task before.
The clock starts when the sandbox is ready; as a product task does, the benchmark then starts the
index build (``index_build_start``; ``--build-at-first-search`` leaves that to the first search, the
earlier behaviour) and searches like an agent: at once, then every ``--poll-s`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandboxes.base import RepoSource, SandboxLimits
from sandboxes.local_backend import LocalBackend, LocalBackendConfig
from sandboxes.semantic import SemanticSearchConfig, index_build_start, semantic_search
from sandboxes.semantic.encoder import text_encoder_load
from sandboxes.semantic.index import chunks_for_files
from sandboxes.semantic.progress import index_progress_list
from training.embeddings.evaluation import stdlib_directory

NOT_READY = "[BM25 keyword results:"
QUERY = "split a command line string into shell-like tokens"


def _copy_code(*, destination: Path, target_chunks: int, config: SemanticSearchConfig) -> int:
    total = 0
    for source in sorted(stdlib_directory().rglob("*.py")):
        relative = source.relative_to(stdlib_directory())
        if relative.parts[0] in ("site-packages", "dist-packages") or "test" in relative.parts[0]:
            continue
        data = source.read_bytes()
        count = len(chunks_for_files(files=[(relative.as_posix(), data)], config=config))
        if count == 0:
            continue
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        total += count
        if total >= target_chunks:
            break
    return total


def fresh_snapshot_timing(
    *, target_chunks: int, backend: str, max_seq_length: int, encoder_cache: Path, reference_rate: float | None,
    max_wait_s: float = 3600.0, poll_s: float = 0.5, build_at_task_start: bool = True,
) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="bench-semantic-snapshot-"))
    root.chmod(0o755)
    try:
        config = SemanticSearchConfig(index_root=root / "index", vector_store="memory", encoder_backend=backend,
                                      max_seq_length=max_seq_length, encoder_cache_dir=encoder_cache,
                                      background_indexing=True)
        chunks = _copy_code(destination=root / "repo", target_chunks=target_chunks, config=config)
        backend_sandboxes = LocalBackend(LocalBackendConfig(root=root / "sandboxes"))
        snapshot = backend_sandboxes.snapshot_create(source=RepoSource(kind="path", location=str(root / "repo")))
        sandbox = backend_sandboxes.sandbox_create(snapshot=snapshot, limits=SandboxLimits())
        text_encoder_load(config=config).encode(["warm up"], batch_size=1)
        try:
            started = time.perf_counter()
            if build_at_task_start:
                index_build_start(sandbox=sandbox, config=config)
            rows = index_progress_list(index_root=config.index_root)
            visible_s = time.perf_counter() - started if rows else float("nan")
            first = semantic_search(sandbox=sandbox, query=QUERY, k=5, config=config)
            first_s = time.perf_counter() - started
            answers, text, last_print = 1, first, started
            while NOT_READY in text and time.perf_counter() - started < max_wait_s:
                time.sleep(poll_s)
                text = semantic_search(sandbox=sandbox, query=QUERY, k=5, config=config)
                answers += 1
                if time.perf_counter() - last_print > 30:
                    last_print = time.perf_counter()
                    rows = index_progress_list(index_root=config.index_root)
                    if rows:
                        print(f"  {time.perf_counter() - started:.0f} s: {rows[0].state} {rows[0].chunks_done}/"
                              f"{rows[0].chunks_total} chunks encoded, load {os.getloadavg()[0]:.1f}", flush=True)
            semantic_s = time.perf_counter() - started
            rows = index_progress_list(index_root=config.index_root)
            encoded = rows[0].chunks_done if rows else 0
        finally:
            sandbox.destroy()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ready = NOT_READY not in text
    outcome = (f"semantic after {semantic_s:.1f} s ({chunks / semantic_s:.0f} chunks/s end to end" if ready else
               f"NOT semantic yet when the benchmark stopped waiting at {semantic_s:.0f} s ({encoded} of {chunks} "
               f"chunks encoded, {encoded / semantic_s:.1f} chunks/s")
    print(f"progress visible on the task page / metrics after {visible_s:.3f} s "
          f"({'build started with the task' if build_at_task_start else 'build started by the first search'})")
    print(f"fresh snapshot of {chunks} chunks ({backend}, {max_seq_length} tokens): first answer (BM25, "
          f"{'stand-in' if NOT_READY in first else 'already semantic'}) after {first_s:.2f} s; {outcome}, "
          f"{answers} searches answered meanwhile)"
          + (f"; the reference path would need ~{chunks / reference_rate:.0f} s before any answer"
             if reference_rate else ""))
    return {"snapshot_chunks": chunks, "snapshot_progress_visible_s": visible_s,
            "snapshot_first_answer_s": first_s, "snapshot_semantic_s": semantic_s,
            "snapshot_ready": float(ready), "snapshot_chunks_encoded": encoded,
            "snapshot_reference_estimate_s": chunks / reference_rate if reference_rate else float("nan")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=20_000, help="chunks of the fresh snapshot")
    parser.add_argument("--backend", default=SemanticSearchConfig.encoder_backend)
    parser.add_argument("--max-seq-length", type=int, default=SemanticSearchConfig.max_seq_length)
    parser.add_argument("--encoder-cache", default="var/sandboxes/semantic-encoders", help="ONNX export cache")
    parser.add_argument("--max-wait", type=float, default=3600.0, help="stop waiting for semantic answers after")
    parser.add_argument("--poll-s", type=float, default=5.0, help="seconds between the agent's searches")
    parser.add_argument("--build-at-first-search", action="store_true",
                        help="do not start the build with the task (the behaviour before 2026-11-29c)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)", flush=True)
    figures = fresh_snapshot_timing(target_chunks=args.chunks, backend=args.backend,
                                    max_seq_length=args.max_seq_length, encoder_cache=Path(args.encoder_cache),
                                    reference_rate=None, max_wait_s=args.max_wait, poll_s=args.poll_s,
                                    build_at_task_start=not args.build_at_first_search)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
