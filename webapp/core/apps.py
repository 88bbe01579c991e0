from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "webapp.core"
    label = "core"

    def ready(self) -> None:
        from django.core.signals import setting_changed

        from webapp.core.sandbox_settings import sandbox_settings_changed, sandbox_settings_push

        # The sandbox layer never reads Django settings: it is handed them here, once.
        sandbox_settings_push()
        setting_changed.connect(sandbox_settings_changed, dispatch_uid="sandbox-settings")
