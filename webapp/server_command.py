"""The command line that serves the ASGI app, shared by `make run`, the test fixtures and the benchmarks,
so that what the tests and benchmarks measure is what users run.

Its logging (``uvicorn_logging.json``: uvicorn's own configuration plus ``RedactSecrets`` on both
handlers) keeps credentials out of the logs: websocket clients authenticate with ``?token=`` (a
browser cannot set headers on a websocket), and uvicorn writes every request line and websocket
path in full.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

LOG_CONFIG = Path(__file__).resolve().with_name("uvicorn_logging.json")

SECRET_QUERY = re.compile(r"(?i)((?:^|[?&;])[\w.-]*(?:token|secret|password|passwd|api_?key)=)[^&;#\s\"']*")
"""A query parameter whose name says it carries a credential (token, access_token, api_key, ...)."""
REDACTED = "[redacted]"


def redact(text: str) -> str:
    return SECRET_QUERY.sub(lambda match: match.group(1) + REDACTED, text)


class RedactSecrets(logging.Filter):
    """Rewrites a record's message and string arguments so no credential query value is written.
    On a handler, it sees every record that handler formats, whichever logger sent it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(arg) if isinstance(arg, str) else arg for arg in record.args)
        elif isinstance(record.args, dict):
            record.args = {key: redact(value) if isinstance(value, str) else value for key, value in record.args.items()}
        return True


def asgi_server_command(*, host: str, port: int, log_level: str = "info") -> list[str]:
    return [
        sys.executable, "-m", "uvicorn", "webapp.asgi:application",
        "--host", host, "--port", str(port), "--log-level", log_level, "--log-config", str(LOG_CONFIG),
        # Per-message deflate compresses every live event once per viewer, which costs latency when
        # many viewers watch one task (docs/notebook/events.md).
        "--ws-per-message-deflate", "false",
    ]
