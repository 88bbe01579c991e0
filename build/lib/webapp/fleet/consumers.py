from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from webapp.core.consumers import DirectDispatchMixin
from webapp.fleet.events import FLEET_GROUP
from webapp.fleet.selectors import fleet_overview


class FleetConsumer(DirectDispatchMixin, AsyncJsonWebsocketConsumer):
    """Live fleet stream for any signed-in user: an overview on connect, then one event per heartbeat.

    Anonymous connections are closed with 4401. Events carry host utilisation and sandbox states
    only, never task contents, so every signed-in user may watch.
    """

    async def connect(self):
        user = self.scope.get("user")
        if not user or not user.is_authenticated:
            await self.close(code=4401)
            return
        # Join before reading the overview so no heartbeat can fall between the two.
        await self.channel_layer.group_add(FLEET_GROUP, self.channel_name)
        self.joined = True
        await self.accept()
        await self.send_json({"kind": "overview", "overview": await database_sync_to_async(fleet_overview)()})

    async def disconnect(self, code):
        if getattr(self, "joined", False):
            await self.channel_layer.group_discard(FLEET_GROUP, self.channel_name)

    async def fleet_event(self, message):
        await self.send_json(message["event"])
