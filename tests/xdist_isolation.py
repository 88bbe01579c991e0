"""Give each pytest-xdist worker its own Redis database and sandbox root (`-p tests.xdist_isolation`).

CI runs the suite as `pytest -n 2 --dist loadfile` to use both cores while tests wait on servers,
workers and sandboxes. pytest-django already gives each worker its own test database (suffix
``_gw<N>``); this plugin does the same for what the tests share through the environment:

- ``REDIS_URL``: the Celery broker and channel layer. Two workers on one database number would
  consume each other's task messages (a worker of ``gw0`` would run a task recorded in ``gw1``'s
  database and not find it).
- ``SANDBOX_ROOT``: snapshots, sandboxes and Docker containers are labelled with their root, and the
  retention and reaping code treats what its database does not reference as garbage. One root per
  worker keeps one worker's cleanup from removing the other's sandboxes.

It runs at import, before pytest-django sets Django up, which is why it is a `-p` plugin and not a
conftest fixture. Without xdist (``PYTEST_XDIST_WORKER`` unset) it changes nothing.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def _worker_index() -> int | None:
    match = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(match.group(1)) if match else None


def _redis_url_for(url: str, index: int) -> str:
    """The same server, database number 15 - index (test runs use the top numbers; see test_services)."""
    if not url.startswith(("redis://", "rediss://")):
        raise RuntimeError(f"xdist isolation needs a redis:// REDIS_URL, not {url!r} (run `make test`)")
    server = re.sub(r"/\d*$", "", url)
    return f"{server}/{15 - index}"


def _isolate(index: int) -> None:
    os.environ["REDIS_URL"] = _redis_url_for(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15"), index)
    if "SANDBOX_ROOT" not in os.environ:
        from sandboxes.paths import default_sandbox_root

        state_dir = Path(os.environ.get("FLOWSTATE_STATE_DIR", Path(__file__).resolve().parent.parent / "var"))
        root = default_sandbox_root(state_dir)
        os.environ["SANDBOX_ROOT"] = str(root.with_name(f"{root.name}-gw{index}"))


_index = _worker_index()
if _index is not None:
    _isolate(_index)
