from django.apps import AppConfig


class AgentsConfig(AppConfig):
    name = "webapp.agents"
    label = "agents"
