from django.contrib import admin

from webapp.fleet.models import HostUtilisationSample, SandboxHost, SandboxRecord


@admin.register(SandboxHost)
class SandboxHostAdmin(admin.ModelAdmin):
    list_display = ("name", "state", "backend", "runtime", "slots_used", "slots_total", "queue_product", "queue_training",
                    "cpu_percent", "memory_percent", "last_heartbeat_at")
    list_filter = ("state", "backend")
    search_fields = ("name",)


@admin.register(SandboxRecord)
class SandboxRecordAdmin(admin.ModelAdmin):
    list_display = ("sandbox_id", "host", "state", "purpose", "cpu_percent", "memory_mb", "created_at", "ended_at")
    list_filter = ("state", "purpose")
    search_fields = ("sandbox_id",)


@admin.register(HostUtilisationSample)
class HostUtilisationSampleAdmin(admin.ModelAdmin):
    list_display = ("host", "at", "cpu_percent", "memory_percent", "sandboxes_live", "queue_length")
    list_filter = ("host",)
