from django.contrib import admin

from webapp.agents.models import (
    AgentTask,
    Repository,
    RepositoryCredential,
    TaskBranch,
    TaskEvent,
    TaskFollowUp,
)


@admin.register(Repository)
class RepositoryAdmin(admin.ModelAdmin):
    list_display = ("name", "kind", "location", "owner", "team", "created_at")
    list_filter = ("kind",)
    search_fields = ("name", "location")


@admin.register(AgentTask)
class AgentTaskAdmin(admin.ModelAdmin):
    list_display = ("public_id", "owner", "source", "status", "repo_label", "model_name", "turns", "reward", "created_at")
    list_filter = ("status", "source", "backend")
    search_fields = ("public_id", "repo_label", "prompt", "experiment_name")
    # The API key is write-only everywhere, the admin included.
    exclude = ("api_key",)
    readonly_fields = ("public_id", "claim_token", "last_seq", "heartbeat_at", "started_at", "finished_at")


@admin.register(TaskEvent)
class TaskEventAdmin(admin.ModelAdmin):
    list_display = ("task", "seq", "kind", "tool_name", "turn", "attempt")
    list_filter = ("kind",)
    search_fields = ("task__public_id", "tool_name")
    raw_id_fields = ("task",)


@admin.register(TaskFollowUp)
class TaskFollowUpAdmin(admin.ModelAdmin):
    list_display = ("task", "author", "status", "workspace", "created_at", "delivered_at")
    list_filter = ("status", "workspace")
    raw_id_fields = ("task",)


@admin.register(TaskBranch)
class TaskBranchAdmin(admin.ModelAdmin):
    list_display = ("task", "name", "commit", "pushed_to", "created_by", "created_at")
    search_fields = ("name", "commit")
    raw_id_fields = ("task",)


@admin.register(RepositoryCredential)
class RepositoryCredentialAdmin(admin.ModelAdmin):
    list_display = ("repository", "username", "updated_at")
    # The secret is write-only everywhere (docs/SECURITY.md), the admin included: it shows who, not what.
    exclude = ("secret_encrypted",)
