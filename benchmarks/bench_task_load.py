"""Task load: N scripted tasks POSTed at concurrency C to a real stack; how fast they are accepted
and finished, the API latency of a submission, and whether any task was lost or ran twice.

The stack is ``make run``'s (``benchmarks/task_load.py``): a fresh database (SQLite file in WAL mode,
or a fresh PostgreSQL database), a private redis-server, the ASGI server and a prefork Celery worker
at its default concurrency; the agent is the scripted expert in a local sandbox (no model).
Figures: tasks/s submitted (accepted / time to submit all), tasks/s finished (tasks / time from the
first POST to the last one terminal), p50/p99 latency of ``POST /api/tasks/``, lost (not succeeded)
and duplicated (an agent started twice) counts.

Run:  .venv/bin/python benchmarks/bench_task_load.py [--tasks 50] [--concurrency 10]
      [--backend sqlite|postgresql|both] [--postgres postgres://postgres@127.0.0.1:5432/x]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.task_load import (
    Stack,
    load_run,
    postgres_database_create,
    postgres_database_drop,
    redis_server_start,
)


def bench(backend: str, *, tasks: int, concurrency: int, postgres: str) -> dict:
    state = Path(tempfile.mkdtemp(prefix=f"bench-task-load-{backend}-"))
    redis_proc, redis_url = redis_server_start(state)
    url = (f"sqlite:///{state / 'flowstate.sqlite3'}" if backend == "sqlite"
           else postgres_database_create(postgres, f"flowstate_bench_load_{uuid.uuid4().hex[:8]}"))
    stack = Stack(database_url=url, redis_url=redis_url, state_dir=state / "state")
    try:
        stack.prepare()
        stack.start_worker("bench")
        _, address = stack.start_asgi()
        return {"backend": backend, **load_run(stack, address, count=tasks, concurrency=concurrency, timeout=1800)}
    finally:
        stack.stop()
        redis_proc.kill()
        redis_proc.wait(timeout=10)
        if backend == "postgresql":
            postgres_database_drop(url)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tasks", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--postgres", default=os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/flowstate"))
    args = parser.parse_args()
    if args.tasks < 1 or args.concurrency < 1:
        parser.error("--tasks and --concurrency must be at least 1")
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    failed = False
    for backend in backends:
        report = bench(backend, tasks=args.tasks, concurrency=args.concurrency, postgres=args.postgres)
        print(f"{backend}: {report['tasks']} tasks at concurrency {report['concurrency']}: "
              f"submitted {report['submit_per_s']:.1f}/s, finished {report['finish_per_s']:.2f}/s, "
              f"POST p50 {report['p50_api_ms']:.0f} ms p99 {report['p99_api_ms']:.0f} ms, "
              f"lost {report['lost']}, duplicated {report['duplicated']}, wall {report['wall_s']:.1f} s")
        print(json.dumps(report))
        failed |= bool(report["problems"] or report["lost"] or report["duplicated"] or report["rejected"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
