from channels.consumer import get_handler_name
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from webapp.core.notifications import user_group_name


class DirectDispatchMixin:
    """For consumers that touch the database only through ``database_sync_to_async``.

    Channels' default ``dispatch`` runs ``close_old_connections()`` through ``sync_to_async`` before
    every message: one hop onto the single thread-sensitive worker thread per viewer per event, so
    N viewers of one task queue N hops behind each other for every event (docs/notebook/events.md).
    ``database_sync_to_async`` closes stale connections itself, so the hop buys nothing here.
    """

    async def dispatch(self, message):
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)


class NotificationConsumer(DirectDispatchMixin, AsyncJsonWebsocketConsumer):
    """The signed-in user's own events (task finished, worker probe...). Anonymous: closed with 4401."""

    async def connect(self):
        user = self.scope.get("user")
        if not user or not user.is_authenticated:
            await self.close(code=4401)
            return
        self.group = user_group_name(user.pk)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code):
        if hasattr(self, "group"):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def notify(self, message):
        await self.send_json(message["event"])
