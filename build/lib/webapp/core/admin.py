from django.contrib import admin

from webapp.core.models import WorkerProbe


@admin.register(WorkerProbe)
class WorkerProbeAdmin(admin.ModelAdmin):
    list_display = ("nonce", "worker_hostname", "worker_pid", "created_at")
