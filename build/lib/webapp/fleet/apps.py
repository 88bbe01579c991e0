from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "webapp.fleet"
    label = "fleet"
