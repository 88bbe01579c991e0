from django.contrib import admin

from webapp.registry.models import RegisteredModel


@admin.register(RegisteredModel)
class RegisteredModelAdmin(admin.ModelAdmin):
    list_display = ("name", "family", "total_parameters", "active_parameters", "dtype", "owner", "created_at")
    list_filter = ("family", "dtype")
    search_fields = ("name", "source")
    readonly_fields = ("checksum", "directory", "source", "size_bytes", "created_at")
