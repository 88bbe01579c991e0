"""The command line that serves the ASGI app, shared by `make run`, the test fixtures and the benchmarks,
so that what the tests and benchmarks measure is what users run."""

from __future__ import annotations

import sys


def asgi_server_command(*, host: str, port: int, log_level: str = "info") -> list[str]:
    return [
        sys.executable, "-m", "uvicorn", "webapp.asgi:application",
        "--host", host, "--port", str(port), "--log-level", log_level,
        # Per-message deflate compresses every live event once per viewer: +30 ms p99 with 500
        # viewers of one task (docs/notebook/events.md, stop 12).
        "--ws-per-message-deflate", "false",
    ]
