"""Live event stream of one task: ``/ws/tasks/<id>/events/?after=<seq>``.

Resume protocol: the client passes the last ``seq`` it has (``after``, default -1). The consumer
joins the task's group *before* reading the backlog from the database, then forwards live events
with ``seq`` above the last one sent. Duplicates (an event both in the backlog and live) are
dropped; a gap (a live event skipped ahead, e.g. a dropped channel message) is filled from the
database, so a reconnecting browser gets exactly the events it missed.

Group messages are ``{"type": "task.event", "seq": first, "last_seq": last, "text": <the client
frame for events first..last, serialised once by the publisher>}`` and ``{"type": "task.status", ...}``.
They reach the consumers of one server process through one subscription (``TASK_EVENTS_FANOUT``); each
consumer forwards them in order from a task of its own, so a slow viewer only delays itself.

Messages sent to the client: ``{"type": "events", "events": [{...}, ...]}`` (consecutive events,
in order), ``{"type": "status", ...}`` and ``{"type": "backlog_done", "last_seq": n}`` once the
catch-up is complete.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.http import Http404

from webapp.agents.selectors import (
    LIVE_CHANNEL_LAYER,
    event_to_wire,
    task_events_after,
    task_get,
    task_group_name,
)
from webapp.core.consumers import DirectDispatchMixin
from webapp.core.fanout import GroupFanout
from webapp.core.metrics import observe_live_message

logger = logging.getLogger(__name__)

BACKLOG_PAGE = 500
TASK_EVENTS_FANOUT = GroupFanout(LIVE_CHANNEL_LAYER, on_message=observe_live_message)


@database_sync_to_async
def _visible_task(user, task_id):
    try:
        return task_get(user=user, pk=task_id)
    except Http404:
        return None


@database_sync_to_async
def _events_after(task, after: int, before: int | None = None) -> list[dict]:
    events = task_events_after(task=task, after=after, limit=BACKLOG_PAGE)
    return [event_to_wire(event=e) for e in events if before is None or e.seq < before]


@database_sync_to_async
def _status(task) -> dict:
    task.refresh_from_db(fields=["status", "status_reason", "last_seq"])
    return {"type": "status", "status": task.status, "reason": task.status_reason, "last_seq": task.last_seq}


class TaskEventsConsumer(DirectDispatchMixin, AsyncWebsocketConsumer):
    # Channels gives every consumer a channel of its own; on the pub/sub layer an idle one costs a
    # subscription and no work per message (the default layer would poll Redis for each viewer).
    channel_layer_alias = LIVE_CHANNEL_LAYER
    group: str | None = None
    forwarder: asyncio.Task | None = None

    async def __call__(self, scope, receive, send):
        # Here rather than in disconnect(): a consumer that fails or is cancelled never gets there,
        # and a member left in the fan-out would queue every later event of the task forever.
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.forwarder is not None:
                self.forwarder.cancel()
            if self.group is not None:
                await TASK_EVENTS_FANOUT.leave(self.group, self)

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        self.task = await _visible_task(user, self.scope["url_route"]["kwargs"]["task_id"])
        if self.task is None:
            await self.close(code=4404)
            return
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        try:
            self.last_sent = int(query.get("after", ["-1"])[0])
        except ValueError:
            await self.close(code=4400)
            return
        self.inbox: deque[dict] = deque()
        self.inbox_ready: asyncio.Future | None = None
        self.group = task_group_name(task_id=self.task.pk)
        await TASK_EVENTS_FANOUT.join(self.group, self)
        await self.accept()
        await self._send_backlog()
        await self.send(text_data=json.dumps(await _status(self.task)))
        await self.send(text_data=json.dumps({"type": "backlog_done", "last_seq": self.last_sent}))
        # Live messages that arrived during the backlog wait in the inbox; from here on they go out in order.
        self.forwarder = asyncio.create_task(self._forward())

    def offer(self, message: dict) -> None:
        self.inbox.append(message)
        if self.inbox_ready is not None and not self.inbox_ready.done():
            self.inbox_ready.set_result(None)

    async def _forward(self) -> None:
        try:
            while True:
                while self.inbox:
                    message = self.inbox.popleft()
                    if message["type"] == "task.event":
                        await self._task_event(message)
                    elif message["type"] == "task.status":
                        await self._task_status(message)
                self.inbox_ready = asyncio.get_running_loop().create_future()
                await self.inbox_ready
        except OSError:
            pass  # the client went away; its disconnect ends this consumer
        except Exception:
            # Without this task the viewer would silently stop getting events: close, it reconnects.
            logger.exception("live events of task %s stopped", self.task.pk)
            await self.close(code=1011)

    async def _send_backlog(self, before: int | None = None) -> None:
        while True:
            events = await _events_after(self.task, self.last_sent, before)
            if events:
                await self.send(text_data=json.dumps({"type": "events", "events": events}))
                self.last_sent = events[-1]["seq"]
            if len(events) < BACKLOG_PAGE:
                return

    async def _task_event(self, message):
        first, last = message["seq"], message["last_seq"]
        if last <= self.last_sent:
            return
        if first != self.last_sent + 1:
            # A gap (lost message) or an overlap with the backlog: the database has them all.
            await self._send_backlog(before=last + 1)
            return
        await self.send(text_data=message["text"])
        self.last_sent = last

    async def _task_status(self, message):
        if message["last_seq"] > self.last_sent:
            # An event message was lost (pub/sub keeps nothing): the status says how far the task is.
            await self._send_backlog()
        await self.send(text_data=json.dumps({
            "type": "status", "status": message["status"], "reason": message["reason"], "last_seq": message["last_seq"],
        }))

    async def receive(self, text_data=None, bytes_data=None):
        # The stream is one-way; a client may send {"type": "ping"} to keep proxies from idling it out.
        try:
            message = json.loads(text_data or "{}")
        except ValueError:
            return
        if isinstance(message, dict) and message.get("type") == "ping":
            await self.send(text_data=json.dumps({"type": "pong"}))
