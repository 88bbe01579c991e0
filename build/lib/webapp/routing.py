"""Websocket routes. Each app appends its own consumers here."""

from django.urls import path

from webapp.agents.consumers import TaskEventsConsumer
from webapp.core.consumers import NotificationConsumer
from webapp.experiments.consumers import ExperimentConsumer
from webapp.fleet.consumers import FleetConsumer

websocket_urlpatterns: list = [
    path("ws/notifications/", NotificationConsumer.as_asgi()),
    path("ws/fleet/", FleetConsumer.as_asgi()),
    path("ws/tasks/<int:task_id>/events/", TaskEventsConsumer.as_asgi()),
    path("ws/experiments/<int:experiment_id>/", ExperimentConsumer.as_asgi()),
]
