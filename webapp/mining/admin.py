from django.contrib import admin

from webapp.mining.models import MinedTask, TaskSet


@admin.register(TaskSet)
class TaskSetAdmin(admin.ModelAdmin):
    list_display = ("name", "repo_label", "commit", "status", "owner", "team")
    list_filter = ("status",)
    search_fields = ("name", "repo_label")


@admin.register(MinedTask)
class MinedTaskAdmin(admin.ModelAdmin):
    list_display = ("task_id", "task_set", "split", "source", "kind", "path", "expert_solved")
    list_filter = ("split", "source", "kind")
    search_fields = ("task_id", "path")
    raw_id_fields = ("task_set",)
