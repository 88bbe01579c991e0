"""The one way every app publishes to Channels groups: a batched publisher thread.

``async_to_sync(group_send)`` per message would build a new event loop and Redis connection each
time (milliseconds) and block the caller; here the caller only enqueues. One long-lived event loop
thread per process sends the messages in submission order (one coroutine sends them one after
another), waiting ``COALESCE_WINDOW_S`` after the first of a batch so that a turn's task events,
committed milliseconds apart, leave as one message. A lost message costs a viewer nothing: every
consumer fills gaps from the database (or sends a fresh snapshot on connect).

Services call ``publish_on_commit`` so nobody is told about rows that were rolled back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

from channels.layers import get_channel_layer
from django.db import transaction

logger = logging.getLogger(__name__)

DEFAULT_CHANNEL_LAYER = "default"
"""Channel layer alias of the fleet dashboard and user notifications (settings.CHANNEL_LAYERS)."""
LIVE_CHANNEL_LAYER = "agents-live"
"""Channel layer alias (settings.CHANNEL_LAYERS) that carries live task and experiment events."""
MAX_EVENTS_PER_MESSAGE = 64
COALESCE_WINDOW_S = 0.01


class GroupPublisher:
    """Sends group messages from one long-lived event loop thread, in submission order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None
        self._pid = 0

    def _ensure_started(self) -> None:
        with self._lock:
            # After a fork (prefork Celery pool) the parent's thread does not exist in the child.
            if self._loop is not None and self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self._loop = loop = asyncio.new_event_loop()
            queue: asyncio.Queue = asyncio.Queue()
            self._queue = queue
            ready = threading.Event()
            threading.Thread(target=self._serve, args=(loop, queue, ready), name="channels-publisher",
                             daemon=True).start()
            ready.wait(5)

    def _serve(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_until_complete(self._drain(queue))

    async def _drain(self, queue: asyncio.Queue) -> None:
        layers: dict[str, Any] = {}
        while True:
            batch = [await queue.get()]
            # A turn's events are committed a few milliseconds apart; waiting a moment lets them
            # leave as one message, which matters when hundreds of viewers each get every message.
            await asyncio.sleep(COALESCE_WINDOW_S)
            while not queue.empty() and len(batch) < MAX_EVENTS_PER_MESSAGE:
                batch.append(queue.get_nowait())
            # Messages of different layers never merge: the (layer, group) pair is the group key.
            for (alias, group), message in coalesce_events([((alias, group), message)
                                                            for alias, group, message, _ in batch]):
                try:
                    if alias not in layers:
                        layers[alias] = get_channel_layer(alias)
                    if layers[alias] is not None:
                        await layers[alias].group_send(group, message)
                except Exception:  # a broken channel layer must not fail the caller; viewers resume from the DB
                    logger.exception("could not publish to %s", group)
            for *_, done in batch:
                queue.task_done()
                if done is not None:
                    done.set()

    def submit(self, group: str, message: dict, *, wait_s: float = 0.0, layer: str = LIVE_CHANNEL_LAYER) -> None:
        """Queue ``message`` for ``group`` of channel layer ``layer``; with ``wait_s``, wait up to that
        long until it was sent (a process about to exit still sends its last message)."""
        self._ensure_started()
        loop, queue = self._loop, self._queue
        assert loop is not None and queue is not None  # _ensure_started made both
        done = threading.Event() if wait_s else None
        loop.call_soon_threadsafe(queue.put_nowait, (layer, group, message, done))
        if done is not None:
            done.wait(wait_s)


publisher = GroupPublisher()
"""The publisher of this process; every app publishes through it."""


def coalesce_events(items: list[tuple[Any, dict]]) -> list[tuple[Any, dict]]:
    """Merge consecutive events of one task into one group message (one websocket frame per viewer).

    A turn publishes several events within milliseconds (model output, its tool calls, then their
    results); with hundreds of viewers each extra message costs hundreds of deliveries. Order is
    kept: only neighbours merge, and a status message ends a run of events.
    """
    merged: list[tuple[Any, dict]] = []
    pending: list[str] = []
    pending_group: Any = ""
    first_seq, last_seq, first_ts = 0, 0, None

    def flush() -> None:
        if pending:
            text = '{"type": "events", "events": [' + ", ".join(pending) + "]}"
            merged.append((pending_group, {"type": "task.event", "seq": first_seq, "last_seq": last_seq, "ts": first_ts,
                                           "text": text}))
            pending.clear()

    for group, message in items:
        if message.get("type") != "task.event":
            flush()
            merged.append((group, message))
            continue
        if pending and (group != pending_group or message["seq"] != last_seq + 1):
            flush()
        if not pending:
            pending_group, first_seq, first_ts = group, message["seq"], message.get("ts")
        pending.append(message["event_json"])
        last_seq = message["seq"]
    flush()
    return merged


def publish(*, group: str, message: dict, layer: str = LIVE_CHANNEL_LAYER, wait_s: float = 0.0) -> None:
    """Send ``message`` to ``group`` through the process's publisher (never blocks longer than ``wait_s``)."""
    publisher.submit(group, message, wait_s=wait_s, layer=layer)


def publish_on_commit(*, group: str, message: dict, layer: str = LIVE_CHANNEL_LAYER, wait_s: float = 0.0) -> None:
    """``publish`` once the current transaction commits (at once outside one); a publishing error is
    logged, never raised into the service that committed."""
    transaction.on_commit(lambda: publish(group=group, message=message, layer=layer, wait_s=wait_s), robust=True)
