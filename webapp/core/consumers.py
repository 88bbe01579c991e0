from channels.generic.websocket import AsyncJsonWebsocketConsumer

from webapp.core.notifications import user_group_name


class NotificationConsumer(AsyncJsonWebsocketConsumer):
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
