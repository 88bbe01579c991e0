from django.apps import AppConfig


class MiningConfig(AppConfig):
    name = "webapp.mining"
    label = "mining"
    default_auto_field = "django.db.models.BigAutoField"
