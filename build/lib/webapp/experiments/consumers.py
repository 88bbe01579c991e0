"""Live experiment dashboard: a snapshot of every step on connect, then each new step as it lands."""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.http import Http404

from webapp.agents.selectors import LIVE_CHANNEL_LAYER
from webapp.core.consumers import DirectDispatchMixin
from webapp.experiments.selectors import experiment_get, experiment_group_name, experiment_steps


@database_sync_to_async
def _snapshot(user, pk: int) -> dict | None:
    try:
        experiment = experiment_get(user=user, pk=pk)
    except Http404:
        return None
    return {
        "kind": "snapshot",
        "status": experiment.status,
        "reason": experiment.status_reason,
        "current_step": experiment.current_step,
        "total_steps": experiment.total_steps,
        "steps": experiment_steps(experiment=experiment),
    }


class ExperimentConsumer(DirectDispatchMixin, AsyncJsonWebsocketConsumer):
    """Anonymous users get 4401, users who may not see the experiment 4404 (same as a missing one).

    Updates travel on the pub/sub layer: a viewer that was away gets everything from the snapshot.
    """

    channel_layer_alias = LIVE_CHANNEL_LAYER

    async def connect(self):
        user = self.scope.get("user")
        if not user or not user.is_authenticated:
            await self.close(code=4401)
            return
        pk = self.scope["url_route"]["kwargs"]["experiment_id"]
        # Join first so no step can land between the snapshot and the subscription.
        self.group = experiment_group_name(experiment_id=pk)
        await self.channel_layer.group_add(self.group, self.channel_name)
        snapshot = await _snapshot(user, pk)
        if snapshot is None:
            await self.channel_layer.group_discard(self.group, self.channel_name)
            self.group = None
            await self.close(code=4404)
            return
        await self.accept()
        await self.send_json(snapshot)

    async def disconnect(self, code):
        if getattr(self, "group", None):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def experiment_update(self, message):
        await self.send_json(message["message"])
